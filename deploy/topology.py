"""The topology file: one YAML document describing a whole disaggregated deployment.

Typed models validate at the edge; every error is one line naming file:line:col, the field,
what is wrong and how to fix it. Cross-field rules (ports, devices, hosts, TP) run after the
per-field checks, on the fully defaulted topology.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, field_validator, model_validator

from kvpush.common.errors import UsageError
from . import topology_values as values
from .yaml_source import SourceDocument, YamlSyntaxError, load_yaml_file, parse_yaml

ConnectorType = Literal["kvpush", "nixl-push", "nixl-pull", "colocated"]
Backend = Literal["UCX", "LIBFABRIC"]
Platform = Literal["cpu", "cuda"]
Policy = Literal["round-robin", "least-loaded"]
Role = Literal["prefill", "decode"]
Launcher = Literal["ssh", "slurm"]

LOCAL_ADDRESSES = {"localhost", "127.0.0.1", "::1"}
DEFAULT_PREFILL_HTTP_PORT = 8100
DEFAULT_DECODE_HTTP_PORT = 8200
DEFAULT_SIDE_CHANNEL_PORT = 5600
NAME_PATTERN = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")
ROUTER_PROCESS_NAME = "router"  # the plan's and state's name for the router process
MAX_CORE = 4095  # above any host's core numbers; bounds what a range like '0-999999999' would allocate


def _not_bool(value: Any) -> Any:
    # YAML reads `port: true` as a bool, and pydantic would take it as 1.
    if isinstance(value, bool):
        raise ValueError("is true/false, not a number; give a number")
    return value


def _not_blank(fix: str) -> AfterValidator:
    def check(value: str) -> str:
        if not value.strip():
            raise ValueError(f"is empty; {fix}")
        return value

    return AfterValidator(check)


IntNotBool = Annotated[int, BeforeValidator(_not_bool)]
PathText = Annotated[str, AfterValidator(values.path)]
PlainName = Annotated[str, AfterValidator(values.plain_name)]
EnvMap = Annotated[dict[str, str], AfterValidator(values.env_map)]
ExtraArgs = Annotated[list[str], AfterValidator(values.extra_args)]
DAY_S = 86_400.0  # upper bound of every timeout


class TopologyError(UsageError):
    """A topology problem; str() is the one-line message a user sees."""


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=False, allow_inf_nan=False)


class TinyModelSpec(_Model):
    """Settings for the small causal LM that kvpush makes locally (no model hub needed)."""

    seed: IntNotBool = Field(0, ge=0, le=2**32 - 1)
    layers: IntNotBool = Field(2, ge=1, le=64)
    hidden_size: IntNotBool = Field(256, ge=32, le=16384)
    heads: IntNotBool = Field(4, ge=1, le=256)
    kv_heads: IntNotBool = Field(2, ge=1, le=256)
    head_dim: IntNotBool = Field(64, ge=8, le=1024)
    vocab_size: IntNotBool = Field(4096, ge=300, le=1_000_000)
    max_position_embeddings: IntNotBool = Field(4096, ge=128, le=1 << 20)

    @model_validator(mode="after")
    def _kv_heads_divide_heads(self) -> "TinyModelSpec":
        if self.heads % self.kv_heads:
            raise ValueError(f"heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads}); "
                             "each KV head serves the same number of attention heads")
        return self


class ModelSpec(_Model):
    path: Annotated[PathText, _not_blank("give the model directory")] = Field(description="model directory on every host that runs vLLM")
    kv_heads: IntNotBool | None = Field(None, ge=1, le=4096, description="the model's KV heads, to check TP sizes before "
                                                                         "launch (default: tiny.kv_heads, or config.json "
                                                                         "where the model is on this machine)")
    served_name: PlainName | None = None
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "bfloat16"
    max_model_len: IntNotBool | None = Field(None, ge=16, le=1 << 24)
    block_size: IntNotBool | None = Field(None, ge=1, le=4096)
    enforce_eager: bool = False
    extra_args: ExtraArgs = Field(default_factory=list)
    tiny: TinyModelSpec | None = Field(
        None, description="if set, `up` makes this tiny model at `path` on each host where it is missing"
    )

    @property
    def name(self) -> str:
        return self.served_name or Path(self.path).name


class ConnectorSpec(_Model):
    type: ConnectorType = "kvpush"
    backend: Backend = "UCX"
    # Seconds after which a registration or finished-block set that never matched is failed. A
    # backstop for a leg that never reached the other side: a dead or hung prefill is noticed in
    # ~1 s by the side channel's ping, and a busy one may hold a request queued for many seconds.
    transfer_timeout_s: float = Field(30.0, gt=0, le=DAY_S)
    extra_config: Annotated[dict[str, Any], AfterValidator(values.extra_config)] = Field(default_factory=dict)


class HostSpec(_Model):
    address: Annotated[str, _not_blank("give the host's IP address or DNS name"), AfterValidator(values.host_address)]
    ssh_port: IntNotBool = Field(22, ge=1, le=65535)
    user: PlainName | None = None
    key: PathText | None = None
    workdir: Annotated[PathText, _not_blank("give a directory, or remove the field for ~/.kvpush")] = "~/.kvpush"
    python: PathText | None = Field(None, description="interpreter that runs vLLM there (default: <venv>/bin/python)")
    venv: PathText | None = None
    node: PlainName | None = Field(None, description="launcher slurm: the Slurm node this host is (default: any node of the allocation)")

    @property
    def is_local(self) -> bool:
        return self.address in LOCAL_ADDRESSES and self.ssh_port == 22 and self.user is None

    @property
    def interpreter(self) -> str:
        if self.python:
            return self.python
        if self.venv:
            return f"{self.venv.rstrip('/')}/bin/python"
        if self.is_local:
            import sys

            return sys.executable  # this host runs kvpush itself: use the same environment
        return "python3"


def _valid_core_list(value: str) -> str:
    if "|" in value:
        raise ValueError(f"'{value}' has per-rank lists ('|'); give one core list like '0-3,8' here")
    parse_core_list(value)  # raises ValueError with the reason
    return value


def _valid_rank_core_lists(value: str) -> str:
    for group in value.split("|"):
        if not group.strip():
            raise ValueError(f"'{value}' has an empty rank core list; write one list per rank, e.g. '0|1' or '0-1|2-3'")
        parse_core_list(group)
    return value


def _core_number_as_text(value: Any) -> Any:
    if isinstance(value, bool):
        raise ValueError("is true/false, not a core list; give cores like \"0-3,8\"")
    return str(value) if isinstance(value, int) else value  # `cpu_cores: 3` unquoted


CoreList = Annotated[str, BeforeValidator(_core_number_as_text), AfterValidator(_valid_core_list)]  # "0-3,8"
# One core list per TP rank, '|'-separated as VLLM_CPU_OMP_THREADS_BIND takes them: "0-1|2-3"
RankCoreLists = Annotated[str, BeforeValidator(_core_number_as_text), AfterValidator(_valid_rank_core_lists)]


def _restart_shorthand(value: Any) -> Any:
    # `restart: on-failure` for the defaults; YAML reads a bare `no` as false.
    if value is False:
        return {"policy": "never"}
    if isinstance(value, str):
        return {"policy": value}
    return value


class RestartSpec(_Model):
    """What the process's supervisor does when it exits on its own (see kvpush.deploy.supervise)."""

    policy: Literal["never", "on-failure"] = Field("never", description="on-failure: start it again after a crash")
    max_restarts: IntNotBool = Field(3, ge=1, le=1000, description="restarts allowed within window_s; then it stays down")
    window_s: float = Field(600.0, gt=0)


