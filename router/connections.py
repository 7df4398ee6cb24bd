"""What one client connection may cost the router: how many it holds, how long a request's head
and body may take to arrive, how large a body may be declared.

aiohttp bounds a head's size (8190 bytes a line, 128 header fields) and closes a kept-alive
connection left idle for `keepalive_timeout_s`, but it waits for a head or a body however slowly
it trickles in, and takes connections until the process runs out of files (libuv then resets every
new one). So each connection is wrapped in a ClientConnection and counted by the ConnectionGuard:

- at most `max_connections` per router process, lowered at start to what the open-files limit
  leaves (a client connection, its prefill leg and its decode leg take a file each). A connection
  past it takes the place of the least recently active one with no request in progress (idle
  between requests, or still sending its head), so holding connections open cannot keep a real
  client out; only when every connection has a request in progress is the new one answered 503
  with Retry-After and closed;
- a request head must be complete within `header_timeout_s` of the connection's open (on a
  kept-alive connection: of the head's first byte), checked every SWEEP_S at most;
- a body must arrive within `body_timeout_s` of its head (408, connection closed), and one whose
  declared Content-Length is over the limit is answered 413 before a byte of it is read.

Each is counted in kvpush_router_refused_connections_total{reason}; a head aiohttp cannot parse
(answered 400) too, and logged once per MALFORMED_LOG_EVERY_S at most instead of with a traceback
each time, so a client cannot fill the router's disk with them.
"""
from __future__ import annotations

import asyncio
import json
import logging
import resource
import socket
import time
from typing import Callable

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from .config import RouterConfig
from .errors import error_payload, error_response
from .metrics import RouterMetrics
from .validation import RequestRejected

log = logging.getLogger("kvpush.router")

LISTEN_BACKLOG = 1024
FILES_PER_CONNECTION = 3  # the client's socket, its prefill leg's and its decode leg's
FILES_RESERVED = 64  # listening socket, logs, metric files, health probes, the interpreter's own
SWEEP_S = 1.0  # at most this late a head past its deadline is cut
RETRY_AFTER_S = 1

# reason label values of kvpush_router_refused_connections_total
CONNECTION_CAP = "connection_cap"  # a new connection answered 503: every connection had a request in progress
EVICTED = "evicted"  # an idle connection closed to make room for a new one
SILENT = "silent"  # opened, sent nothing within header_timeout_s
HEADER_TIMEOUT = "header_timeout"  # began a head, did not finish it within header_timeout_s
BODY_TIMEOUT = "body_timeout"  # 408: a body not whole within body_timeout_s
BODY_TOO_LARGE = "body_too_large"  # 413 on a declared Content-Length, before reading
MALFORMED_HEAD = "malformed_head"  # 400 from aiohttp's parser: a line over 8190 bytes, 129 headers, not HTTP
MALFORMED_LOG_EVERY_S = 10.0


def raise_open_files_limit() -> int:
    """Raise this process's open-files limit to its hard limit (many systems start processes at
    1024 with a far higher hard limit); the limit in effect."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError) as exc:
            log.warning("cannot raise the open-files limit from %d to %d: %s", soft, hard, exc)
    return soft


def connection_cap(max_connections: int, open_files: int) -> int:
    """How many client connections a process may hold without running out of files."""
    return max(1, min(max_connections, (open_files - FILES_RESERVED) // FILES_PER_CONNECTION))


def listening_socket(host: str, port: int) -> socket.socket:
    family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    return socket.create_server(address, family=family, backlog=LISTEN_BACKLOG)


class ClientConnection(asyncio.Protocol):
    """One client connection: aiohttp's protocol inside, what the guard needs to know around it."""

    def __init__(self, guard: ConnectionGuard, inner: asyncio.Protocol):
        self.guard = guard
        self.inner = inner
        self.transport: asyncio.Transport | None = None
        self.admitted = False
        self.requests = 0  # of this connection, being handled
        # when the head awaited now began (the open, or its first byte on a kept-alive connection);
        # None while a request is handled and while idle between requests (aiohttp's keep-alive)
        self.head_since: float | None = None
        self.sent_any = False
        # the loop calls these on aiohttp's protocol directly
        self.eof_received = inner.eof_received  # type: ignore[method-assign]
        self.pause_writing = inner.pause_writing  # type: ignore[method-assign]
        self.resume_writing = inner.resume_writing  # type: ignore[method-assign]

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        if self.guard.admit(self):
            self.admitted = True
            self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if not self.admitted:
            return
        if self.head_since is None and not self.requests:
            self.head_since = self.guard.now()
        self.sent_any = True
        self.inner.data_received(data)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.admitted:
            self.guard.forget(self)
            self.inner.connection_lost(exc)


