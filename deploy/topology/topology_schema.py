"""The topology file's schema: typed models that check each field on its own.

Defaults that depend on other fields (names, hosts, ports) are filled by topology_defaults, rules
between fields are checked by topology_checks, and topology.py loads a file through all three.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar, get_args

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator
from pydantic.dataclasses import dataclass as pydantic_dataclass

from kvpush.common.errors import UsageError
from kvpush.connector.settings import TRANSFER_TIMEOUT_S
from kvpush.router.config import (
    BODY_TIMEOUT_S,
    HEADER_TIMEOUT_S,
    KEEPALIVE_TIMEOUT_S,
    LOAD_WEIGHT,
    MAX_CONNECTIONS,
    PREFIX_WEIGHT,
    RETRY_DEADLINE_S,
    Policy,
)

from . import topology_values as values
from .host_address import HostAddress
from .topology_values import (
    CoreList,
    EnvMap,
    ExtraArgs,
    IntNotBool,
    NumberNotBool,
    PathText,
    PlainName,
    RankCoreLists,
    not_blank,
)

NAME_PATTERN = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")
ROUTER_PROCESS_NAME = "router"  # the plan's and state's name for the router process
DAY_S = 86_400.0  # upper bound of every timeout
MIN_KV_CACHE_GIB = 1 / 64  # 16 MiB: below this a CPU instance has too few blocks for one long prompt
ConnectorType = Literal["kvpush", "nixl-push", "nixl-pull", "colocated"]
Backend = Literal["UCX", "LIBFABRIC"]
Platform = Literal["cpu", "cuda"]
Role = Literal["prefill", "decode"]
Launcher = Literal["ssh", "slurm"]
InstancePublicPath = Literal["/health", "/metrics", "/ping", "/version", "/load"]  # paths that generate nothing
RouterPublicPath = Literal["/health", "/metrics"]
T = TypeVar("T")


class TopologyError(UsageError):
    """A topology problem; str() is the one-line message a user sees."""


_CONFIG = ConfigDict(extra="forbid", validate_assignment=False, allow_inf_nan=False)


class _Model(BaseModel):
    model_config = _CONFIG


def _defaulted(value: T | None, field: str) -> T:
    """A field that topology_defaults fills where the file leaves it out, read as filled."""
    assert value is not None, f"{field} is unset: read a topology loaded through topology_from_document"
    return value


class TinyModelSpec(_Model):
    """Settings for the small causal LM that kvpush makes locally (no model hub needed)."""

    seed: IntNotBool = Field(0, ge=0, le=2**32 - 1, description="seed of the weights and the tokenizer's corpus: "
                                                                 "same seed, same bytes")
    layers: IntNotBool = Field(2, ge=1, le=64, description="decoder layers")
    hidden_size: IntNotBool = Field(256, ge=32, le=16384, description="hidden size")
    heads: IntNotBool = Field(4, ge=1, le=256, description="attention heads (a multiple of kv_heads)")
    kv_heads: IntNotBool = Field(2, ge=1, le=256, description="key/value heads: more heads, more KV bytes per token")
    head_dim: IntNotBool = Field(64, ge=8, le=1024, description="dimension of each head")
    vocab_size: IntNotBool = Field(4096, ge=300, le=1_000_000, description="tokens the byte-level BPE tokenizer learns")
    max_position_embeddings: IntNotBool = Field(
        4096, ge=128, le=1 << 20, description="longest sequence the model takes"
    )

    @model_validator(mode="after")
    def _kv_heads_divide_heads(self) -> TinyModelSpec:
        if self.heads % self.kv_heads:
            raise ValueError(f"heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads}); "
                             "each KV head serves the same number of attention heads")
        return self


class ModelSpec(_Model):
    path: Annotated[PathText, not_blank("give the model directory")] = Field(
        description="model directory on every host that runs vLLM"
    )
    kv_heads: IntNotBool | None = Field(
        None,
        ge=1,
        le=4096,
        description="the model's KV heads, to check TP sizes before "
        "launch (default: tiny.kv_heads, or config.json "
        "where the model is on this machine)",
    )
    served_name: PlainName | None = Field(
        None, description="the model name clients send (default: the last part of path)"
    )
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field("bfloat16", description="vLLM's --dtype")
    max_model_len: IntNotBool | None = Field(None, ge=16, le=1 << 24, description="vLLM's --max-model-len (default: "
                                                                                 "the model's)")
    block_size: IntNotBool | None = Field(None, ge=1, le=4096, description="tokens per KV-cache block, vLLM's "
                                                                          "--block-size (default: vLLM's)")
    enforce_eager: bool = Field(False, description="vLLM's --enforce-eager: no CUDA graphs")
    extra_args: ExtraArgs = Field(default_factory=list, description="more `vllm serve` arguments for every instance, "
                                                                    "e.g. ['--max-num-seqs', '64']")
    tiny: TinyModelSpec | None = Field(
        None, description="if set, `up` makes this tiny model at `path` on each host where it is missing"
    )

    @property
    def name(self) -> str:
        return self.served_name or Path(self.path).name


class ConnectorSpec(_Model):
    type: ConnectorType = Field("kvpush", description="kvpush: prefill pushes the KV to decode (this project's "
                                                      "connector); nixl-push, nixl-pull: vLLM's NIXL connectors; "
                                                      "colocated: no transfer, each request served by one instance")
    backend: Backend = Field("UCX", description="NIXL's transport: UCX, or LIBFABRIC for AWS EFA")
    transfer_timeout_s: float = Field(
        TRANSFER_TIMEOUT_S,
        gt=0,
        le=DAY_S,
        description="seconds after which a registration or finished-block set that never matched is failed",
    )
    extra_config: Annotated[dict[str, Any], AfterValidator(values.extra_config)] = Field(
        default_factory=dict, description="more entries of vLLM's kv_connector_extra_config for every instance")
    stock_vllm: bool = Field(
        False,
        description="nixl-push and nixl-pull: load vLLM's connector classes exactly as vLLM "
        "ships them. By default a CPU platform loads them through "
        "kvpush.connector.vllm_nixl, which paces NIXL's progress thread and keeps "
        "the compute thread on its own cores; GPU platforms always run them stock",
    )


@pydantic_dataclass(config=_CONFIG, kw_only=True)
class HostSpec(HostAddress):
    """A host of the topology: how it is reached (HostAddress), and where and with what it runs.
    With launcher slurm, address may be left out: it is then the Slurm node's address."""

    workdir: Annotated[PathText, not_blank("give a directory, or remove the field for ~/.kvpush"),
                       Field(description="directory on the host for each deployment's files and logs "
                                         "(<workdir>/<name>)")] = "~/.kvpush"
    python: Annotated[
        PathText | None, Field(description="interpreter that runs vLLM there (default: <venv>/bin/python)")
    ] = None
    venv: Annotated[PathText | None, Field(description="virtual environment on the host whose Python runs vLLM")] = None
    node: Annotated[
        PlainName | None,
        Field(description="launcher slurm: the Slurm node this host is (default: any node of the allocation)"),
    ] = None

    @property
    def interpreter(self) -> str:
        if self.python:
            return self.python
        if self.venv:
            return f"{self.venv.rstrip('/')}/bin/python"
        if self.is_local:
            return sys.executable  # this host runs kvpush itself: use the same environment
        return "python3"


