"""One side-channel connection: its frames in (bounded, checked) and out (queued, never waiting).

A send only queues bytes (any thread may send, also under its own locks) and the reactor
(channel.py) writes them as the peer reads them; a peer that reads too little for too long is cut
off. A frame in is held to the connection's limit on its length prefix, before its body is read
(a few KiB until the peer has proven who it is). Once the handshake has given the connection its
session keys (frame_mac.py), every frame out is sealed and every frame in must open: one that
does not raises FrameMacError and the reactor closes the connection, reading nothing behind it.
"""
from __future__ import annotations

import select
import socket
import threading
import time
from typing import Protocol

from . import wire
from .frame_mac import FrameOpener, FrameSealer

MAX_QUEUED_BYTES = 8 * 1024 * 1024  # unsent bytes a peer may leave behind before it is cut off
SEND_STALL_S = 5.0  # ... or for how long it may read nothing at all while bytes wait for it


class Writer(Protocol):
    def watch(self, conn: Connection) -> None:
        """The connection has bytes to write: write them as the peer reads (channel.Reactor)."""


class Connection:
    def __init__(self, sock: socket.socket, peer: str, reactor: Writer | None = None):
        self.sock = sock
        self.peer = peer  # "host:port", for messages
        self.engine_id: str | None = None  # set once the peer's identity is established
        self.authenticated = False  # the peer proved it holds the deployment's key (see auth.py)
        self.auth_state: object = None  # the owner's handshake in progress (auth.py)
        self.closed = False
        self.accepted_at = time.monotonic()
        self.accepted = False  # came in through this side's listener (else this side dialled it)
        self._reader = wire.FrameReader(wire.MAX_UNAUTHENTICATED_FRAME_BYTES)
        self._opener: FrameOpener | None = None  # set: every frame in must carry its tag
        self._sealer: FrameSealer | None = None  # set: every frame out carries one (under the send lock)
        self._send_lock = threading.Lock()
        self._out = bytearray()
        self._stalled_since: float | None = None  # unsent bytes and no progress since
        self._reactor = reactor
        self.overflowed = ""  # why the connection must be closed (set by send, acted on by the reactor)
        sock.setblocking(False)

    def trust(self, opener: FrameOpener | None = None) -> None:
        """The peer is authenticated: its frames may be as large as any message may be, and from
        the next one on each must open with `opener` (None only on a side channel without a key)."""
        self.authenticated = True
        self._opener = opener
        self._reader.max_frame = wire.MAX_FRAME_BYTES

    def seal_sends(self, sealer: FrameSealer) -> None:
        """Every frame sent from now on carries a tag made with `sealer`."""
        with self._send_lock:
            self._sealer = sealer

    @property
    def sealed(self) -> bool:
        """Frames in must carry a tag (the handshake gave this connection its keys)."""
        return self._opener is not None

    def received(self, data: bytes) -> None:
        self._reader.add(data)

    def next_frame(self) -> bytes | None:
        """The next whole frame's message bytes (its tag checked and removed where the connection
        is sealed), or None until more bytes come. Raises FrameTooLarge on a length prefix over the
        limit and FrameMacError on a tag that does not match; either way the connection is done."""
        frame = self._reader.next_frame()
        if frame is None or self._opener is None:
            return frame
        return self._opener.open(frame)

    def gone(self) -> bool:
        """Closed here, or closed by the peer: asks the kernel, so a thread other than the reactor
        learns of a FIN or reset that the reactor has not read yet (e.g. when the whole process
        was stalled and both threads resume together)."""
        if self.closed or self.overflowed:
            return True
        poller = select.poll()
        try:
            poller.register(self.sock, select.POLLRDHUP | select.POLLHUP | select.POLLERR)
        except (ValueError, OSError):  # the reactor closed the socket meanwhile
            return True
        return bool(poller.poll(0))

    def send(self, msg: wire.Message) -> bool:
        """Queue one message (never waits on the peer); False if the connection is gone or the
        peer has left too much unread (the reactor closes it)."""
        data = wire.encode(msg)
        with self._send_lock:
            if self.closed or self.overflowed:
                return False
            # sealed under the lock: sequence numbers follow the order the frames go on the wire
            self._out += data if self._sealer is None else self._sealer.seal(data)
            self._flush_locked()
            if len(self._out) > MAX_QUEUED_BYTES:
                self.overflowed = f"peer left {len(self._out)} bytes unread"
            pending = bool(self._out) or bool(self.overflowed)
        if pending and self._reactor is not None:
            self._reactor.watch(self)
        return not self.overflowed

    def wants_write(self) -> bool:
        with self._send_lock:
            return bool(self._out)

    def flush(self, now: float) -> str:
        """Write what the socket takes (reactor thread); why to close the connection, or ""."""
        with self._send_lock:
            if self.overflowed:
                return self.overflowed
            before = len(self._out)
            try:
                self._flush_locked()
            except OSError as exc:
                return f"send failed: {exc}"
            if not self._out or len(self._out) < before:
                self._stalled_since = now if self._out else None
            elif self._stalled_since is None:
                self._stalled_since = now
            elif now - self._stalled_since > SEND_STALL_S:
                return f"peer read nothing for {SEND_STALL_S:g} s with {len(self._out)} bytes waiting"
            return ""

    def _flush_locked(self) -> None:
        while self._out:
            try:
                sent = self.sock.send(self._out)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                self.overflowed = self.overflowed or "send failed"
                return
            del self._out[:sent]

    def stalled_deadline(self) -> float | None:
        with self._send_lock:
            return None if self._stalled_since is None else self._stalled_since + SEND_STALL_S
