"""A man in the middle of the side channel, for tests: a TCP proxy between decode and prefill that
forwards each frame whole, keeps a copy of every frame it forwarded, and puts frames of its own
into a live connection between two real ones, in either direction."""
from __future__ import annotations

import contextlib
import socket
import threading

from kvpush.connector import wire

TO_PREFILL, TO_DECODE = "to_prefill", "to_decode"


class Session:
    """One decode connection through the proxy, and its prefill connection."""

    def __init__(self, decode: socket.socket, prefill: socket.socket):
        self.socks = {TO_PREFILL: prefill, TO_DECODE: decode}
        self.frames: dict[str, list[bytes]] = {TO_PREFILL: [], TO_DECODE: []}  # as forwarded, with their prefix
        self._locks = {TO_PREFILL: threading.Lock(), TO_DECODE: threading.Lock()}
        self.closed = threading.Event()

    def inject(self, direction: str, data: bytes) -> None:
        """Send `data` on as if the other side had sent it, between two of that side's frames."""
        with self._locks[direction]:
            self.socks[direction].sendall(data)

    def forward(self, source: socket.socket, direction: str) -> None:
        reader = wire.FrameReader(max_frame=1 << 30)
        try:
            while data := source.recv(1 << 16):
                reader.add(data)
                while (frame := reader.next_frame()) is not None:
                    whole = wire.LENGTH.pack(len(frame)) + frame
                    with self._locks[direction]:
                        self.frames[direction].append(whole)
                        self.socks[direction].sendall(whole)
        except OSError:
            pass
        self.close()

    def close(self) -> None:
        for sock in self.socks.values():
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        self.closed.set()


class MitmProxy:
    def __init__(self, prefill_port: int):
        self._prefill_port = prefill_port
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port = self._server.getsockname()[1]
        self.sessions: list[Session] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                decode, _ = self._server.accept()
            except OSError:
                return
            prefill = socket.create_connection(("127.0.0.1", self._prefill_port))
            for sock in (decode, prefill):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            session = Session(decode, prefill)
            self.sessions.append(session)
            threading.Thread(target=session.forward, args=(decode, TO_PREFILL), daemon=True).start()
            threading.Thread(target=session.forward, args=(prefill, TO_DECODE), daemon=True).start()

    def close(self) -> None:
        self._server.close()
        for session in self.sessions:
            session.close()
            for sock in session.socks.values():
                sock.close()