RestartField = Annotated[RestartSpec, BeforeValidator(_restart_shorthand)]


class InstanceSpec(_Model):
    name: str | None = None
    host: str | None = None
    devices: list[Annotated[IntNotBool, Field(le=1023)]] = Field(default_factory=list, description="GPU indices (platform cuda)")
    cpu_cores: RankCoreLists | None = Field(None, description="cores for VLLM_CPU_OMP_THREADS_BIND (platform cpu): one "
                                                              "list per TP rank, '|'-separated, e.g. '0|1'")
    share_cores: bool = Field(False, description="platform cpu: this instance may share cores with other instances "
                                                 "that say so too, and its ranks with each other (a small machine)")
    kv_cache_gib: IntNotBool | None = Field(None, ge=1, le=1 << 16, description="VLLM_CPU_KVCACHE_SPACE (platform cpu)")
    tensor_parallel_size: IntNotBool = Field(1, ge=1, le=64)
    data_parallel_size: IntNotBool = Field(1, ge=1, le=256)
    http_port: IntNotBool | None = Field(None, ge=1, le=65535)
    side_channel_port: IntNotBool | None = Field(None, ge=1, le=65535)
    env: EnvMap = Field(default_factory=dict)
    extra_args: ExtraArgs = Field(default_factory=list)
    restart: RestartField = Field(default_factory=RestartSpec)

    @field_validator("env", mode="before")
    @classmethod
    def _env_strings(cls, value: Any) -> Any:
        return _stringify_env(value)

    @field_validator("devices")
    @classmethod
    def _no_duplicate_devices(cls, value: list[int]) -> list[int]:
        if len(set(value)) != len(value):
            raise ValueError("lists a device twice; give each GPU index once")
        if any(d < 0 for d in value):
            raise ValueError("GPU indices start at 0")
        return value


