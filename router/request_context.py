"""One client request as the router carries it through its legs and its answer (dispatch.py, respond.py)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from aiohttp import web

from .fanout import Part


@dataclass
class RequestContext:
    request: web.Request
    endpoint: str  # "/v1/completions" or "/v1/chat/completions"
    stream: bool
    parts: list[Part]
    client_request_id: str | None = None  # the client's X-Request-Id, already checked
    started: float = field(default_factory=time.perf_counter)

    @property
    def chat(self) -> bool:
        return self.endpoint.endswith("/chat/completions")
