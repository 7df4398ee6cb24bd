"""Every path of a vLLM instance needs the instance key, except the few its deployment leaves open.

vLLM's own `--api-key` check guards the paths under /v1, /v2, /inference (and /cohere) only;
/invocations, /tokenize, /pooling, /classify, /score and others answer anyone, and /invocations
generates. kvpush loads this class into each instance with vLLM's `--middleware` (an ASGI
middleware wrapping the whole app, in vLLM 0.25 through 0.32), so that whatever routes a vLLM
release mounts, a request without `Authorization: Bearer <instance key>` gets 401 unless its path
is one of the open ones:

    VLLM_API_KEY                   the instance key (the same variable vLLM's own check reads)
    KVPUSH_INSTANCE_PUBLIC_PATHS   paths served without it, comma-separated (default: /health,/metrics)

An open path matches exactly (`/metrics` and `/metrics/`, not `/metrics/x` or `/health?` tricks:
the query string is not part of the path). Without a key in the environment the instance refuses
to start: an instance that answers everyone is never the fallback.

A refusal is counted in `vllm:kvpush_refused_requests_total{reason}` (no_key, wrong_key) on the
instance's /metrics and logged, at most one line per 10 s with how many were refused meanwhile.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import threading
import time
from typing import Any, Awaitable, Callable, Mapping

from prometheus_client import Counter

KEY_VARIABLE = "VLLM_API_KEY"
PUBLIC_PATHS_VARIABLE = "KVPUSH_INSTANCE_PUBLIC_PATHS"
DEFAULT_PUBLIC_PATHS = ("/health", "/metrics")
# What `kvpush plan` puts after vLLM's --middleware.
MIDDLEWARE_PATH = "kvpush.common.instance_auth.InstanceKeyMiddleware"
LOG_EVERY_S = 10.0

_refused: Counter | None = None
_refused_lock = threading.Lock()


def refused_counter() -> Counter:
    """The refusal counter, registered (once per process) by the first middleware made: importing
    this module for its names registers nothing."""
    global _refused
    with _refused_lock:
        if _refused is None:
            _refused = Counter("vllm:kvpush_refused_requests",
                               "Requests this instance refused for a missing or wrong instance key.", ["reason"])
        return _refused

log = logging.getLogger(__name__)

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

_BODY = json.dumps({"error": {"message": "this instance answers its deployment's router and kvpush only: send "
                                         "Authorization: Bearer <instance key>",
                              "type": "Unauthorized", "code": 401}}).encode()


def public_paths(text: str | None) -> frozenset[str]:
    """The open paths from KVPUSH_INSTANCE_PUBLIC_PATHS ("" opens none); each also with a trailing '/'."""
    paths = DEFAULT_PUBLIC_PATHS if text is None else [p.strip() for p in text.split(",") if p.strip()]
    for path in paths:
        if not path.startswith("/"):
            raise ValueError(f"{PUBLIC_PATHS_VARIABLE}: {path!r} is not a path; give paths such as /health,/metrics")
    return frozenset(p for path in paths for p in (path.rstrip("/") or "/", path.rstrip("/") + "/"))


def _digest(value: bytes) -> bytes:
    # Hashing first makes the comparison independent of the given value's length.
    return hashlib.sha256(value).digest()


class _RateLimitedLog:
    """One warning per LOG_EVERY_S, saying how many refusals it stands for."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock, self._lock = clock, threading.Lock()
        self._next, self._pending = 0.0, 0

    def refused(self, reason: str, scope: Scope) -> None:
        with self._lock:
            self._pending += 1
            now = self._clock()
            if now < self._next:
                return
            count, self._pending, self._next = self._pending, 0, now + LOG_EVERY_S
        _log_through_vllm()  # at the line, not at start: vLLM may configure its logging after the app is built
        client = scope.get("client") or ("?", 0)
        path = str(scope.get("path", ""))[:120]
        log.warning("kvpush: refused %d request(s) without the instance key in the last %.0f s; latest: %s %r from %s "
                    "(%s)", count, LOG_EVERY_S, scope.get("method", scope["type"]), path, client[0], reason)


def _log_through_vllm() -> None:
    """Inside vLLM, this module's lines go to vLLM's handlers (its format, the instance's log), as
    the connector's do; where vLLM has none (yet), to stderr. Never through the root logger alone:
    vLLM's SageMaker routes set its level to ERROR."""
    ours = logging.getLogger(__name__)
    if ours.handlers:
        return
    for handler in logging.getLogger("vllm").handlers or [logging.StreamHandler()]:
        ours.addHandler(handler)
    ours.setLevel(logging.WARNING)
    ours.propagate = False


class InstanceKeyMiddleware:
    """Pure ASGI: constructed by vLLM with the app only, so it takes its settings from the environment."""

    def __init__(self, app: ASGIApp, environ: Mapping[str, str] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        environ = os.environ if environ is None else environ
        key = environ.get(KEY_VARIABLE, "")
        if not key:
            raise RuntimeError(f"kvpush: {KEY_VARIABLE} is unset or empty, and this instance would answer anyone; "
                               "start it with the instance key (`kvpush up` writes it to instance-api-key.env)")
        self.app = app
        self._key_digest = _digest(key.encode())
        self._public = public_paths(environ.get(PUBLIC_PATHS_VARIABLE))
        self._log = _RateLimitedLog(clock)
        self._refused = refused_counter()

    def _refusal(self, scope: Scope) -> str | None:
        """None when the request may pass, else the reason it may not."""
        if scope["path"] in self._public:
            return None
        values = [v for k, v in scope.get("headers", []) if k.lower() == b"authorization"]
        if not values:
            return "no_key"
        scheme, _, token = values[0].partition(b" ")
        if scheme.lower() != b"bearer" or not token.strip():
            return "no_key"
        return None if hmac.compare_digest(_digest(token.strip()), self._key_digest) else "wrong_key"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):  # lifespan: the server starting and stopping
            await self.app(scope, receive, send)
            return
        reason = self._refusal(scope)
        if reason is None:
            await self.app(scope, receive, send)
            return
        self._refused.labels(reason).inc()
        self._log.refused(reason, scope)
        if scope["type"] == "http":
            await _send_401(send, "http.response")
        elif "websocket.http.response" in scope.get("extensions", {}):
            await _send_401(send, "websocket.http.response")
        else:  # closing before accepting: the server answers the handshake with 403
            await send({"type": "websocket.close", "code": 1008})


async def _send_401(send: Send, prefix: str) -> None:
    await send({"type": f"{prefix}.start", "status": 401,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(_BODY)).encode()),
                            (b"www-authenticate", b"Bearer")]})
    await send({"type": f"{prefix}.body", "body": _BODY})
