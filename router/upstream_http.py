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
from typing import Callable
from urllib.parse import urlsplit

_HEAD_END = b"\r\n\r\n"
_CRLF = b"\r\n"
_PAUSE_ABOVE = 1 << 18  # unread answer bytes above which the instance's socket stops being read


class UpstreamError(Exception):
    """The connection failed, closed early, or carried something that is not an HTTP/1.1 answer."""


class _Target:
    """Host, port and Host header of one instance's base URL, parsed once."""

    def __init__(self, base_url: str):
        parts = urlsplit(base_url)
        if parts.scheme != "http" or not parts.hostname:
            raise UpstreamError(f"instance URL {base_url!r} is not http://host:port")
        self.host = parts.hostname
        self.port = parts.port or 80
        self.host_header = parts.netloc


class UpstreamResponse:
    """One answer: status and headers once the head arrived, then the body as it comes."""

    def __init__(self, connection: "_Connection | None", loop: asyncio.AbstractEventLoop, deadline: float):
        self._conn: _Connection | None = connection  # None while connecting, and once done with
        self._connecting: asyncio.Task | None = None
        self._loop = loop
        self.status = 0
        self.headers: dict[str, str] = {}
        self._pending = b""  # received, not parsed yet (part of the head or of a chunk line)
        self._body: list[bytes] = []  # parsed body, not read yet
        self._body_size = 0
        self._mode = "head"  # head -> length | chunk_size | chunk_data | chunk_crlf | trailer | until_eof -> done
        self._remaining = 0
        self._reusable = False
        self._error: BaseException | None = None
        self._waiter: asyncio.Future | None = None
        self._paused = False
        self._sink: Callable[[bytes], bool] | None = None
        self._timer: asyncio.TimerHandle | None = loop.call_at(deadline, self._timed_out)
        self._idle_s: float | None = None  # set by limit_silence
        self._last_data = 0.0

    # --- reading (the caller's side) ---------------------------------------------------------

    def header(self, name: str, default: str = "") -> str:
        return self.headers.get(name, default)

    async def _wait(self) -> None:
        self._waiter = self._loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    async def head(self) -> None:
        while self._mode == "head":
            if self._error is not None:
                raise self._error
            await self._wait()

    async def readany(self) -> bytes:
        """The body bytes received since the last call; b"" once the answer has ended."""
        while not self._body:
            if self._mode == "done":
                return b""
            if self._error is not None:
                raise self._error
            await self._wait()
        body = self._body
        chunk = body[0] if len(body) == 1 else b"".join(body)
        self._body = []
        self._body_size = 0
        if self._paused and self._conn is not None and self._conn.transport is not None:
            self._paused = False
            self._conn.transport.resume_reading()
        return chunk

    def forward(self, sink: Callable[[bytes], bool]) -> None:
        """From now on each body piece goes to `sink` as it is parsed, in the connection's callback,
        with no coroutine step per piece. A sink that returns True pauses reading this answer
        (and wakes wait_end) until resume()."""
        self._sink = sink
        if self._body:
            held = b"".join(self._body)
            self._body = []
            self._body_size = 0
            self._deliver(held)

    async def wait_end(self) -> bool:
        """While forwarding: True once the answer has ended, False when the sink paused it.
        Raises what ended it otherwise (UpstreamError, asyncio.TimeoutError)."""
        while self._mode != "done":
            if self._error is not None:
                raise self._error
            if self._paused:
                return False
            await self._wait()
        return True

    def resume(self) -> None:
        if self._paused:
            self._paused = False
            if self._conn is not None and self._conn.transport is not None:
                self._conn.transport.resume_reading()

    async def read(self) -> bytes:
        """The whole body."""
        parts = []
        while chunk := await self.readany():
            parts.append(chunk)
        return b"".join(parts)

    def release(self) -> None:
        """Done with the answer: a fully read one leaves its connection for the next call."""
        self.close()

    def limit_silence(self, idle_s: float) -> None:
        """From now on the answer has no overall deadline: it fails with asyncio.TimeoutError once
        the instance sent nothing for idle_s (time paused for a slow client does not count)."""
        self._cancel_timer()
        if self._mode == "done" or self._error is not None:
            return
        self._idle_s = idle_s
        self._last_data = self._loop.time()
        self._timer = self._loop.call_at(self._last_data + idle_s, self._check_silence)

    def _check_silence(self) -> None:
        assert self._idle_s is not None
        now = self._loop.time()
        if self._paused:  # we stopped reading, not the instance sending
            self._last_data = now
        quiet_until = self._last_data + self._idle_s
        if now >= quiet_until:
            self._timer = None
            self.fail(asyncio.TimeoutError(f"the instance sent nothing for {self._idle_s:g} s"))
        else:
            self._timer = self._loop.call_at(quiet_until, self._check_silence)

    def _cancel_timer(self) -> None:
        timer, self._timer = self._timer, None
        if timer is not None:
            timer.cancel()

    def close(self) -> None:
        """Done with the answer; the connection is dropped unless the answer already ended cleanly."""
        self._cancel_timer()
        self._stop_connecting()
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.abort()
        if self._error is None and self._mode != "done":
            self._error = UpstreamError("the answer was closed before it ended")

    def fail(self, exc: BaseException) -> None:
        """End the answer with `exc`, which a reader waiting for it (or calling later) raises; the
        connection is dropped. Nothing happens to an answer that already ended."""
        if self._mode == "done" or self._error is not None:
            return
        self._error = exc
        self._cancel_timer()
        self._stop_connecting()
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.abort()
        self._wake()

    # --- connecting (when no kept-alive connection was idle) ----------------------------------

    def _stop_connecting(self) -> None:
        task, self._connecting = self._connecting, None
        if task is not None:
            task.cancel()

    def _connected(self, conn: "_Connection", request: bytes) -> None:
        self._connecting = None
        if self._error is not None:  # closed, failed or timed out while connecting
            conn.abort()
            return
        self._conn = conn
        conn.send(self, request)

    # --- parsing (the connection's side) -----------------------------------------------------

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _timed_out(self) -> None:
        self._timer = None
        self.fail(asyncio.TimeoutError())

    def feed(self, data: bytes) -> None:
        if self._idle_s is not None:
            self._last_data = self._loop.time()
        if self._pending:
            data = self._pending + data
        try:
            self._pending = self._parse(data)
        except UpstreamError as exc:
            self.fail(exc)
            return
        if self._sink is not None:  # one write per read from the socket, however many chunks it held
            if self._body:
                body = self._body
                self._body = []
                self._body_size = 0
                self._deliver(body[0] if len(body) == 1 else b"".join(body))
            if self._mode == "done":
                self._wake()
            return
        if self._body_size > _PAUSE_ABOVE and not self._paused and self._conn is not None:
            self._paused = True
            self._conn.transport.pause_reading()
        self._wake()

    def feed_eof(self) -> None:
        if self._mode == "until_eof":
            self._finish(reusable=False)
        elif self._mode != "done":
            self.fail(UpstreamError("the instance closed the connection before its answer ended"))

    def _finish(self, reusable: bool) -> None:
        self._mode = "done"
        self._cancel_timer()
        conn, self._conn = self._conn, None
        if conn is not None:
            if self._paused and conn.transport is not None:
                self._paused = False
                conn.transport.resume_reading()
            conn.answer_ended(reusable and self._reusable)
        self._wake()

    def _take_body(self, data: bytes, pos: int, end: int) -> None:
        self._body.append(data[pos:end] if pos or end < len(data) else data)
        self._body_size += end - pos

    def _deliver(self, piece: bytes) -> None:
        assert self._sink is not None
        if self._sink(piece) and not self._paused:
            self._paused = True
            if self._conn is not None and self._conn.transport is not None:
                self._conn.transport.pause_reading()
            self._wake()

    def _parse(self, data: bytes) -> bytes:
        """Consume what `data` holds; return the unparsed rest (an incomplete head or chunk line).

        Offsets into one bytes object, no buffer edits: an SSE event usually arrives as exactly
        one chunk, and this runs once per event."""
        pos, size = 0, len(data)
        while pos < size:
            mode = self._mode
            if mode == "chunk_size":
                end = data.find(_CRLF, pos)
                if end < 0:
                    if size - pos > 1024:
                        raise UpstreamError("chunk size line over 1 KiB")
                    return data[pos:]
                line = data[pos:end]
                try:
                    self._remaining = int(line.split(b";", 1)[0] if b";" in line else line, 16)
                except ValueError:
                    raise UpstreamError(f"bad chunk size line {line[:40]!r}") from None
                pos = end + 2
                self._mode = "chunk_data" if self._remaining else "trailer"
            elif mode == "chunk_data" or mode == "length":
                end = min(pos + self._remaining, size)
                self._take_body(data, pos, end)
                self._remaining -= end - pos
                pos = end
                if self._remaining:
                    return b""
                if mode == "length":
                    self._finish(reusable=pos == size)
                else:
                    self._mode = "chunk_crlf"
            elif mode == "chunk_crlf":
                if size - pos < 2:
                    return data[pos:]
                if data[pos:pos + 2] != _CRLF:
                    raise UpstreamError("chunk not followed by CRLF")
                pos += 2
                self._mode = "chunk_size"
            elif mode == "head":
                end = data.find(_HEAD_END, pos)
                if end < 0:
                    if size - pos > 65536:
                        raise UpstreamError("answer head over 64 KiB")
                    return data[pos:]
                head = data[pos:end]
                pos = end + 4
                self._parse_head(head, nothing_after=pos == size)
            elif mode == "trailer":
                end = data.find(_CRLF, pos)
                if end < 0:
                    return data[pos:]
                empty_line = end == pos
                pos = end + 2
                if empty_line:
                    self._finish(reusable=pos == size)
            elif mode == "until_eof":
                self._take_body(data, pos, size)
                return b""
            else:  # done: bytes after the answer's end; the connection was already handed back
                return b""
        return b""

    def _parse_head(self, head: bytes, nothing_after: bool) -> None:
        lines = head.split(_CRLF)
        status_line = lines[0].split(b" ", 2)
        if len(status_line) < 2 or not status_line[0].startswith(b"HTTP/1."):
            raise UpstreamError(f"not an HTTP/1.x answer: {lines[0][:60]!r}")
        try:
            status = int(status_line[1])
        except ValueError:
            raise UpstreamError(f"bad status line {lines[0][:60]!r}") from None
        if 100 <= status < 200:  # an interim answer: the real one follows
            return
        headers = {}
        for line in lines[1:]:
            name, sep, value = line.partition(b":")
            if sep:
                headers[name.strip().lower().decode("latin-1")] = value.strip().decode("latin-1")
        self.status, self.headers = status, headers
        connection = headers.get("connection", "").lower()
        self._reusable = status_line[0] == b"HTTP/1.1" and "close" not in connection
        if "chunked" in headers.get("transfer-encoding", "").lower():
            self._mode = "chunk_size"
        elif "content-length" in headers:
            try:
                self._remaining = int(headers["content-length"])
            except ValueError:
                raise UpstreamError(f"bad Content-Length {headers['content-length']!r}") from None
            self._mode = "length"
            if not self._remaining:
                self._finish(reusable=nothing_after)
        elif status in (204, 304):
            self._finish(reusable=nothing_after)
        else:
            self._mode = "until_eof"
            self._reusable = False


class _Connection(asyncio.Protocol):
    def __init__(self, client: "UpstreamClient", key: tuple[str, int]):
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
            if not conn.closed and now - conn.idle_since < self.keepalive_s and not conn.transport.is_closing():
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