def _restart_shorthand(value: Any) -> Any:
    # `restart: on-failure` for the defaults; YAML reads a bare `no` as false.
    if value is False:
        return {"policy": "never"}
    if isinstance(value, str):
        return {"policy": value}
    return value


class RestartSpec(_Model):
    """What the process's supervisor does when it exits on its own (see kvpush.deploy.lifecycle.supervise)."""

    policy: Literal["never", "on-failure"] = Field("never", description="on-failure: start it again after a crash")
    max_restarts: IntNotBool = Field(
        3, ge=1, le=1000, description="restarts allowed within window_s; then it stays down"
    )
    window_s: float = Field(600.0, gt=0, description="the seconds over which max_restarts are counted")


RestartShorthand = Literal["never", "on-failure", False]  # `restart: on-failure`; a bare `no` reads as false
RestartField = Annotated[RestartSpec, BeforeValidator(_restart_shorthand,
                                                      json_schema_input_type=RestartSpec | RestartShorthand)]


class InstanceSpec(_Model):
    name: str | None = Field(None, description="the process's name (default: <role>-<index>, e.g. prefill-0)")
    host: str | None = Field(None, description="the host it runs on, a name under hosts (default: the only host)")
    devices: list[Annotated[IntNotBool, Field(le=1023)]] = Field(
        default_factory=list, description="GPU indices (platform cuda)"
    )
    cpu_cores: RankCoreLists | None = Field(None, description="cores for VLLM_CPU_OMP_THREADS_BIND (platform cpu): one "
                                                              "list per TP rank, '|'-separated, e.g. '0|1'")
    share_cores: bool = Field(False, description="platform cpu: this instance may share cores with other instances "
                                                 "that say so too, and its ranks with each other (a small machine)")
    share_gpus: bool = Field(False, description="platform cuda: this instance may share its GPUs with other instances "
                                                "that say so too (e.g. prefill and decode on one GPU); give each its "
                                                "share with --kv-cache-memory-bytes / --gpu-memory-utilization")
    kv_cache_gib: NumberNotBool | None = Field(None, ge=MIN_KV_CACHE_GIB, le=1 << 16, description=(
        "platform cpu: each rank's KV cache in GiB, fractions allowed (e.g. 0.25); vLLM's --kv-cache-memory-bytes"))
    tensor_parallel_size: IntNotBool = Field(1, ge=1, le=64, description="ranks (GPUs, or CPU core lists) of one "
                                             "instance; prefill and decode may differ")
    data_parallel_size: IntNotBool = Field(1, ge=1, le=256, description="vLLM's --data-parallel-size")
    http_port: IntNotBool | None = Field(
        None,
        ge=1,
        le=65535,
        description="its OpenAI-compatible HTTP port (default: 8100 + index for prefill, 8200 + index for decode)",
    )
    side_channel_port: IntNotBool | None = Field(None, ge=1, le=65535, description=(
        "the first of the instance's side-channel ports (one per TP x DP rank for kvpush, per DP rank for NIXL); "
        "kvpush's decode listens on none, its port only names it"))
    env: EnvMap = Field(default_factory=dict, description="environment of this instance, added to the topology's env")
    extra_args: ExtraArgs = Field(default_factory=list, description="more `vllm serve` arguments for this instance")
    restart: RestartField = Field(default_factory=RestartSpec, description="what its supervisor does when it exits on "
                                  "its own: a policy (never, on-failure) or a mapping")

    @field_validator("devices")
    @classmethod
    def _no_duplicate_devices(cls, value: list[int]) -> list[int]:
        if len(set(value)) != len(value):
            raise ValueError("lists a device twice; give each GPU index once")
        if any(d < 0 for d in value):
            raise ValueError("GPU indices start at 0")
        return value

    # The fields above that topology_defaults fills, as a loaded topology has them.
    @property
    def resolved_name(self) -> str:
        return _defaulted(self.name, "name")

    @property
    def resolved_host(self) -> str:
        return _defaulted(self.host, f"{self.name}: host")

    @property
    def resolved_http_port(self) -> int:
        return _defaulted(self.http_port, f"{self.name}: http_port")

    @property
    def resolved_side_channel_port(self) -> int:
        return _defaulted(self.side_channel_port, f"{self.name}: side_channel_port")


