"""A lean HTTP/1.1 client for the router's calls to vLLM instances: kept-alive connections per
instance, bytes in, bytes out.

aiohttp's client spent about half of the router's CPU per request (URL objects, header multidicts,
cookie jar, tracing hooks, a timer context per read) on features a leg never uses: it POSTs a JSON
body to a known instance and reads a JSON answer or an SSE stream back. In a burst of requests that
CPU is queueing delay in every request's time to first token.
"""
from __future__ import annotations

import asyncio
import time
from urllib.parse import urlsplit

from .upstream_answer import UpstreamResponse
from .upstream_parse import UpstreamError

__all__ = ["UpstreamClient", "UpstreamError", "UpstreamResponse", "answer_head"]


class _Target:
    """Host, port and Host header of one instance's base URL, parsed once."""

    def __init__(self, base_url: str):
        parts = urlsplit(base_url)
        if parts.scheme != "http" or not parts.hostname:
            raise UpstreamError(f"instance URL {base_url!r} is not http://host:port")
        self.host = parts.hostname
        self.port = parts.port or 80
        self.host_header = parts.netloc


class _Connection(asyncio.Protocol):
    def __init__(self, client: UpstreamClient, key: tuple[str, int]):
        self.client = client
        self.key = key
        self.transport: asyncio.Transport | None = None
        self.response: UpstreamResponse | None = None
        self.idle_since = 0.0
        self.idle = False
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self.response is not None:
            self.response.feed(data)
        else:  # nothing was asked: the connection is out of step
            self.abort()

    def eof_received(self) -> bool:
        if self.response is not None:
            self.response.feed_eof()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.idle:  # the instance closed it while idle (its own keep-alive ran out)
            self.client._forget_idle(self)
        response, self.response = self.response, None
        if response is not None:
            if exc is not None:
                response.fail(UpstreamError(f"connection lost: {exc}"))
            else:
                response.feed_eof()

    def send(self, response: UpstreamResponse, request: bytes) -> None:
        self.response = response
        assert self.transport is not None
        self.transport.write(request)

    def answer_ended(self, reusable: bool) -> None:
        self.response = None
        if reusable and not self.closed:
            self.client._put_idle(self)
        else:
            self.abort()

    def abort(self) -> None:
        self.response = None
        if not self.closed and self.transport is not None:
            self.closed = True
            self.transport.abort()


async def answer_head(response: UpstreamResponse) -> UpstreamResponse:
    """Wait for the head of a sent request's answer; the answer is closed if that fails or is cancelled."""
    try:
        await response.head()
    except BaseException:
        response.close()
        raise
    return response


def _encode_request(target: _Target, method: str, path: str, headers: dict[str, str], body: bytes | None) -> bytes:
    lines = [f"{method} {path} HTTP/1.1\r\nHost: {target.host_header}\r\n"]
    lines.extend(f"{name}: {value}\r\n" for name, value in headers.items())
    if body is not None:
        lines.append(f"Content-Length: {len(body)}\r\n")
    lines.append("\r\n")
    head = "".join(lines).encode()
    return head + body if body else head


class UpstreamClient:
    """Connections to the instances, kept alive for at most `keepalive_s` idle."""

    def __init__(self, keepalive_s: float):
        self.keepalive_s = keepalive_s
        self._targets: dict[str, _Target] = {}
        self._idle: dict[tuple[str, int], list[_Connection]] = {}

    def _target(self, base_url: str) -> _Target:
        target = self._targets.get(base_url)
        if target is None:
            target = self._targets[base_url] = _Target(base_url)
        return target

    def _put_idle(self, conn: _Connection) -> None:
        conn.idle_since = time.monotonic()
        conn.idle = True
        self._idle.setdefault(conn.key, []).append(conn)

    def _forget_idle(self, conn: _Connection) -> None:
        conn.idle = False
        idle = self._idle.get(conn.key)
        if idle and conn in idle:
            idle.remove(conn)

    def _take_idle(self, key: tuple[str, int]) -> _Connection | None:
        idle = self._idle.get(key)
        if not idle:
            return None
        now = time.monotonic()
        while idle:
            conn = idle.pop()  # the most recently used: least likely to be closed by the server
            conn.idle = False
            open_ = conn.transport is not None and not conn.transport.is_closing()
            if open_ and not conn.closed and now - conn.idle_since < self.keepalive_s:
                return conn
            conn.abort()
        return None

    def start(self, method: str, base_url: str, path: str, headers: dict[str, str], body: bytes | None,
              connect_s: float, total_s: float) -> UpstreamResponse:
        """Send one request and return its answer, to wait for with `answer_head`. On an idle
        kept-alive connection the request is written now, before the caller yields; otherwise a
        connection is made first, in the background (the answer fails with UpstreamError if none
        is made within connect_s). total_s bounds the whole answer, body included."""
        loop = asyncio.get_running_loop()
        target = self._target(base_url)
        key = (target.host, target.port)
        request = _encode_request(target, method, path, headers, body)
        conn = self._take_idle(key)
        response = UpstreamResponse(None, loop, loop.time() + total_s)
        if conn is not None:
            response._connected(conn, request)
        else:
            response._connecting = loop.create_task(self._connect_then_send(response, target, key, request, connect_s))
        return response

    async def request(self, method: str, base_url: str, path: str, headers: dict[str, str], body: bytes | None,
                      connect_s: float, total_s: float) -> UpstreamResponse:
        """Send one request and wait for the head of its answer.

        Raises UpstreamError (no connection within connect_s, connection refused, reset, closed,
        malformed answer) or asyncio.TimeoutError (no answer head within total_s, which also
        bounds reading the body afterwards)."""
        return await answer_head(self.start(method, base_url, path, headers, body, connect_s, total_s))

    async def _connect_then_send(self, response: UpstreamResponse, target: _Target, key: tuple[str, int],
                                 request: bytes, connect_s: float) -> None:
        loop = asyncio.get_running_loop()
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(lambda: _Connection(self, key), target.host, target.port), connect_s)
        except asyncio.TimeoutError:  # before OSError, of which it is a subclass
            response.fail(UpstreamError(f"Cannot connect to host {target.host_header}: "
                                        f"no connection within {connect_s:g} s"))
        except OSError as exc:
            response.fail(UpstreamError(f"Cannot connect to host {target.host_header}: {exc.strerror or exc}"))
        except Exception as exc:  # anything else is the reader's to raise, not to wait out total_s for
            response.fail(exc)
        else:
            response._connected(conn, request)

    def close(self) -> None:
        idle_lists, self._idle = list(self._idle.values()), {}
        for idle in idle_lists:
            for conn in idle:
                conn.idle = False
                conn.abort()