class RouterSpec(_Model):
    host: str | None = None
    bind: Annotated[str, AfterValidator(values.bind_address)] = "127.0.0.1"
    port: IntNotBool = Field(8000, ge=1, le=65535)
    policy: Policy = "round-robin"
    api_key_env: Annotated[str, AfterValidator(values.env_name)] | None = Field(
        None, description="name of an env var, on the machine running kvpush, holding the router's API key")
    api_key_file: PathText | None = Field(None, description="file on the machine running kvpush holding the router's API key")
    public_paths: list[Literal["/health", "/metrics"]] = Field(
        default_factory=lambda: ["/health"], description="router paths served without the API key (default: /health only)")
    prefill_timeout_s: float = Field(600.0, gt=0, le=DAY_S)
    decode_timeout_s: float = Field(600.0, gt=0, le=DAY_S)
    connect_timeout_s: float = Field(5.0, gt=0, le=DAY_S)
    max_prompt_chars: IntNotBool = Field(4_000_000, ge=1, le=100_000_000)
    cpu_cores: CoreList | None = Field(None, description="cores the router process runs on (taskset); may share an instance's")
    workers: IntNotBool = Field(1, ge=1, le=64, description="router processes sharing the port, each relaying its share of "
                                                    "the streams; give the router at least as many cpu_cores")
    restart: RestartField = Field(default_factory=RestartSpec)

    @model_validator(mode="after")
    def _one_key_source(self) -> "RouterSpec":
        if self.api_key_env is not None and self.api_key_file is not None:
            raise ValueError("gives both api_key_env and api_key_file; keep one")
        return self


class SlurmSpec(_Model):
    """How `up` gets a Slurm allocation and launches job steps in it (launcher: slurm)."""

    partition: str | None = Field(None, description="sbatch --partition (default: the cluster's default partition)")
    account: str | None = Field(None, description="sbatch --account")
    time_limit: str | None = Field(None, description="sbatch --time, e.g. '04:00:00' or '2-00:00:00'")
    job_name: str | None = Field(None, description="sbatch --job-name (default: kvpush-<name>)")
    job_id: str | None = Field(None, description="run in this existing allocation (default: $SLURM_JOB_ID if set, else submit one)")
    gpus_per_node: IntNotBool | None = Field(None, ge=1, description="sbatch --gpus-per-node (default on cuda: the most GPUs an instance host uses)")
    exclusive: bool | None = Field(None, description="sbatch --exclusive (default: true on cuda)")
    sbatch_options: list[str] = Field(default_factory=list, description="more sbatch options, e.g. ['--qos=high']")
    srun_options: list[str] = Field(default_factory=list, description="more options for every job step's srun")
    start_timeout_s: float = Field(600.0, gt=0, description="how long `up` waits for a submitted job to start")