def _router_public_paths() -> list[RouterPublicPath]:
    return ["/health"]


def _instance_public_paths() -> list[InstancePublicPath]:
    return ["/health", "/metrics"]


class RouterSpec(_Model):
    host: str | None = Field(None, description="the host it runs on, a name under hosts (default: the only host)")
    bind: Annotated[str, AfterValidator(values.bind_address)] = Field(
        "127.0.0.1", description="the address it listens on, e.g. 0.0.0.0 for clients on other machines")
    port: IntNotBool = Field(8000, ge=1, le=65535, description="its HTTP port")
    policy: Policy = Field("prefix-aware", description=(
        "how each request's prefill and decode are chosen: prefix-aware (the instances already holding most of the "
        "prompt, by what the router sent where, weighed against load: a conversation's turns stay on one decode), "
        "least-loaded, round-robin"))
    prefix_weight: NumberNotBool = Field(PREFIX_WEIGHT, ge=0, le=1000, description=(
        "prefix-aware: what holding the whole prompt is worth (an instance holding a share s of it scores "
        "prefix_weight x s)"))
    load_weight: NumberNotBool = Field(LOAD_WEIGHT, ge=0, le=1000, description=(
        "prefix-aware: what each request in flight beyond the least-loaded candidate's costs; an instance holding "
        "the whole prompt keeps it while it has fewer than prefix_weight / load_weight requests more"))
    api_key_env: Annotated[str, AfterValidator(values.env_name)] | None = Field(
        None, description="name of an env var, on the machine running kvpush, holding the router's API key")
    api_key_file: PathText | None = Field(
        None, description="file on the machine running kvpush holding the router's API key"
    )
    public_paths: list[RouterPublicPath] = Field(
        default_factory=_router_public_paths,
        description="router paths served without the API key (default: /health only)",
    )
    prefill_timeout_s: float = Field(600.0, gt=0, le=DAY_S, description="seconds a request's prefill leg may take")
    decode_timeout_s: float = Field(600.0, gt=0, le=DAY_S, description="seconds a request's decode leg may take")
    connect_timeout_s: float = Field(5.0, gt=0, le=DAY_S, description="seconds to connect to an instance")
    health_timeout_s: float = Field(1.0, gt=0, le=600, description=(
        "a /health probe unanswered this long counts as a hang (2 in a row take an instance out of rotation); "
        "raise it where instances share too few cores to answer promptly while busy"))
    retry_deadline_s: float = Field(RETRY_DEADLINE_S, gt=0, le=DAY_S, description=(
        "no attempt of a request starts later than this after it arrived: until its first token a failed "
        "request is tried on every other pair in rotation, then by decode alone, within this bound"))
    max_prompt_chars: IntNotBool = Field(4_000_000, ge=1, le=100_000_000, description="longest prompt accepted, in "
                                         "characters (a longer request is refused)")
    max_connections: IntNotBool = Field(MAX_CONNECTIONS, ge=1, le=1_000_000, description=(
        "client connections each router process holds at most (lowered to what its open-files limit allows); past "
        "it a new one takes the place of the least recently active one without a request in progress, or gets "
        "503 with Retry-After"))
    header_timeout_s: float = Field(HEADER_TIMEOUT_S, gt=0, le=3600, description=(
        "a client's request head must arrive in full within this of its connection's open (on a kept-alive "
        "connection, of the head's first byte), else the connection is closed"))
    body_timeout_s: float = Field(BODY_TIMEOUT_S, gt=0, le=3600, description=(
        "a client's request body must arrive in full within this of its head, else 408 and the connection closes"))
    keepalive_timeout_s: float = Field(KEEPALIVE_TIMEOUT_S, gt=0, le=3600, description=(
        "an idle kept-alive client connection is closed after this"))
    cpu_cores: CoreList | None = Field(
        None, description="cores the router process runs on (taskset); may share an instance's"
    )
    workers: IntNotBool = Field(
        1,
        ge=1,
        le=64,
        description="router processes sharing the port, each relaying its share of "
        "the streams; give the router at least as many cpu_cores",
    )
    restart: RestartField = Field(default_factory=RestartSpec, description="what its supervisor does when it exits on "
                                  "its own: a policy (never, on-failure) or a mapping")

    @model_validator(mode="after")
    def _one_key_source(self) -> RouterSpec:
        if self.api_key_env is not None and self.api_key_file is not None:
            raise ValueError("gives both api_key_env and api_key_file; keep one")
        return self

    @property
    def resolved_host(self) -> str:
        """host, as topology_defaults fills it."""
        return _defaulted(self.host, "router: host")