class ConnectionGuard:
    def __init__(self, config: RouterConfig, metrics: RouterMetrics, open_files: int | None = None):
        if open_files is None:
            open_files = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        self.cap = connection_cap(config.max_connections, open_files)
        if self.cap < config.max_connections:
            log.warning("this router process holds at most %d client connections, not max_connections %d: its "
                        "open-files limit is %d (ulimit -n); raise it to hold more", self.cap,
                        config.max_connections, open_files)
        self.header_timeout_s = config.header_timeout_s
        self.body_timeout_s = config.body_timeout_s
        self.max_body_bytes = config.max_body_bytes
        self.metrics = metrics
        # least recently active first: the first without a request in progress makes room
        self.connections: dict[ClientConnection, None] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sweeper: asyncio.TimerHandle | None = None
        self._sweep_s = min(SWEEP_S, config.header_timeout_s / 4)
        self.server_log = ServerLog(metrics)  # aiohttp's server logs through it (app.start_site)
        body = json.dumps(error_payload(503, f"the router holds its limit of {self.cap} client connections, each "
                                             "with a request in progress; retry shortly")).encode()
        self._full_answer = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                             b"Retry-After: %d\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s"
                             % (RETRY_AFTER_S, len(body), body))

    # --- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._sweeper = self._loop.call_later(self._sweep_s, self._sweep)

    def stop(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None

    def now(self) -> float:
        assert self._loop is not None
        return self._loop.time()

    def protocol_factory(self, make_inner: Callable[[], asyncio.Protocol]) -> Callable[[], ClientConnection]:
        return lambda: ClientConnection(self, make_inner())

    # --- connections -------------------------------------------------------------------------

    def admit(self, conn: ClientConnection) -> bool:
        """Take a new connection, making room if it must; False when it was answered 503 and closed."""
        assert conn.transport is not None
        if len(self.connections) >= self.cap and not self._make_room():
            self.metrics.refused_connection(CONNECTION_CAP)
            conn.transport.write(self._full_answer)
            conn.transport.close()
            return False
        conn.head_since = self.now()
        self.connections[conn] = None
        self.metrics.client_connections.set(len(self.connections))
        return True

    def forget(self, conn: ClientConnection) -> None:
        if self.connections.pop(conn, False) is None:
            self.metrics.client_connections.set(len(self.connections))

    def _make_room(self) -> bool:
        for conn in self.connections:
            if not conn.requests:
                self._close(conn, EVICTED)
                return True
        return False

    def _close(self, conn: ClientConnection, reason: str) -> None:
        self.forget(conn)
        self.metrics.refused_connection(reason)
        assert conn.transport is not None
        conn.transport.close()  # aiohttp's protocol hears of it in connection_lost, as of a client gone

    def _sweep(self) -> None:
        """Close the connections whose head is past its deadline."""
        assert self._loop is not None
        due = self._loop.time() - self.header_timeout_s
        late = [c for c in self.connections if c.head_since is not None and c.head_since <= due and not c.requests]
        for conn in late:
            self._close(conn, HEADER_TIMEOUT if conn.sent_any else SILENT)
        self._sweeper = self._loop.call_later(self._sweep_s, self._sweep)

    # --- requests ----------------------------------------------------------------------------

    def request_started(self, request: web.BaseRequest) -> ClientConnection | None:
        """The request's head is complete: its connection is busy, and out of the head deadline."""
        transport = request.transport
        conn = transport.get_protocol() if transport is not None else None
        if type(conn) is not ClientConnection:
            return None
        conn.requests += 1
        conn.head_since = None
        return conn

    def request_ended(self, conn: ClientConnection | None) -> None:
        if conn is None:
            return
        conn.requests -= 1
        if self.connections.pop(conn, False) is None:
            self.connections[conn] = None  # now the most recently active

    def refuse_declared_body(self, request: web.BaseRequest) -> web.Response | None:
        """413 for a body declared larger than the limit, before any of it is read; else None."""
        length = request.content_length
        if length is None or length <= self.max_body_bytes:
            return None
        self.metrics.refused_connection(BODY_TOO_LARGE)
        return closing(error_response(413, f"request body of {length} bytes is over the router's limit of "
                                           f"{self.max_body_bytes} bytes (from max_prompt_chars)"))

    async def read_body(self, request: web.BaseRequest) -> bytes:
        """The request's body, whole within body_timeout_s; RequestRejected 408 or 413."""
        try:
            if request.content.is_eof():  # it came with the head: no timer to set
                return await request.read()
            async with asyncio.timeout(self.body_timeout_s):
                return await request.read()
        except TimeoutError:
            self.metrics.refused_connection(BODY_TIMEOUT)
            raise RequestRejected(408, f"request body not received in full within the router's body_timeout_s "
                                       f"({self.body_timeout_s:g} s)") from None
        except web.HTTPRequestEntityTooLarge:
            raise RequestRejected(413, f"request body over the router's limit of {self.max_body_bytes} bytes "
                                       "(from max_prompt_chars)") from None


class ServerLog:
    """The logger aiohttp's server is given (AppRunner's `logger`): a head its parser refused is
    counted, and said in one line (how many, the latest) at most every MALFORMED_LOG_EVERY_S,
    without a traceback; everything else goes to aiohttp's own logger as it would."""

    def __init__(self, metrics: RouterMetrics, logger: logging.Logger = logging.getLogger("aiohttp.server")):
        self.metrics = metrics
        self.logger = logger
        self.unlogged = 0
        self.logged_at = float("-inf")

    def exception(self, msg: str, *args, exc_info=None, **kwargs) -> None:
        if not self._malformed_head(args, exc_info):
            self.logger.exception(msg, *args, exc_info=exc_info, **kwargs)

    def debug(self, msg: str, *args, exc_info=None, **kwargs) -> None:
        if not self._malformed_head(args, exc_info):  # aiohttp says a first line that is not HTTP at debug level
            self.logger.debug(msg, *args, exc_info=exc_info, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self.logger, name)

    def _malformed_head(self, args: tuple, exc: object) -> bool:
        if not isinstance(exc, HttpProcessingError):
            return False
        self.metrics.refused_connection(MALFORMED_HEAD)
        self.unlogged += 1
        now = time.monotonic()
        if now - self.logged_at >= MALFORMED_LOG_EVERY_S:
            self.logger.warning("refused %d request head(s) that are not valid HTTP (400) since the last such line; "
                                "latest from %s: %s", self.unlogged, args[0] if args else "?",
                                str(exc).replace("\n", " ")[:200])
            self.unlogged, self.logged_at = 0, now
        return True


def closing(response: web.Response) -> web.Response:
    """The response, with the connection closed after it (its request's body was not read whole)."""
    response.force_close()
    return response


class GuardedSite(web.SockSite):
    """aiohttp's site on a listening socket, every connection of which goes through the guard."""

    def __init__(self, runner: web.BaseRunner, sock: socket.socket, guard: ConnectionGuard):
        super().__init__(runner, sock, backlog=LISTEN_BACKLOG)
        self._guarded_sock = sock
        self._guard = guard
        self._make_inner = runner.server

    async def start(self) -> None:
        await web.BaseSite.start(self)  # registers the site with its runner
        assert self._make_inner is not None
        self._server = await asyncio.get_running_loop().create_server(
            self._guard.protocol_factory(self._make_inner), sock=self._guarded_sock, backlog=LISTEN_BACKLOG)