class Topology(_Model):
    name: str = "kvpush"
    platform: Platform = "cpu"
    launcher: Launcher = "ssh"
    slurm: SlurmSpec | None = None
    model: ModelSpec
    connector: ConnectorSpec = Field(default_factory=ConnectorSpec)
    hosts: dict[str, HostSpec] = Field(default_factory=lambda: {"local": HostSpec(address="127.0.0.1")})
    prefill: list[InstanceSpec] = Field(default_factory=list)
    decode: list[InstanceSpec] = Field(default_factory=list)
    router: RouterSpec = Field(default_factory=RouterSpec)
    env: EnvMap = Field(default_factory=dict)

    @field_validator("env", mode="before")
    @classmethod
    def _env_strings(cls, value: Any) -> Any:
        return _stringify_env(value)

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


def _stringify_env(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: ("" if v is None else str(v).lower() if isinstance(v, bool) else str(v)) for k, v in value.items()}
    return value


def rank_core_lists(text: str) -> list[set[int]]:
    """'0-1|2-3' -> [{0, 1}, {2, 3}]: the cores of each TP rank."""
    return [parse_core_list(group) for group in str(text).split("|")]


def core_list_text(cores: set[int]) -> str:
    """{0, 1, 2, 5} -> '0-2,5' (what taskset takes)."""
    out, run = [], []
    for core in sorted(cores):
        if run and core == run[-1] + 1:
            run.append(core)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [core]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


def parse_core_list(text: str) -> set[int]:
    """'0-3,8' -> {0,1,2,3,8}; per-rank lists ('0|1') give their union; raises ValueError with a fix hint."""
    cores: set[int] = set()
    if "|" in str(text):
        for group in rank_core_lists(text):
            cores |= group
        return cores
    for part in str(text).split(","):
        part = part.strip()
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if not m:
            raise ValueError(f"'{text}' is not a core list; write e.g. '0' or '0-3,8'")
        lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
        if hi > MAX_CORE:
            raise ValueError(f"core {hi} in '{part}' is above {MAX_CORE}; give the core numbers of this host (see `nproc`)")
        if hi < lo:
            raise ValueError(f"range '{part}' runs backwards; write the low core first")
        cores.update(range(lo, hi + 1))
    return cores


def side_channel_ports(spec: InstanceSpec, connector: ConnectorType = "kvpush") -> list[int]:
    """Every port an instance's side channel listens on.

    kvpush's connector listens on one port per tensor-parallel rank of each data-parallel rank
    (base + dp_rank * tp + tp_rank); vLLM's NIXL connectors on one per data-parallel rank, in the
    engine process (base + dp_rank).
    """
    assert spec.side_channel_port is not None
    count = spec.data_parallel_size * (spec.tensor_parallel_size if connector == "kvpush" else 1)
    return [spec.side_channel_port + i for i in range(count)]


# ---------------------------------------------------------------------------------------------
# loading


def _field_name(path: tuple) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(top level)"


def pydantic_message(err: dict[str, Any]) -> str:
    """One pydantic error as the words after a field name: what is wrong and the fix."""
    kind = err["type"]
    if kind == "extra_forbidden":
        return "is not a known field; check its spelling or remove it"
    if kind == "missing":
        return "is required; add it"
    if kind == "literal_error":
        expected = err.get("ctx", {}).get("expected", "")
        return f"got {err.get('input')!r}, expected one of {expected}"
    msg = err["msg"]
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, ") :]
    return f"{msg} (got {err.get('input')!r})" if "input" in err and not isinstance(err.get("input"), (dict, list)) else msg


class _Problem:
    """Collects cross-field problems; raises the first, with its position."""

    def __init__(self, doc: SourceDocument):
        self.doc = doc

    def fail(self, path: tuple, message: str) -> None:
        raise TopologyError(f"{self.doc.where(path)}: {_field_name(path)}: {message}")