class SlurmSpec(_Model):
    """How `up` gets a Slurm allocation and launches job steps in it (launcher: slurm)."""

    partition: str | None = Field(None, description="sbatch --partition (default: the cluster's default partition)")
    account: str | None = Field(None, description="sbatch --account")
    time_limit: str | None = Field(None, description="sbatch --time, e.g. '04:00:00' or '2-00:00:00'")
    job_name: str | None = Field(None, description="sbatch --job-name (default: kvpush-<name>)")
    job_id: str | None = Field(
        None, description="run in this existing allocation (default: $SLURM_JOB_ID if set, else submit one)"
    )
    gpus_per_node: IntNotBool | None = Field(
        None, ge=1, description="sbatch --gpus-per-node (default on cuda: the most GPUs an instance host uses)"
    )
    exclusive: bool | None = Field(None, description="sbatch --exclusive (default: true on cuda)")
    sbatch_options: list[str] = Field(default_factory=list, description="more sbatch options, e.g. ['--qos=high']")
    srun_options: list[str] = Field(default_factory=list, description="more options for every job step's srun")
    start_timeout_s: float = Field(600.0, gt=0, description="how long `up` waits for a submitted job to start")


class SecretSource(_Model):
    """Where a secret's value is read, on the machine running kvpush (or, for a standalone Slurm
    script, in the job when it starts): one of env and file."""

    env: Annotated[str, AfterValidator(values.env_name)] | None = Field(
        None, description="an environment variable holding the value"
    )
    file: PathText | None = Field(
        None, description="a file holding the value (mode 0600, this user's; one trailing newline is dropped)"
    )

    @model_validator(mode="after")
    def _one_source(self) -> SecretSource:
        if (self.env is None) == (self.file is None):
            raise ValueError("gives neither or both of env and file; give one, e.g. {env: HF_TOKEN}")
        return self


