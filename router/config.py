"""The router's configuration: written by `kvpush plan`/`up` as JSON, read by the router at start.

One model for both sides so the plan and the router can never disagree on a field.
"""
from __future__ import annotations

from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator

Protocol = Literal["kvpush", "nixl-push", "nixl-pull", "colocated"]
Policy = Literal["round-robin", "least-loaded"]


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
    connect_s: float = 5.0
    prefill_s: float = 600.0
    decode_s: float = 600.0


class RouterConfig(_Model):
    bind: str = "127.0.0.1"
    port: int = 8000
    protocol: Protocol
    policy: Policy = "round-robin"
    served_model_name: str
    api_key_env: str | None = None  # name of an env var that holds the API key
    api_key_file: str | None = None  # or a file (owner-only) whose first line is the API key clients must send
    # A file (owner-only) holding the key the router sends to the instances (their --api-key /
    # VLLM_API_KEY); unset: the instances get the client's key, as when they share one key.
    upstream_api_key_file: str | None = None
    max_prompt_chars: int = 4_000_000
    timeouts: Timeouts = Field(default_factory=Timeouts)
    metrics_refresh_s: float = 1.0
    max_retries: int = Field(1, ge=0)  # extra attempts on another pair before the first token
    eject_after_failures: int = Field(3, ge=1)  # consecutive leg failures that take an instance out
    probe_interval_s: float = Field(1.0, gt=0)  # how often ejected instances' /health is probed
    workers: int = Field(1, ge=1, le=64)  # router processes sharing the port (see workers.py)
    prefill: list[Upstream] = Field(default_factory=list)
    decode: list[Upstream]

    @classmethod
    def from_file(cls, path: str | Path) -> "RouterConfig":
        return cls.model_validate_json(Path(path).read_text())
