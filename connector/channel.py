"""The side channel: TCP connections carrying wire frames, served by one reactor thread.

The thread sleeps in select() until a socket is readable, another thread wakes it, or the owner's
next deadline comes (`timeout()`); it never spins. Callbacks run on the reactor thread.
"""
from __future__ import annotations

import logging
import select
import selectors
import socket
import threading
import time
from typing import Callable, Protocol

from . import wire

log = logging.getLogger(__name__)
_SELECT_RESOLUTION_S = 0.001


class Handler(Protocol):
    def on_message(self, conn: "Connection", msg: wire.Message) -> None: ...
    def on_closed(self, conn: "Connection", reason: str) -> None: ...
    def on_tick(self) -> None: ...
    def timeout(self) -> float | None: ...
    def on_malformed(self, conn: "Connection", error: str) -> None: ...


class Connection:
    def __init__(self, sock: socket.socket, peer: str):
        self.sock = sock
        self.peer = peer  # "host:port", for messages
        self.engine_id: str | None = None  # set once the peer's identity is established
        self.closed = False
        self._reader = wire.FrameReader()
        self._send_lock = threading.Lock()

    def gone(self) -> bool:
        """Closed here, or closed by the peer: asks the kernel, so a thread other than the reactor
        learns of a FIN or reset that the reactor has not read yet (e.g. when the whole process
        was stalled and both threads resume together)."""
        if self.closed:
            return True
        poller = select.poll()
        try:
            poller.register(self.sock, select.POLLRDHUP | select.POLLHUP | select.POLLERR)
        except (ValueError, OSError):  # the reactor closed the socket meanwhile
            return True
        return bool(poller.poll(0))

    def send(self, msg: wire.Message) -> bool:
        """Send one message; False if the connection is gone (the reactor reports the close)."""
        data = wire.encode(msg)
        with self._send_lock:
            if self.closed:
                return False
            try:
                self.sock.sendall(data)
                return True
            except OSError:
                return False


class Reactor:
    def __init__(self, name: str, handler: Handler):
        self.handler = handler
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        self._calls: list[Callable[[], None]] = []
        self._calls_lock = threading.Lock()
        self._stop = False
        self._listener: socket.socket | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def listen(self, host: str, port: int) -> int:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(64)
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
            except OSError as exc:
                error = str(exc) or type(exc).__name__
                self.call_soon(lambda: on_done(None, error))
                return
            sock.settimeout(None)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.call_soon(lambda: self._connected(Connection(sock, f"{host}:{port}"), on_done))

        threading.Thread(target=attempt, name=f"{self._thread.name}-connect", daemon=True).start()

    def _connected(self, conn: Connection, on_done: Callable[[Connection | None, str], None]) -> None:
        if self._stop:
            conn.sock.close()
            return
        self._add(conn)
        on_done(conn, "")

    def _add(self, conn: Connection) -> None:
        self._sel.register(conn.sock, selectors.EVENT_READ, conn)

    def call_soon(self, fn: Callable[[], None]) -> None:
        """Run fn on the reactor thread (thread-safe)."""
        with self._calls_lock:
            self._calls.append(fn)
        self.wake()

    def wake(self) -> None:
        try:
            self._wake_w.send(b"x")
        except (BlockingIOError, OSError):
            pass  # a wake is already pending, or we are shutting down

    def close(self, conn: Connection, reason: str) -> None:
        """Close a connection (reactor thread); the handler hears on_closed once."""
        if conn.closed:
            return
        with conn._send_lock:
            conn.closed = True
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
                events = self._wait(self.handler.timeout())
            except Exception:
                log.exception("side channel select failed")
                continue
            for key, _ in events:
                try:
                    self._dispatch(key)
                except Exception:
                    log.exception("side channel handler failed")
            self._run_calls()
            try:
                self.handler.on_tick()
            except Exception:
                log.exception("side channel tick failed")
        for key in list(self._sel.get_map().values()):
            if isinstance(key.data, Connection):
                key.data.closed = True
            key.fileobj.close()

    def _run_calls(self) -> None:
        with self._calls_lock:
            calls, self._calls = self._calls, []
        for fn in calls:
            try:
                fn()
            except Exception:
                log.exception("side channel call failed")

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

    def _dispatch(self, key: selectors.SelectorKey) -> None:
        if key.data is None:
            try:
                while self._wake_r.recv(4096):
                    pass
            except BlockingIOError:
                pass
            return
        if key.data == "listen":
            sock, addr = key.fileobj.accept()
            sock.setblocking(True)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._add(Connection(sock, f"{addr[0]}:{addr[1]}"))
            return
        conn: Connection = key.data
        try:
            data = conn.sock.recv(1 << 20)
        except OSError as exc:
            self.close(conn, f"connection error: {exc}")
            return
        if not data:
            self.close(conn, "connection closed by peer")
            return
        try:
            frames = conn._reader.feed(data)
        except wire.WireError as exc:
            self.handler.on_malformed(conn, str(exc))
            self.close(conn, f"unframeable data: {exc}")
            return
        for frame in frames:
            try:
                msg = wire.decode(frame)
            except wire.WireError as exc:
                self.handler.on_malformed(conn, str(exc))
                continue
            try:
                self.handler.on_message(conn, msg)
            except Exception:  # one message's bug must not drop the frames behind it
                log.exception("side channel: handling %s from %s failed", type(msg).__name__, conn.peer)
            if conn.closed:
                return
