"""The connector's settings: the kv_connector_extra_config a kvpush instance is started with (one
typed model, written by `kvpush plan` and read here), what vLLM's own config adds, and start-up
refusals."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from .liveness import DEFAULT_SILENCE_S

CPU_IDLE_WAIT_MS = 20.0
# verify_kv's default (docs/connector.md, "End-to-end KV check"): off, since hashing the KV costs
# well over 2% of TTFT on CPU (benchmarks/results/verify-kv-cpu-2026-12-05) and on an H100 too
# (benchmarks/results/gpu-real-vllm-h100-2026-12-06). Being off by default,
# it is no security setting: a topology's extra_config may turn it on (or leave it off).
VERIFY_KV = False
GPU_IDLE_WAIT_MS = 2.0
# A backstop for a leg that never reached the other side: a dead or hung prefill is noticed in
# ~1 s by the side channel's ping, and a busy one may hold a request queued for many seconds.
TRANSFER_TIMEOUT_S = 30.0


def kv_on_cpu(kv_transfer_config: Any) -> bool:
    """vLLM keeps this connector's KV cache in host memory (kv_buffer_device unset or "cpu")."""
    return (kv_transfer_config.kv_buffer_device or "cpu") == "cpu"


class UnsupportedDeployment(ValueError):
    """A configuration kvpush's connector refuses at start-up, with the reason and the fix."""


class ConnectorExtraConfig(BaseModel):
    """A kvpush instance's kv_connector_extra_config: what deploy/plan/vllm_launch.py builds and dumps
    into --kv-transfer-config, and what Settings.from_vllm reads back. Each default lives here only."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, allow_inf_nan=False)

    # Set by kvpush from the deployment; a topology may not set them (deploy/topology/topology_values.py,
    # KVPUSH_SECURITY_KEYS).
    side_channel_host: str = Field(min_length=1)
    side_channel_port: int = Field(ge=0, le=65535)
    allowed_engines: list[str]
    secret_file: str  # the deployment secret's file on this host: the side-channel key is derived from it
    peer_side_channels: dict[str, str] | None = None  # engine id -> "host:port" of each allowed peer
    # Tunable: the topology's connector section (backend, transfer_timeout_s) or its extra_config.
    backend: str = "UCX"
    transfer_timeout_s: float = Field(TRANSFER_TIMEOUT_S, gt=0)
    peer_silence_s: float = Field(DEFAULT_SILENCE_S, gt=0)
    progress_delay_us: int | None = Field(None, ge=0)  # None: transfer.PROGRESS_DELAY_US by memory type
    idle_wait_ms: float | None = Field(None, ge=0)  # None: CPU_IDLE_WAIT_MS or GPU_IDLE_WAIT_MS by buffer device
    stream_writes: bool = True
    huge_pages: bool = True
    accepted_timeout_s: float = Field(300.0, gt=0)
    late_write_hold_s: float = Field(30.0, ge=0)
    verify_kv: bool = VERIFY_KV

    @field_validator("secret_file")
    @classmethod
    def _names_a_file(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("must name the deployment secret's file")
        return value

    @field_validator("peer_side_channels")
    @classmethod
    def _host_and_port(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        for address in (value or {}).values():
            host, _, port = address.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError("must map engine ids to 'host:port'")
        return value

    @classmethod
    def parse(cls, extra: Any) -> ConnectorExtraConfig:
        """The model of vLLM's kv_connector_extra_config, or UnsupportedDeployment naming the entry."""
        try:
            return cls.model_validate(dict(extra or {}))
        except ValidationError as exc:
            raise UnsupportedDeployment(_problem(exc, dict(extra or {}))) from None

    @classmethod
    def entry_problem(cls, name: str, value: Any) -> str | None:
        """What is wrong with one entry given alone (None: nothing), for the topology's loader."""
        if name not in cls.model_fields:
            return "is not a setting of kvpush's connector"
        stand_ins = {"side_channel_host": "h", "side_channel_port": 0, "allowed_engines": [], "secret_file": "f"}
        try:
            cls.model_validate({**stand_ins, name: value})
        except ValidationError:
            return _must_be(name)
        return None

    def to_json_dict(self) -> dict[str, Any]:
        """What goes into --kv-transfer-config (unset optional entries left out: the connector's defaults)."""
        return self.model_dump(mode="json", exclude_none=True)


def _default(name: str) -> Any:
    """A setting's default, as the model declares it (Settings built in code take the same)."""
    return ConnectorExtraConfig.model_fields[name].default


