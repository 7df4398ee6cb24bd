"""The side channel's reactor: one thread serving every TCP connection (frame_connection.py) of a
listener and of the connections this side dials.

The thread sleeps in select() until a socket is readable or writable, another thread wakes it, or
the owner's next deadline comes (`timeout()`); it never spins. Callbacks run on the reactor thread.

Nothing here waits on a peer: sends are queued by the connection and written here as the peer
reads them. Every read is bounded: a frame by the connection's limit (a few KiB until the peer has
proven who it is, checked on the length prefix before the body is read), the number of connections
by the listener's cap, and an unauthenticated connection by a deadline. A connection whose frame is
over the limit or fails its MAC (frame_mac.py), or an unproven one whose frame is not a valid
message, is closed at once: nothing it sends after that is read.
"""
from __future__ import annotations

import logging
import os
import selectors
import socket
import threading
import time
from dataclasses import dataclass
from typing import Callable, Protocol

from . import wire
from .frame_connection import Connection
from .frame_mac import FrameMacError

log = logging.getLogger(__name__)
_SELECT_RESOLUTION_S = 0.001
MAX_CONNECTIONS = 256  # per listener, accepted connections not yet proven; proven peers are not counted
AUTH_DEADLINE_S = 5.0  # an accepted connection that has not proven who it is by then is closed
READ_BYTES = 1 << 20  # one recv from a proven peer
UNPROVEN_READ_BYTES = 2 * wire.MAX_UNAUTHENTICATED_FRAME_BYTES  # ... and from one not proven yet


class Handler(Protocol):
    def on_message(self, conn: Connection, msg: wire.Message) -> None: ...
    def on_closed(self, conn: Connection, reason: str) -> None: ...
    def on_tick(self) -> None: ...
    def timeout(self) -> float | None: ...
    def on_malformed(self, conn: Connection, error: str, kind: str) -> None:
        """A frame that is not a valid message (`kind` "malformed"), over the connection's limit
        ("oversized_frame") or without its MAC ("bad_frame_mac"), counted under `kind`."""


@dataclass(frozen=True)
class _Exit:
    fd: int
    on_exit: Callable[[], None]


