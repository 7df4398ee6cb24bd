"""One vLLM instance the router may send a leg to, as the router config and its instance list name it."""
from __future__ import annotations

from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, field_validator


class Upstream(BaseModel):
    """One vLLM instance the router may send a leg to."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

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
