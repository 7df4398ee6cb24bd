"""The router's configuration: written by `kvpush plan`/`up` as JSON, read by the router at start.

One model for both sides so the plan and the router can never disagree on a field.
"""
from __future__ import annotations

from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

Protocol = Literal["kvpush", "nixl-push", "nixl-pull", "colocated"]
Policy = Literal["round-robin", "least-loaded"]
PublicPath = Literal["/health", "/metrics"]  # the only paths that may be served without the API key


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Upstream(_Model):
    """One vLLM instance the router may send a leg to."""

    name: str
    url: str  # http://host:port, no trailing slash
    engine_id: str  # the instance's kv_transfer_config engine_id
    side_channel_host: str
    side_channel_port: int
    tp_size: int = 1
    pp_size: int = 1

    @field_validator("url")
    @classmethod
    def _plain_http_base(cls, url: str) -> str:
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname or parts.path not in ("", "/") or parts.query:
            raise ValueError(f"{url!r} is not an instance base URL; write http://host:port")
        return url.rstrip("/")


class Timeouts(_Model):
    connect_s: float = Field(5.0, gt=0)
    prefill_s: float = Field(600.0, gt=0)  # a prefill leg's whole answer
    decode_s: float = Field(600.0, gt=0)  # a non-streamed decode answer; a stream's first token
    stream_idle_s: float = Field(120.0, gt=0)  # longest silence of a decode stream after its first token


class RouterConfig(_Model):
    bind: str = "127.0.0.1"
    port: int = 8000
    protocol: Protocol
    policy: Policy = "round-robin"
    served_model_name: str
    # The key clients must present: from an env var, or from a file that only its owner can read.
    api_key_env: str | None = None
    api_key_file: str | None = None
    # The key the router presents to the instances (vLLM's --api-key); unset: the router's own key.
    instance_api_key_env: str | None = None
    instance_api_key_file: str | None = None
    public_paths: list[PublicPath] = Field(default_factory=lambda: ["/health"])
    max_prompt_chars: int = 4_000_000
    max_batch_prompts: int = Field(1024, ge=1)  # prompts in one completion request (vLLM's own default limit)
    timeouts: Timeouts = Field(default_factory=Timeouts)
    metrics_refresh_s: float = 1.0
    max_retries: int = Field(1, ge=0)  # extra attempts on another pair before the first token
    eject_after_failures: int = Field(3, ge=1)  # consecutive connection/health failures that take an instance out
    probe_interval_s: float = Field(1.0, gt=0)  # how often ejected instances' /health is probed
    workers: int = Field(1, ge=1, le=64)  # router processes sharing the port (see workers.py)
    prefill: list[Upstream] = Field(default_factory=list)
    decode: list[Upstream]

    @model_validator(mode="after")
    def _one_source_per_key(self) -> "RouterConfig":
        for prefix in ("api_key", "instance_api_key"):
            if getattr(self, f"{prefix}_env") and getattr(self, f"{prefix}_file"):
                raise ValueError(f"set {prefix}_env or {prefix}_file, not both")
        return self

    @classmethod
    def from_file(cls, path: str | Path) -> "RouterConfig":
        return cls.model_validate_json(Path(path).read_text())