def _apply_defaults(topo: Topology, problems: _Problem) -> None:
    """Fill names, hosts and ports so the plan never has to guess."""
    host_names = list(topo.hosts)
    if not host_names:
        problems.fail(("hosts",), "defines no hosts; add one, e.g. 'local: {address: 127.0.0.1}', or remove hosts: to use this machine")
    if topo.router.host is None:
        if len(host_names) == 1:
            topo.router.host = host_names[0]
        else:
            problems.fail(("router",), f"names no host and the topology has {len(host_names)}; add 'host: <one of {', '.join(host_names)}>'")
    next_http = {"prefill": DEFAULT_PREFILL_HTTP_PORT, "decode": DEFAULT_DECODE_HTTP_PORT}
    next_side = DEFAULT_SIDE_CHANNEL_PORT
    for role, index, spec in topo.instances():
        if spec.name is None:
            spec.name = f"{role}-{index}"
        if spec.host is None:
            if len(host_names) == 1:
                spec.host = host_names[0]
            else:
                problems.fail((role, index), f"names no host and the topology has {len(host_names)}; add 'host: <one of {', '.join(host_names)}>'")
        if spec.http_port is None:
            spec.http_port = next_http[role] + index
        if spec.side_channel_port is None:
            spec.side_channel_port = next_side
        next_side = max(next_side, spec.side_channel_port + len(side_channel_ports(spec, topo.connector.type)))


def _check_cross_fields(topo: Topology, problems: _Problem) -> None:
    if topo.connector.type != "colocated":
        for role in ("prefill", "decode"):
            if not getattr(topo, role):
                problems.fail((role,), f"has no instances; a disaggregated deployment needs at least one {role} instance (or set connector.type: colocated)")
    elif not topo.instances():
        problems.fail(("decode",), "has no instances; add at least one instance")
    for name, host in topo.hosts.items():
        if not NAME_PATTERN.match(name):
            problems.fail(("hosts", name), "host names must be lowercase letters, digits and '-'")
    if topo.router.host not in topo.hosts:
        problems.fail(("router", "host"), f"unknown host '{topo.router.host}'; define it under hosts: or use one of {', '.join(topo.hosts)}")

    seen_names: dict[str, tuple] = {}
    ports: dict[tuple[str, int], tuple[tuple, str]] = {}
    devices: dict[tuple[str, int], tuple] = {}
    cores: dict[tuple[str, int], tuple] = {}

    def claim_port(host: str, port: int, path: tuple, what: str) -> None:
        key = (host, port)
        if key in ports:
            other_path, other_what = ports[key]
            if path not in problems.doc.value_positions and other_path in problems.doc.value_positions:
                # The clash is with a defaulted port: point at the port the user actually wrote.
                path, other_path, other_what = other_path, path, what
            problems.fail(path, f"port {port} on host '{host}' is also used by {_field_name(other_path)} ({other_what}); give each process its own port")
        ports[key] = (path, what)

    router_path = ("router", "port")
    claim_port(topo.router.host, topo.router.port, router_path, "router HTTP")
    for role, index, spec in topo.instances():
        base = (role, index)
        if spec.name in seen_names:
            problems.fail(base + ("name",), f"name '{spec.name}' is already used by {_field_name(seen_names[spec.name])}; names must be unique")
        if not NAME_PATTERN.match(spec.name):
            problems.fail(base + ("name",), f"'{spec.name}' must be lowercase letters, digits and '-'")
        if spec.name == ROUTER_PROCESS_NAME:
            problems.fail(base + ("name",), f"'{ROUTER_PROCESS_NAME}' is the router process's name; choose another name")
        seen_names[spec.name] = base
        if spec.host not in topo.hosts:
            problems.fail(base + ("host",), f"unknown host '{spec.host}'; define it under hosts: or use one of {', '.join(topo.hosts)}")
        claim_port(spec.host, spec.http_port, base + ("http_port",), f"{spec.name} HTTP")
        if topo.connector.type != "colocated":
            for rank, port in enumerate(side_channel_ports(spec, topo.connector.type)):
                if port > 65535:
                    problems.fail(base + ("side_channel_port",), f"rank {rank} would listen on port {port} > 65535; lower side_channel_port")
                what = f"{spec.name} side channel" + (f" rank {rank}" if rank else "")
                claim_port(spec.host, port, base + ("side_channel_port",), what)

        ranks = spec.tensor_parallel_size * spec.data_parallel_size
        if topo.platform == "cuda":
            if spec.cpu_cores is not None:
                problems.fail(base + ("cpu_cores",), "applies to platform cpu only; remove it or set platform: cpu")
            if not spec.devices:
                problems.fail(base, "lists no devices; add 'devices: [0, ...]' with one GPU per TP x DP rank")
            if len(spec.devices) != ranks:
                problems.fail(base + ("devices",), f"lists {len(spec.devices)} GPUs but tensor_parallel_size x data_parallel_size = {spec.tensor_parallel_size} x {spec.data_parallel_size} = {ranks}; list exactly {ranks} devices or change the sizes")
            for dev in spec.devices:
                key = (spec.host, dev)
                if key in devices:
                    problems.fail(base + ("devices",), f"GPU {dev} on host '{spec.host}' is also given to {_field_name(devices[key])}; give each GPU to one instance")
                devices[key] = base
        else:
            if spec.devices:
                problems.fail(base + ("devices",), "GPU devices need platform: cuda; remove devices or set platform: cuda")
            if spec.data_parallel_size != 1:
                problems.fail(base + ("data_parallel_size",), f"CPU instances run one data-parallel rank (got {spec.data_parallel_size}); "
                              "set data_parallel_size: 1 and run one instance per rank")
            if spec.cpu_cores is not None:
                _claim_cores(topo, role, index, spec, cores, problems)
    _check_tp_sizes(topo, problems)
    if topo.connector.backend == "LIBFABRIC" and topo.platform == "cpu":
        problems.fail(("connector", "backend"), "LIBFABRIC (EFA) needs platform: cuda hosts with EFA; use backend: UCX for CPU deployments")


