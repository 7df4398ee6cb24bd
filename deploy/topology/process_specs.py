"""The topology's sections for what runs where: the hosts, the vLLM instances and the router, and
what each process's supervisor does when it exits. Topology (topology_schema) holds them.
"""
from __future__ import annotations

import sys
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BeforeValidator, Field, field_validator, model_validator
from pydantic.dataclasses import dataclass as pydantic_dataclass

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
from .spec_model import DAY_S, SPEC_CONFIG, SpecModel, defaulted
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

MIN_KV_CACHE_GIB = 1 / 64  # 16 MiB: below this a CPU instance has too few blocks for one long prompt
RouterPublicPath = Literal["/health", "/metrics"]


@pydantic_dataclass(config=SPEC_CONFIG, kw_only=True)
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


class RestartSpec(SpecModel):
    """What the process's supervisor does when it exits on its own (see kvpush.deploy.lifecycle.supervise)."""

    policy: Literal["never", "on-failure"] = Field("never", description="on-failure: start it again after a crash")
    max_restarts: IntNotBool = Field(
        3, ge=1, le=1000, description="restarts allowed within window_s; then it stays down"
    )
    window_s: float = Field(600.0, gt=0, description="the seconds over which max_restarts are counted")


RestartShorthand = Literal["never", "on-failure", False]  # `restart: on-failure`; a bare `no` reads as false
RestartField = Annotated[RestartSpec, BeforeValidator(_restart_shorthand,
                                                      json_schema_input_type=RestartSpec | RestartShorthand)]


class InstanceSpec(SpecModel):
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
        return defaulted(self.name, "name")

    @property
    def resolved_host(self) -> str:
        return defaulted(self.host, f"{self.name}: host")

    @property
    def resolved_http_port(self) -> int:
        return defaulted(self.http_port, f"{self.name}: http_port")

    @property
    def resolved_side_channel_port(self) -> int:
        return defaulted(self.side_channel_port, f"{self.name}: side_channel_port")


def _router_public_paths() -> list[RouterPublicPath]:
    return ["/health"]


class RouterSpec(SpecModel):
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
        return defaulted(self.host, "router: host")
