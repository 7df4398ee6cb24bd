"""The connector's settings, read from vLLM's kv_transfer_config, and start-up refusals."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .liveness import DEFAULT_SILENCE_S


CPU_IDLE_WAIT_MS = 20.0
GPU_IDLE_WAIT_MS = 2.0


def kv_on_cpu(kv_transfer_config: Any) -> bool:
    """vLLM keeps this connector's KV cache in host memory (kv_buffer_device unset or "cpu")."""
    return (kv_transfer_config.kv_buffer_device or "cpu") == "cpu"


class UnsupportedDeployment(ValueError):
    """A configuration kvpush's connector refuses at start-up, with the reason and the fix."""


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
    stream_writes: bool = True
    local_ranks: int = 1  # rank processes of this instance on this host (its TP ranks over its nodes)
    huge_pages: bool = True  # CPU: collapse the KV cache into 2 MiB pages before registering it (hugepages.py)
    kv_cache_layout: str | None = None  # as vLLM resolved it (e.g. BLHNC), None before vLLM 0.32
    # D: a P that accepted a transfer (it holds the request) but sent nothing this long fails it;
    # a backstop: P's own bounds (transfer_timeout_s, the pings) are shorter and end a stuck
    # transfer first
    accepted_timeout_s: float = 300.0
    # D: the backstop of a fence. The blocks of a transfer given up on while P may still be writing
    # them stay out of vLLM's hands until P says its WRITEs ended or P is gone; if neither comes
    # within this long, decode drops P's connection and lets them go (counted). 0: no backstop.
    # Both kv_load_failure_policy values: under "recompute" vLLM frees a failed load's blocks too.
    late_write_hold_s: float = 30.0
    # the deployment secret's file on this host: the side-channel key is derived from it (auth.py).
    # Empty only where code builds Settings itself (benchmarks): an unauthenticated side channel.
    secret_file: str = ""
    # each allowed peer's side channel (engine id -> host, base port), from the deployment's configuration
    peer_side_channels: dict[str, tuple[str, int]] | None = None

    @classmethod
    def from_vllm(cls, vllm_config: Any, kv_cache_config: Any = None) -> "Settings":
        kv = vllm_config.kv_transfer_config
        extra = dict(kv.kv_connector_extra_config or {})
        if kv.kv_role not in ("kv_producer", "kv_consumer"):
            raise UnsupportedDeployment(f"kvpush: kv_role {kv.kv_role!r} is not supported; use kv_producer (prefill) or kv_consumer (decode)")
        missing = [k for k in ("side_channel_host", "side_channel_port", "allowed_engines", "secret_file") if k not in extra]
        if missing:
            raise UnsupportedDeployment(f"kvpush: kv_connector_extra_config lacks {missing}; generate the config with `kvpush plan`")
        if getattr(vllm_config.model_config, "use_mla", False):
            raise UnsupportedDeployment("kvpush: MLA models are not supported yet; use connector type nixl-pull for this model")
        groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
        if len(groups) > 1:
            raise UnsupportedDeployment(f"kvpush: models with {len(groups)} KV cache groups (hybrid attention/mamba) are not supported; use connector type nixl-pull")
        parallel = vllm_config.parallel_config
        if getattr(parallel, "data_parallel_size", 1) > 1:
            raise UnsupportedDeployment("kvpush: data_parallel_size > 1 is not supported yet (the router cannot tell which DP rank's side channel holds a request); run one instance per DP rank")
        if getattr(parallel, "pipeline_parallel_size", 1) > 1:
            raise UnsupportedDeployment("kvpush: pipeline parallelism is not supported; use tensor parallelism")
        on_cpu = kv_on_cpu(kv)
        return cls(
            engine_id=str(kv.engine_id),
            is_producer=kv.kv_role == "kv_producer",
            backend=str(extra.get("backend", "UCX")),
            side_channel_host=str(extra["side_channel_host"]),
            side_channel_port=int(extra["side_channel_port"]),
            allowed_engines=frozenset(str(e) for e in extra["allowed_engines"]),
            transfer_timeout_s=float(extra.get("transfer_timeout_s", 30.0)),
            peer_silence_s=float(extra.get("peer_silence_s", DEFAULT_SILENCE_S)),
            buffer_device="cpu" if on_cpu else str(kv.kv_buffer_device),
            model=str(vllm_config.model_config.model),
            tp_size=int(parallel.tensor_parallel_size),
            local_ranks=int(getattr(parallel, "local_world_size", parallel.tensor_parallel_size)),
            kv_heads=int(vllm_config.model_config.get_total_num_kv_heads()),
            block_size=int(vllm_config.cache_config.block_size),
            progress_delay_us=(None if extra.get("progress_delay_us") is None
                               else int(_non_negative(extra["progress_delay_us"], "progress_delay_us"))),
            idle_wait_ms=_non_negative(extra.get("idle_wait_ms", CPU_IDLE_WAIT_MS if on_cpu else GPU_IDLE_WAIT_MS),
                                       "idle_wait_ms"),
            stream_writes=_flag(extra.get("stream_writes", True), "stream_writes"),
            huge_pages=_flag(extra.get("huge_pages", True), "huge_pages"),
            kv_cache_layout=(getattr(kv_cache_config, "kv_cache_layout", None)
                             or getattr(vllm_config.cache_config, "kv_cache_layout", None)),
            accepted_timeout_s=_positive(extra.get("accepted_timeout_s", 300.0), "accepted_timeout_s"),
            secret_file=_secret_file(extra["secret_file"]),
            peer_side_channels=_addresses(extra.get("peer_side_channels")),
            late_write_hold_s=_non_negative(extra.get("late_write_hold_s", 30.0), "late_write_hold_s"),
        )


def _addresses(value: Any) -> dict[str, tuple[str, int]] | None:
    """{"engine": "host:port"} -> {"engine": ("host", port)}; None where not given."""
    if value is None:
        return None
    out = {}
    try:
        for engine, address in dict(value).items():
            host, port = str(address).rsplit(":", 1)
            out[str(engine)] = (host, int(port))
    except (TypeError, ValueError):
        raise UnsupportedDeployment(f"kvpush: kv_connector_extra_config.peer_side_channels must map engine ids to "
                                    f"'host:port', not {value!r}") from None
    return out


def _secret_file(value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise UnsupportedDeployment(f"kvpush: kv_connector_extra_config.secret_file must name the deployment secret's file, "
                                    f"not {value!r}; generate the config with `kvpush plan`")
    return value


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


def _flag(value: Any, key: str) -> bool:
    if isinstance(value, bool):
        return value
    raise UnsupportedDeployment(f"kvpush: kv_connector_extra_config.{key} must be true or false, not {value!r}")


def _positive(value: Any, key: str) -> float:
    if _non_negative(value, key) > 0:
        return float(value)
    raise UnsupportedDeployment(f"kvpush: kv_connector_extra_config.{key} must be a number > 0, not {value!r}")


def _non_negative(value: Any, key: str) -> float:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0:
        return float(value)
    raise UnsupportedDeployment(f"kvpush: kv_connector_extra_config.{key} must be a number >= 0, not {value!r}")