def _claim_cores(topo: Topology, role: Role, index: int, spec: InstanceSpec, cores: dict, problems: _Problem) -> None:
    """One core list per rank; a core given twice (two instances, or two ranks of one) only where
    every instance involved says share_cores."""
    base = (role, index)
    groups = rank_core_lists(spec.cpu_cores)
    ranks = spec.tensor_parallel_size
    if len(groups) != ranks:
        example = "|".join(str(i) for i in range(ranks)) if ranks > 1 else "0-3"
        problems.fail(base + ("cpu_cores",), f"gives {len(groups)} core list(s) for {ranks} TP rank(s); give one per rank, "
                      f"'|'-separated, e.g. '{example}'")
    for rank, group in enumerate(groups):
        for core in sorted(group):
            key = (spec.host, core)
            if key in cores:
                other_path, other_rank = cores[key]
                other = getattr(topo, other_path[0])[other_path[1]]
                if not (spec.share_cores and other.share_cores):
                    whom = f"its rank {other_rank}" if other is spec else f"{_field_name(other_path)} ({other.name})"
                    problems.fail(base + ("cpu_cores",), f"core {core} on host '{spec.host}' is also given to {whom}; give each "
                                  "instance and rank its own cores, or set share_cores: true on every instance that shares them "
                                  "(a small machine)")
            cores[key] = (base, rank)


def known_kv_heads(topo: Topology) -> int | None:
    """The model's KV heads where known before launch: model.kv_heads, the tiny model's, or the
    config.json of a model present on this machine. None: doctor checks on the hosts."""
    if topo.model.kv_heads is not None:
        return topo.model.kv_heads
    if topo.model.tiny is not None:
        return topo.model.tiny.kv_heads
    from .model_config import kv_heads_of

    return kv_heads_of(Path(topo.model.path).expanduser())


def _check_tp_sizes(topo: Topology, problems: _Problem) -> None:
    """Each instance's TP size splits the model's KV heads the way vLLM can; prefill and decode
    may use different sizes (kvpush re-shards the heads at the transfer)."""
    heads = known_kv_heads(topo)
    if heads is None:
        return
    from kvpush.connector.sharding import tp_problem

    for role, index, spec in topo.instances():
        problem = tp_problem(heads, spec.tensor_parallel_size)
        if problem:
            problems.fail((role, index, "tensor_parallel_size"),
                          f"{spec.name} uses TP size {spec.tensor_parallel_size} but the model has {heads} KV heads: {problem}")