def _must_be(name: str) -> str:
    if name == "secret_file":
        return "must name the deployment secret's file"
    if name == "peer_side_channels":
        return "must map engine ids to 'host:port'"
    field = ConnectorExtraConfig.model_fields[name]
    if field.annotation in (bool, "bool"):
        return "must be true or false"
    bounds = [f"{sign} {getattr(m, attr)}" for m in field.metadata
              for attr, sign in (("gt", ">"), ("ge", ">="), ("le", "<=")) if getattr(m, attr, None) is not None]
    if bounds:
        number = "a whole number" if "int" in str(field.annotation) else "a number"
        return f"must be {number} {' and '.join(bounds)}"
    kind = getattr(field.annotation, "__name__", None) if field.annotation in (str, int, float) else None
    return {"str": "must be text", "int": "must be a whole number"}.get(kind or "", f"must be {field.annotation}")


def _problem(exc: ValidationError, extra: dict[str, Any]) -> str:
    errors = exc.errors()
    missing = [str(e["loc"][0]) for e in errors if e["type"] == "missing"]
    if missing:
        return f"kvpush: kv_connector_extra_config lacks {missing}; generate the config with `kvpush plan`"
    first = errors[0]
    name = str(first["loc"][0])
    if first["type"] == "extra_forbidden":
        known = ", ".join(ConnectorExtraConfig.model_fields)
        return (f"kvpush: kv_connector_extra_config.{name} is not a setting of kvpush's connector; "
                f"the settings are {known}")
    hint = "; generate the config with `kvpush plan`" if name == "secret_file" else ""
    return f"kvpush: kv_connector_extra_config.{name} {_must_be(name)}, not {extra.get(name)!r}{hint}"