class Reactor:
    def __init__(self, name: str, handler: Handler, max_connections: int = MAX_CONNECTIONS,
                 auth_deadline_s: float | None = AUTH_DEADLINE_S):
        self.handler = handler
        self.max_connections = max_connections
        self.auth_deadline_s = auth_deadline_s  # None: connections need not authenticate (tests, benchmarks)
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        self._calls: list[Callable[[], object]] = []
        self._calls_lock = threading.Lock()
        self._conns: set[Connection] = set()  # reactor thread only
        self._stop = False
        self._listener: socket.socket | None = None
        self.refused_connections = 0  # closed to stay under the cap (reactor thread writes, anyone may read)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def native_id(self) -> int | None:
        return self._thread.native_id

    def listen(self, host: str, port: int) -> int:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(MAX_CONNECTIONS)  # a flood that fills the accept queue would make a real decode's SYN wait 1 s
        sock.setblocking(False)
        self._listener = sock
        self.call_soon(lambda: self._sel.register(sock, selectors.EVENT_READ, "listen"))
        return sock.getsockname()[1]

    def connect(self, host: str, port: int, timeout_s: float,
                on_done: Callable[[Connection | None, str], None]) -> None:
        """Connect without blocking the reactor: a short-lived thread waits for the TCP handshake
        (up to `timeout_s` for an unreachable host), then `on_done(conn, "")` or
        `on_done(None, error)` runs on the reactor thread, with the connection already served."""
        def attempt() -> None:
            try:
                sock = socket.create_connection((host, port), timeout=timeout_s)
            except (OSError, ValueError, UnicodeError) as exc:  # ValueError/UnicodeError: a malformed host name
                error = str(exc) or type(exc).__name__
                self.call_soon(lambda: on_done(None, error))
                return
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.call_soon(lambda: self._connected(Connection(sock, f"{host}:{port}", self), on_done))

        threading.Thread(target=attempt, name=f"{self._thread.name}-connect", daemon=True).start()

    def _connected(self, conn: Connection, on_done: Callable[[Connection | None, str], None]) -> None:
        if self._stop:
            conn.sock.close()
            return
        self._add(conn)
        on_done(conn, "")

    def _add(self, conn: Connection) -> None:
        self._conns.add(conn)
        self._sel.register(conn.sock, selectors.EVENT_READ, conn)

    def call_soon(self, fn: Callable[[], object]) -> None:
        """Run fn on the reactor thread (thread-safe)."""
        with self._calls_lock:
            self._calls.append(fn)
        self.wake()

    def watch_exit(self, pidfd: int, on_exit: Callable[[], None]) -> None:
        """Run `on_exit` on the reactor thread once the process behind this pidfd has ended (the
        reactor owns the fd from now on)."""
        self.call_soon(lambda: self._sel.register(pidfd, selectors.EVENT_READ, _Exit(pidfd, on_exit)))

    def watch(self, conn: Connection) -> None:
        """A connection has bytes to write (any thread): the reactor writes them as the peer reads."""
        self.wake()

    def wake(self) -> None:
        try:
            self._wake_w.send(b"x")
        except (BlockingIOError, OSError):
            pass  # a wake is already pending, or we are shutting down

    def close(self, conn: Connection, reason: str) -> None:
        """Close a connection; the handler hears on_closed once, on the reactor thread. From
        another thread the close happens there, soon."""
        if threading.current_thread() is not self._thread and self._thread.is_alive():
            self.call_soon(lambda: self.close(conn, reason))
            return
        if conn.closed:
            return
        with conn._send_lock:
            conn.closed = True
        self._conns.discard(conn)
        try:
            self._sel.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.sock.close()
        self.handler.on_closed(conn, reason)

    def stop(self) -> None:
        self._stop = True
        self.wake()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=2)

    def _run(self) -> None:
        while not self._stop:
            try:
                events = self._wait(self._next_timeout())
            except Exception:
                log.exception("side channel select failed")
                continue
            for key, mask in events:
                try:
                    self._dispatch(key, mask)
                except Exception:
                    log.exception("side channel handler failed")
            self._run_calls()
            self._flush_all()
            self._expire_unauthenticated()
            try:
                self.handler.on_tick()
            except Exception:
                log.exception("side channel tick failed")
        for key in list(self._sel.get_map().values()):
            if isinstance(key.data, Connection):
                key.data.closed = True
            if isinstance(key.data, _Exit):
                os.close(key.data.fd)
            elif isinstance(key.fileobj, socket.socket):  # every other key is a socket
                key.fileobj.close()

    def _next_timeout(self) -> float | None:
        deadlines = []
        owner = self.handler.timeout()
        now = time.monotonic()
        if owner is not None:
            deadlines.append(now + owner)
        for conn in self._conns:
            stalled = conn.stalled_deadline()
            if stalled is not None:
                deadlines.append(stalled)
            if self.auth_deadline_s is not None and not conn.authenticated:
                deadlines.append(conn.accepted_at + self.auth_deadline_s)
        return None if not deadlines else max(0.0, min(deadlines) - now)

    def _run_calls(self) -> None:
        with self._calls_lock:
            calls, self._calls = self._calls, []
        for fn in calls:
            try:
                fn()
            except Exception:
                log.exception("side channel call failed")

    def _flush_all(self) -> None:
        now = time.monotonic()
        for conn in list(self._conns):
            if conn.closed:
                continue
            why = conn.flush(now) if (conn.wants_write() or conn.overflowed) else ""
            if why:
                self.close(conn, why)
                continue
            events = selectors.EVENT_READ | (selectors.EVENT_WRITE if conn.wants_write() else 0)
            try:
                if self._sel.get_key(conn.sock).events != events:
                    self._sel.modify(conn.sock, events, conn)
            except (KeyError, ValueError):
                pass

    def _expire_unauthenticated(self) -> None:
        if self.auth_deadline_s is None:
            return
        cutoff = time.monotonic() - self.auth_deadline_s
        for conn in [c for c in self._conns if not c.authenticated and c.accepted_at < cutoff]:
            self.close(conn, f"did not authenticate within {self.auth_deadline_s:g} s")

    def _wait(self, timeout: float | None) -> list:
        if timeout is None or timeout <= 0 or timeout >= _SELECT_RESOLUTION_S:
            return self._sel.select(timeout)
        # epoll and poll round a timeout up to whole milliseconds, which would make the producer's
        # 0.2 ms completion polling 1 ms; a short wait sleeps instead (a message waits that long at most)
        events = self._sel.select(0)
        if not events:
            time.sleep(timeout)
            events = self._sel.select(0)
        return events

    def _dispatch(self, key: selectors.SelectorKey, mask: int = selectors.EVENT_READ) -> None:
        if key.data is None:
            try:
                while self._wake_r.recv(4096):
                    pass
            except BlockingIOError:
                pass
            return
        if key.data == "listen":
            self._accept(key.fileobj)
            return
        if isinstance(key.data, _Exit):
            self._sel.unregister(key.fileobj)
            os.close(key.data.fd)
            key.data.on_exit()
            return
        conn: Connection = key.data
        if mask & selectors.EVENT_WRITE:
            why = conn.flush(time.monotonic())
            if why:
                self.close(conn, why)
                return
        if not mask & selectors.EVENT_READ:
            return
        try:
            data = conn.sock.recv(READ_BYTES if conn.authenticated else UNPROVEN_READ_BYTES)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self.close(conn, f"connection error: {exc}")
            return
        if not data:
            self.close(conn, "connection closed by peer")
            return
        conn.received(data)
        # Frame by frame: the frame that proves the peer raises the limit for the frames behind it
        # and makes them carry their MAC, and a frame over the limit is refused on its length
        # prefix, before its body is looked at.
        while not conn.closed:
            try:
                frame = conn.next_frame()
            except FrameMacError as exc:  # forged, replayed, reordered...: the connection is done
                self.handler.on_malformed(conn, str(exc), "bad_frame_mac")
                self.close(conn, f"frame failed its MAC: {exc}")
                return
            except wire.WireError as exc:
                self.handler.on_malformed(
                    conn, str(exc), "oversized_frame" if isinstance(exc, wire.FrameTooLarge) else "malformed"
                )
                self.close(conn, f"unframeable data: {exc}")
                return
            if frame is None:
                return
            try:
                msg = wire.decode(frame)
            except wire.WireError as exc:
                self.handler.on_malformed(conn, str(exc), "malformed")
                if not conn.authenticated:  # a stranger gets no second try
                    self.close(conn, f"malformed frame before authentication: {exc}")
                continue
            try:
                self.handler.on_message(conn, msg)
            except Exception:  # one message's bug must not drop the frames behind it
                log.exception("side channel: handling %s from %s failed", type(msg).__name__, conn.peer)

    def _accept(self, listener) -> None:
        try:
            sock, addr = listener.accept()
        except (BlockingIOError, InterruptedError, OSError):
            return
        unproven = [c for c in self._conns if not c.authenticated and c.accepted]
        if len(unproven) >= self.max_connections:
            # Make room by closing the oldest stranger rather than refusing the newcomer: a flood
            # that holds its connections open cannot keep a real peer out for the whole auth
            # deadline, and proven peers never count against the cap.
            self.refused_connections += 1
            self.close(min(unproven, key=lambda c: c.accepted_at), "too many connections that have not proven the key")
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn = Connection(sock, f"{addr[0]}:{addr[1]}", self)
        conn.accepted = True
        self._add(conn)