def check_key_files(topo: Topology) -> None:
    """Before connecting: each SSH host's `key` is a private key file on this machine.

    Not part of loading: `plan` must work for a topology whose keys live on another machine.
    """
    for name, host in topo.hosts.items():
        if host.key is None or host.is_local:
            continue
        key_file = Path(host.key).expanduser()
        where = f"hosts.{name}.key: {host.key}"
        if not key_file.exists():
            raise TopologyError(f"{where}: no such file; give the private key path")
        if not key_file.is_file():
            raise TopologyError(f"{where}: not a file; give the private key path")
        if key_file.suffix == ".pub":
            raise TopologyError(f"{where}: is the public key; give the private key path (without .pub)")


def _slurm_host_addresses(data: dict) -> None:
    """launcher slurm: a host's address may be left out; it is its node's name until `up` learns
    the node's NodeAddr from Slurm."""
    hosts = data.get("hosts")
    if data.get("launcher") != "slurm" or not isinstance(hosts, dict):
        return
    for name, host in hosts.items():
        if host is None:
            hosts[name] = host = {}
        if isinstance(host, dict) and "address" not in host:
            host["address"] = str(host.get("node") or name)


def topology_from_document(doc: SourceDocument) -> Topology:
    if not isinstance(doc.data, dict):
        raise TopologyError(f"{doc.where(())}: the topology must be a YAML mapping with at least 'model:'; see `kvpush init`")
    _slurm_host_addresses(doc.data)
    try:
        topo = Topology.model_validate(doc.data)
    except ValidationError as exc:
        err = exc.errors()[0]
        path = tuple(err["loc"])
        raise TopologyError(f"{doc.where(path)}: {_field_name(path)}: {pydantic_message(err)}") from None
    problems = _Problem(doc)
    _apply_defaults(topo, problems)
    _check_cross_fields(topo, problems)
    from .slurm_topology import check_slurm_fields  # the launcher's own rules live with it

    check_slurm_fields(topo, problems.fail)
    return topo


def load_topology(path: str | Path) -> Topology:
    path = Path(path)
    if not path.exists():
        raise TopologyError(f"{path}: no such topology file; create one with `kvpush init {path}`")
    if path.is_dir():
        raise TopologyError(f"{path}: is a directory; give the topology YAML file inside it")
    if not path.is_file():
        raise TopologyError(f"{path}: is not a regular file; give a topology YAML file")
    try:
        doc = load_yaml_file(path)
    except YamlSyntaxError as exc:
        raise TopologyError(str(exc)) from None
    except UnicodeDecodeError as exc:
        raise TopologyError(f"{path}: not UTF-8 text (byte {exc.start}); save the topology as UTF-8") from None
    except OSError as exc:
        raise TopologyError(f"{path}: cannot read it ({exc.strerror or exc}); check its permissions") from None
    return topology_from_document(doc)


def resolve_topology(path: str | Path | None) -> tuple[Topology, str]:
    """The topology a command works on, and a phrase saying where it came from.

    No path: ./kvpush.yaml if present, else the built-in local-cpu template.
    """
    if path is not None:
        return load_topology(path), str(path)
    default_file = Path("kvpush.yaml")
    if default_file.is_file():
        return load_topology(default_file), f"{default_file} (found in the current directory)"
    from kvpush.templates import DEFAULT_TEMPLATE, template_text

    return parse_topology(template_text(DEFAULT_TEMPLATE), f"<built-in {DEFAULT_TEMPLATE}>"), f"the built-in {DEFAULT_TEMPLATE} topology (no FILE and no ./kvpush.yaml)"


def parse_topology(text: str, source: str = "<string>") -> Topology:
    try:
        doc = parse_yaml(text, source)
    except YamlSyntaxError as exc:
        raise TopologyError(str(exc)) from None
    return topology_from_document(doc)
