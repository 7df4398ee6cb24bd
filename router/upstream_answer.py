"""One answer from an instance, as the router reads it: status and headers once the head has
arrived, then the body piece by piece, whole, or forwarded to a sink as it is parsed; bounded by a
deadline or, once streaming, by the instance's silence.
"""
from __future__ import annotations

import asyncio
from typing import Callable, Protocol

from .upstream_parse import AnswerParser, UpstreamError


class _Connection(Protocol):
    """What an answer uses of its connection (upstream_http.py's, which imports this module)."""

    transport: asyncio.Transport | None

    def send(self, response: UpstreamResponse, request: bytes) -> None: ...

    def answer_ended(self, reusable: bool) -> None: ...

    def abort(self) -> None: ...

_PAUSE_ABOVE = 1 << 18  # unread answer bytes above which the instance's socket stops being read


class UpstreamResponse(AnswerParser):
    """One answer: status and headers once the head arrived, then the body as it comes."""

    def __init__(self, connection: _Connection | None, loop: asyncio.AbstractEventLoop, deadline: float):
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

    @property
    def error(self) -> BaseException | None:
        """What ended the answer before it was whole (fail(), a timeout, the connection), if anything
        did; bytes received before it may still be unread."""
        return self._error

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

    def _connected(self, conn: _Connection, request: bytes) -> None:
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
        if self._body_size > _PAUSE_ABOVE and not self._paused and self._conn is not None and self._conn.transport:
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

    def _deliver(self, piece: bytes) -> None:
        assert self._sink is not None
        if self._sink(piece) and not self._paused:
            self._paused = True
            if self._conn is not None and self._conn.transport is not None:
                self._conn.transport.pause_reading()
            self._wake()
