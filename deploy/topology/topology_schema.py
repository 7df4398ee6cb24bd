"""The topology file's schema: typed models that check each field on its own. The sections of
what runs where (hosts, instances, the router) are process_specs', on spec_model's base.

Defaults that depend on other fields (names, hosts, ports) are filled by topology_defaults, rules
between fields are checked by topology_checks, and topology.py loads a file through all three.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

from pydantic import AfterValidator, Field, field_validator, model_validator

from kvpush.common.errors import UsageError
from kvpush.connector.settings import TRANSFER_TIMEOUT_S

from . import topology_values as values
from .process_specs import HostSpec, InstanceSpec, RouterSpec
from .spec_model import DAY_S, SpecModel
from .topology_values import EnvMap, ExtraArgs, IntNotBool, PathText, PlainName, not_blank

NAME_PATTERN = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")
ROUTER_PROCESS_NAME = "router"  # the plan's and state's name for the router process
ConnectorType = Literal["kvpush", "nixl-push", "nixl-pull", "colocated"]
Backend = Literal["UCX", "LIBFABRIC"]
Platform = Literal["cpu", "cuda"]
Role = Literal["prefill", "decode"]
Launcher = Literal["ssh", "slurm"]
InstancePublicPath = Literal["/health", "/metrics", "/ping", "/version", "/load"]  # paths that generate nothing


class TopologyError(UsageError):
    """A topology problem; str() is the one-line message a user sees."""


class TinyModelSpec(SpecModel):
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


class ModelSpec(SpecModel):
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


class ConnectorSpec(SpecModel):
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


def _instance_public_paths() -> list[InstancePublicPath]:
    return ["/health", "/metrics"]


class SlurmSpec(SpecModel):
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


class SecretSource(SpecModel):
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


class TracingSpec(SpecModel):
    """vLLM's own OpenTelemetry spans, one per request, sent by every instance (`--otlp-traces-endpoint`).
    Each instance names itself by its service name and the kvpush.deployment and kvpush.role resource
    attributes (deploy/plan/engine_tracing.py). `kvpush bench` sets this itself where it measures."""

    otlp_endpoint: Annotated[str, AfterValidator(_otlp_endpoint)] = Field(
        description="where the spans go, e.g. http://collector:4318/v1/traces (http/protobuf) or http://collector:4317 "
                                "(grpc)"
    )
    protocol: Literal["http/protobuf", "grpc"] = Field("http/protobuf", description="the OTLP exporter's protocol")
    export_delay_ms: IntNotBool = Field(5000, ge=1, le=600_000, description="the SDK exports finished spans this often")


class Topology(SpecModel):
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
