"""P's side channel as its reactor thread serves it: reads and checks D's frames, answers PING and
the handshake's proofs at once, and hands everything else to the producer's transfer thread
(transfer_thread.py) in the order it came. It reaches the producer only through that queue: the
reactor never calls NIXL and never takes the producer's lock, so however long the compute thread
holds that lock, or a NIXL call blocks, D's pings are answered.
"""
from __future__ import annotations

import time
from collections import Counter
from typing import Callable

from . import wire
from .admission import Admission, Handshake, ThrottledWarnings
from .channel import Connection, Reactor
from .transfer import NixlEngine
from .transfer_thread import TransferThread

# on the transfer thread: (conn, REGISTER or CANCEL, arrival time), (conn, why it closed),
# (conn, its handshake, its LAYOUT)
OnTransferMessage = Callable[[Connection, "wire.Register | wire.Cancel", float], None]
OnClosed = Callable[[Connection, str], None]
OnLayout = Callable[[Connection, Handshake, wire.Layout], None]


class ProducerChannel:
    """The reactor's handler (channel.Handler) on P's side."""

    def __init__(self, config, engine: NixlEngine, jobs: TransferThread, count: Callable[[str], None],
                 warnings: ThrottledWarnings, on_transfer_message: OnTransferMessage, on_closed: OnClosed,
                 on_layout: OnLayout):
        self.side_counts: Counter = Counter()  # written on the reactor thread only; read as a copy
        self._jobs = jobs
        self._warnings = warnings
        self._on_transfer_message = on_transfer_message
        self._on_closed = on_closed
        self._on_layout = on_layout
        self.reactor = Reactor(f"kvpush-p-{config.engine_id}", self, max_connections=config.max_connections,
                               auth_deadline_s=config.auth_deadline_s if config.side_channel_key else None)
        self.admission = Admission(config, engine, self.side_counts, count, warnings, self.reactor.close)

    def timeout(self) -> float | None:
        return None  # the reactor's own deadlines only: the transfer thread keeps the producer's

    def on_tick(self) -> None:
        pass

    def on_malformed(self, conn: Connection, error: str, kind: str) -> None:
        self.side_counts[kind] += 1
        self._warnings.warn(kind, "kvpush: refused a side-channel frame from %s (%s): %s", conn.peer, kind, error)

    def on_closed(self, conn: Connection, reason: str) -> None:
        if conn.authenticated:  # else nothing of it reached the transfer thread
            self._jobs.submit(lambda: self._on_closed(conn, reason))

    def on_message(self, conn: Connection, msg: wire.Message) -> None:
        if not conn.authenticated:
            self.admission.before_proof(conn, msg)
        elif isinstance(msg, wire.Ping):
            conn.send(wire.Pong())
        elif isinstance(msg, (wire.Register, wire.Cancel)):
            now = time.monotonic()
            self._jobs.submit(lambda: self._on_transfer_message(conn, msg, now))
        elif isinstance(msg, wire.Layout):
            handshake = self.admission.take_layout(conn)
            if handshake is not None:
                self._jobs.submit(lambda: self._on_layout(conn, handshake, msg))
        elif isinstance(msg, wire.Hello):
            self.side_counts["repeated_hello"] += 1
        elif isinstance(msg, wire.Auth):
            self.side_counts["unexpected_auth"] += 1
        else:
            self.side_counts["unexpected"] += 1
