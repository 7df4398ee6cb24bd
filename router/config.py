"""The router's configuration: written by `kvpush plan`/`up` as JSON, read by the router at start.

One model for both sides so the plan and the router can never disagree on a field. The instances
come inline (`prefill`, `decode`) or from `instances_file` (instances.py), which the router reads
again on SIGHUP: a deployment changes its instances without restarting the router.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvpush.common.errors import UsageError
from kvpush.common.kv_params import DEFAULT_TTL_S

from .instances import load_instance_list
from .upstream_spec import Upstream

Protocol = Literal["kvpush", "nixl-push", "nixl-pull", "colocated"]
Policy = Literal["prefix-aware", "least-loaded", "round-robin"]
PublicPath = Literal["/health", "/metrics"]  # the only paths that may be served without the API key
RETRY_DEADLINE_S = 60.0  # default of retry_deadline_s, here and in a topology's router section
# defaults of the prefix-aware policy's weights, here and in a topology's router section: a candidate
# holding the whole prompt is worth two legs in flight (docs/router.md says what chose 0.5 over 0.25)
PREFIX_WEIGHT = 1.0
LOAD_WEIGHT = 0.5
# What one client connection may hold (connections.py); defaults here and in a topology's router section.
MAX_CONNECTIONS = 4096  # per router process; lowered at start to what its open-files limit allows
HEADER_TIMEOUT_S = 10.0  # a request head must arrive in full within this
BODY_TIMEOUT_S = 30.0  # a request body must arrive in full within this of its head
KEEPALIVE_TIMEOUT_S = 30.0  # an idle kept-alive connection is closed after this
MAX_BODY_BYTES_PER_CHAR = 8  # JSON escapes can inflate a prompt; the prompt limit is checked after parsing


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class Timeouts(_Model):
    connect_s: float = Field(5.0, gt=0)
    prefill_s: float = Field(600.0, gt=0)  # a prefill leg's whole answer
    decode_s: float = Field(600.0, gt=0)  # a non-streamed decode answer; a stream's first token
    stream_idle_s: float = Field(120.0, gt=0)  # longest silence of a decode stream after its first token
    health_s: float = Field(1.0, gt=0)  # a /health probe's answer; none this long is a failed probe (a hang)


class PrefixAwareSettings(_Model):
    """The prefix-aware policy's knobs (prefix_policy.py says how they weigh)."""

    prefix_weight: float = Field(PREFIX_WEIGHT, ge=0)  # worth of holding the whole prompt
    load_weight: float = Field(LOAD_WEIGHT, ge=0)  # cost of one leg in flight more than the least-loaded candidate
    block_tokens: int = Field(32, ge=1, le=4096)  # a token-id prompt's block in the record
    block_chars: int = Field(128, ge=1, le=16384)  # a text (or chat) prompt's block in the record
    record_blocks: int = Field(131_072, ge=1, le=1 << 26)  # entries of one role's record (~140 bytes each)


class RouterConfig(_Model):
    bind: str = "127.0.0.1"
    port: int = 8000
    protocol: Protocol
    policy: Policy = "prefix-aware"
    prefix_aware: PrefixAwareSettings = Field(default_factory=PrefixAwareSettings)
    served_model_name: str
    # The key clients must present: from an env var, or from a file that only its owner can read.
    api_key_env: str | None = None
    api_key_file: str | None = None
    # The key the router presents to the instances (vLLM's --api-key); unset: the router's own key.
    instance_api_key_env: str | None = None
    instance_api_key_file: str | None = None
    # The key kvpush kv_transfer_params are signed with (kvpush.common.kv_params), derived from the
    # deployment secret and written by `kvpush up`; unset: legs go unsigned (a deployment without a secret).
    transfer_params_key_file: str | None = None
    transfer_params_ttl_s: float = Field(DEFAULT_TTL_S, gt=0, le=3600)  # a signed leg's params expire this long after
    public_paths: list[PublicPath] = ["/health"]  # pydantic copies a mutable default for each config
    max_prompt_chars: int = 4_000_000
    max_batch_prompts: int = Field(1024, ge=1)  # prompts in one completion request (vLLM's own default limit)
    timeouts: Timeouts = Field(default_factory=Timeouts)
    metrics_refresh_s: float = 1.0
    # No attempt of a request starts later than this after the request arrived: a failure after it
    # (before the first token) ends the request instead of being tried on another pair.
    retry_deadline_s: float = Field(RETRY_DEADLINE_S, gt=0)
    eject_after_failures: int = Field(2, ge=1)  # consecutive connection/health failures that take an instance out
    probe_interval_s: float = Field(0.5, gt=0)  # how often each instance's /health is probed
    workers: int = Field(1, ge=1, le=64)  # router processes sharing the port (see workers.py)
    # What a client may hold (connections.py). Past max_connections a new connection takes the place
    # of the least recently active one that has no request in progress, or gets a 503.
    max_connections: int = Field(MAX_CONNECTIONS, ge=1, le=1_000_000)
    header_timeout_s: float = Field(HEADER_TIMEOUT_S, gt=0)  # from a connection's open, or a head's first byte
    body_timeout_s: float = Field(BODY_TIMEOUT_S, gt=0)  # from the head's end to the body's
    keepalive_timeout_s: float = Field(KEEPALIVE_TIMEOUT_S, gt=0)  # an idle connection between requests
    # A JSON file {"prefill": [...], "decode": [...]} read at start and again on SIGHUP (a path
    # relative to the config file's folder); or the instances inline:
    instances_file: str | None = None
    prefill: list[Upstream] = Field(default_factory=list)
    decode: list[Upstream] = Field(default_factory=list)

    @property
    def max_body_bytes(self) -> int:
        """The largest request body taken: room for max_prompt_chars escaped, and the rest of the request."""
        return self.max_prompt_chars * MAX_BODY_BYTES_PER_CHAR + (1 << 20)

    @model_validator(mode="before")
    @classmethod
    def _no_retry_count(cls, data: object) -> object:
        if isinstance(data, dict) and "max_retries" in data:
            raise ValueError("max_retries is gone: the router tries every pair in rotation, then decode alone, "
                             "within retry_deadline_s; remove max_retries (set retry_deadline_s to bound the retries)")
        return data

    @model_validator(mode="after")
    def _one_source_per_key(self) -> RouterConfig:
        for prefix in ("api_key", "instance_api_key"):
            if getattr(self, f"{prefix}_env") and getattr(self, f"{prefix}_file"):
                raise ValueError(f"set {prefix}_env or {prefix}_file, not both")
        if not self.instances_file and not self.decode:
            raise ValueError("give the decode instances (decode: [...]) or an instances_file that lists them")
        return self

    @classmethod
    def from_file(cls, path: str | Path) -> RouterConfig:
        """The config, with the instances of its instances_file (whose path becomes absolute)."""
        path = Path(path)
        config = cls.model_validate_json(path.read_text())
        if config.instances_file is None:
            return config
        if config.prefill or config.decode:
            raise UsageError(f"router config {path}: instances_file and inline prefill/decode lists are both "
                             "given; keep one")
        where = (path.parent / Path(config.instances_file).expanduser()).absolute()
        listed = load_instance_list(where)
        return config.model_copy(
            update={"instances_file": str(where), "prefill": listed.prefill, "decode": listed.decode}
        )

    def to_file_json(self, indent: int | None = None) -> str:
        """The config as from_file reads it back: without the instances its instances_file lists."""
        if self.instances_file is None:
            return self.model_dump_json(indent=indent)
        return json.dumps(self.model_dump(mode="json", exclude={"prefill", "decode"}), indent=indent)