def _otlp_endpoint(value: str) -> str:
    if not re.fullmatch(r"https?://[^\s/?#]+(/[^\s?#]*)?", value):
        raise ValueError("is not an http:// or https:// URL without spaces, query or fragment; give e.g. "
                         "http://127.0.0.1:4318/v1/traces")
    return value


class TracingSpec(_Model):
    """vLLM's own OpenTelemetry spans, one per request, sent by every instance (`--otlp-traces-endpoint`).
    Each instance names itself by its service name and the kvpush.deployment and kvpush.role resource
    attributes (deploy/plan/engine_tracing.py). `kvpush bench` sets this itself where it measures."""

    otlp_endpoint: Annotated[str, AfterValidator(_otlp_endpoint)] = Field(
        description="where the spans go, e.g. http://collector:4318/v1/traces (http/protobuf) or http://collector:4317 "
                                "(grpc)"
    )
    protocol: Literal["http/protobuf", "grpc"] = Field("http/protobuf", description="the OTLP exporter's protocol")
    export_delay_ms: IntNotBool = Field(5000, ge=1, le=600_000, description="the SDK exports finished spans this often")


class Topology(_Model):
    name: str = Field("kvpush", description="the deployment's name: its state file, work directories and "
                                            "`-d NAME` (lowercase letters, digits and '-')")
    platform: Platform = Field("cpu", description="cpu: vLLM on CPU cores (cpu_cores); cuda: on GPUs (devices)")
    launcher: Launcher = Field(
        "ssh",
        description="ssh: kvpush starts each process over SSH, or directly on this "
        "machine; slurm: as job steps of one Slurm allocation (docs/slurm.md)",
    )
    slurm: SlurmSpec | None = Field(None, description="launcher slurm: the allocation and its job steps")
    model: ModelSpec = Field(description="the model every instance serves")
    connector: ConnectorSpec = Field(default_factory=ConnectorSpec, description="how the KV cache moves from prefill "
                                                                                "to decode")
    hosts: dict[str, HostSpec] = Field(default_factory=lambda: {"local": HostSpec(address="127.0.0.1")},
                                       description="the machines, by names of your choosing (default: local, this "
                                                   "machine at 127.0.0.1)")
    prefill: list[InstanceSpec] = Field(default_factory=list, description="the prefill instances: each computes a "
                                                                          "prompt's KV cache and the first token")
    decode: list[InstanceSpec] = Field(default_factory=list, description="the decode instances: each takes a prompt's "
                                                                         "KV cache and generates the rest")
    router: RouterSpec = Field(default_factory=RouterSpec, description="the OpenAI-compatible endpoint clients use: "
                                                                       "it picks a prefill/decode pair per request")
    tracing: TracingSpec | None = Field(None, description="send vLLM's per-request OpenTelemetry spans to a collector")
    env: EnvMap = Field(default_factory=dict, description="environment variables of every process")
    secrets: dict[str, SecretSource] = Field(  # names: checked by topology_security, at their own line
        default_factory=dict,
        description="environment variables of every vLLM instance whose values are secret, by "
        "name, e.g. HF_TOKEN: {env: HF_TOKEN}: delivered in a 0600 file, never printed",
    )
    instance_public_paths: list[InstancePublicPath] = Field(
        default_factory=_instance_public_paths,
        description="paths every vLLM instance serves without the instance key; every other path needs it")

    @field_validator("name")
    @classmethod
    def _name_pattern(cls, value: str) -> str:
        if not NAME_PATTERN.match(value):
            raise ValueError("must be lowercase letters, digits and '-' (it names directories and state files)")
        return value

    def instances(self) -> list[tuple[Role, int, InstanceSpec]]:
        return [("prefill", i, s) for i, s in enumerate(self.prefill)] + [
            ("decode", i, s) for i, s in enumerate(self.decode)
        ]

    def instance(self, name: str) -> InstanceSpec:
        for _, _, spec in self.instances():
            if spec.name == name:
                return spec
        raise KeyError(name)


def topology_field_names() -> frozenset[str]:
    """Every field name a topology file may use, at any level (for 'did you mean' on a misspelt one),
    found by walking the schema from Topology down, so a spec added later is included."""
    names: set[str] = set()
    seen: set[type] = set()
    pending: list[Any] = [Topology]
    while pending:
        annotation = pending.pop()
        fields = getattr(annotation, "__pydantic_fields__", None) if isinstance(annotation, type) else None
        if fields is None:
            pending.extend(get_args(annotation))  # Optional[...], list[...], dict[str, ...], Annotated[...]
        elif annotation not in seen:
            seen.add(annotation)
            names.update(fields)
            pending.extend(f.annotation for f in fields.values())
    return frozenset(names)