@dataclass(frozen=True)
class Settings:
    engine_id: str
    is_producer: bool
    backend: str
    side_channel_host: str
    side_channel_port: int
    allowed_engines: frozenset[str]
    transfer_timeout_s: float
    peer_silence_s: float  # D: a prefill peer that answers no side-channel ping this long is gone
    buffer_device: str  # "cpu" or "cuda"
    model: str
    tp_size: int
    block_size: int
    kv_heads: int  # the model's KV heads, however TP splits them
    progress_delay_us: int | None  # NIXL progress thread's poll timeout; None: transfer.PROGRESS_DELAY_US
    # D: how long a step that computes nothing sleeps for a transfer's outcome. A request that
    # arrives meanwhile waits up to that long to be scheduled. Stepping every ms instead keeps a
    # CPU decode's core busy (~1 core: docs/connector.md, "Threads and memory"); a GPU host has
    # cores to spare.
    idle_wait_ms: float = CPU_IDLE_WAIT_MS
    # P on CPU: write layer by layer, so that D's forward pass computes each layer as it lands
    stream_writes: bool = _default("stream_writes")
    local_ranks: int = 1  # rank processes of this instance on this host (its TP ranks over its nodes)
    huge_pages: bool = _default(
        "huge_pages"
    )  # CPU: collapse the KV cache into 2 MiB pages before registering it (hugepages.py)
    kv_cache_layout: str | None = None  # as vLLM resolved it (e.g. BLHNC), None before vLLM 0.32
    # D: a P that accepted a transfer (it holds the request) but sent nothing this long fails it;
    # a backstop: P's own bounds (transfer_timeout_s, the pings) are shorter and end a stuck
    # transfer first
    accepted_timeout_s: float = _default("accepted_timeout_s")
    # D: the backstop of a fence. The blocks of a transfer given up on while P may still be writing
    # them stay out of vLLM's hands until P says its WRITEs ended or P is gone; if neither comes
    # within this long, decode drops P's connection and lets them go (counted). 0: no backstop.
    # Both kv_load_failure_policy values: under "recompute" vLLM frees a failed load's blocks too.
    late_write_hold_s: float = _default("late_write_hold_s")
    # the deployment secret's file on this host: the side-channel key is derived from it (auth.py).
    # Empty only where code builds Settings itself (benchmarks): an unauthenticated side channel.
    secret_file: str = ""
    # each allowed peer's side channel (engine id -> host, base port), from the deployment's configuration
    peer_side_channels: dict[str, tuple[str, int]] | None = None
    # P: send a digest of each push's KV; D: check its blocks against it before the request runs,
    # a mismatch failing the load (kv_digest.py). Both roles of a deployment must agree: a decode
    # that checks fails every load from a prefill that sends no digest.
    verify_kv: bool = _default("verify_kv")

    @classmethod
    def from_vllm(cls, vllm_config: Any, kv_cache_config: Any = None) -> Settings:
        kv = vllm_config.kv_transfer_config
        if kv.kv_role not in ("kv_producer", "kv_consumer"):
            raise UnsupportedDeployment(
                f"kvpush: kv_role {kv.kv_role!r} is not supported; use kv_producer (prefill) or kv_consumer (decode)"
            )
        extra = ConnectorExtraConfig.parse(kv.kv_connector_extra_config)
        if getattr(vllm_config.model_config, "use_mla", False):
            raise UnsupportedDeployment(
                "kvpush: MLA models are not supported yet; use connector type nixl-pull for this model"
            )
        groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
        if len(groups) > 1:
            raise UnsupportedDeployment(
                f"kvpush: models with {len(groups)} KV cache groups (hybrid attention/mamba) are not supported; use "
                "connector type nixl-pull"
            )
        parallel = vllm_config.parallel_config
        if getattr(parallel, "data_parallel_size", 1) > 1:
            raise UnsupportedDeployment(
                "kvpush: data_parallel_size > 1 is not supported yet (the router cannot tell which DP rank's side "
                "channel holds a request); run one instance per DP rank"
            )
        if getattr(parallel, "pipeline_parallel_size", 1) > 1:
            raise UnsupportedDeployment("kvpush: pipeline parallelism is not supported; use tensor parallelism")
        on_cpu = kv_on_cpu(kv)
        return cls(
            engine_id=str(kv.engine_id),
            is_producer=kv.kv_role == "kv_producer",
            backend=extra.backend,
            side_channel_host=extra.side_channel_host,
            side_channel_port=extra.side_channel_port,
            allowed_engines=frozenset(extra.allowed_engines),
            transfer_timeout_s=extra.transfer_timeout_s,
            peer_silence_s=extra.peer_silence_s,
            buffer_device="cpu" if on_cpu else str(kv.kv_buffer_device),
            model=str(vllm_config.model_config.model),
            tp_size=int(parallel.tensor_parallel_size),
            local_ranks=int(getattr(parallel, "local_world_size", parallel.tensor_parallel_size)),
            kv_heads=int(vllm_config.model_config.get_total_num_kv_heads()),
            block_size=int(vllm_config.cache_config.block_size),
            progress_delay_us=extra.progress_delay_us,
            idle_wait_ms=(extra.idle_wait_ms if extra.idle_wait_ms is not None
                          else CPU_IDLE_WAIT_MS if on_cpu else GPU_IDLE_WAIT_MS),
            stream_writes=extra.stream_writes,
            huge_pages=extra.huge_pages,
            kv_cache_layout=(getattr(kv_cache_config, "kv_cache_layout", None)
                             or getattr(vllm_config.cache_config, "kv_cache_layout", None)),
            accepted_timeout_s=extra.accepted_timeout_s,
            secret_file=extra.secret_file,
            peer_side_channels=_addresses(extra.peer_side_channels),
            late_write_hold_s=extra.late_write_hold_s,
            verify_kv=extra.verify_kv,
        )


def _addresses(value: dict[str, str] | None) -> dict[str, tuple[str, int]] | None:
    """{"engine": "host:port"} -> {"engine": ("host", port)} (the model checked the form); None where not given."""
    if value is None:
        return None
    return {engine: (address.rpartition(":")[0], int(address.rpartition(":")[2])) for engine, address in value.items()}


def side_channel_key(settings: Settings) -> bytes:
    """The key this instance's side channel authenticates with, from the deployment secret
    (empty: no secret file, no authentication)."""
    from kvpush.common.deployment_secret import SIDE_CHANNEL, SecretFileError, derive_key, read_secret

    if not settings.secret_file:
        return b""
    try:
        return derive_key(read_secret(settings.secret_file), SIDE_CHANNEL)
    except SecretFileError as exc:
        raise UnsupportedDeployment(f"kvpush: kv_connector_extra_config.secret_file: {exc}") from None


def transfer_params_key(settings: Settings) -> bytes | None:
    """The key the router signs kv_transfer_params with (kvpush.common.kv_params), derived from the
    deployment secret; None without a secret file (params are then taken unsigned)."""
    from kvpush.common.deployment_secret import TRANSFER_PARAMS, SecretFileError, derive_key, read_secret

    if not settings.secret_file:
        return None
    try:
        return derive_key(read_secret(settings.secret_file), TRANSFER_PARAMS)
    except SecretFileError as exc:
        raise UnsupportedDeployment(f"kvpush: kv_connector_extra_config.secret_file: {exc}") from None
