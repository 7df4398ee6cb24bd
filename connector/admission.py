"""Which decode ranks prefill lets in: a connection must prove the deployment's key (auth.py)
before its HELLO is read at all, and the HELLO must then name an allowed engine whose KV layout
pairs with this rank's. What comes out is the NIXL peer and the segments to write, handed to
the producer; every refusal is counted and logged at most once per WARN_EVERY_S per kind.

Runs on the producer's reactor thread; touches no producer state.
"""
from __future__ import annotations

import logging
import time
from collections import Counter
from typing import Callable

from . import auth, wire
from .channel import Connection
from .coalesce import CoalesceError, Plan, slice_segments
from .regions import HeadLayout
from .sharding import HeadSharding, ShardingError, pieces_for_prefill
from .transfer import NixlEngine, Peer, TransferError

log = logging.getLogger(__name__)
WARN_EVERY_S = 10.0  # refusals of one kind are logged at most this often (all are counted)

# (the connection, the decode rank's HELLO, its NIXL peer, the pairing of regions)
Admit = Callable[[Connection, wire.Hello, Peer, Plan], None]


class ThrottledWarnings:
    """At most one warning per kind per WARN_EVERY_S: a flood of bad peers is counted, not logged."""

    def __init__(self) -> None:
        self._last: dict[str, float] = {}

    def warn(self, kind: str, message: str, *args: object) -> None:
        now = time.monotonic()
        if now - self._last.get(kind, float("-inf")) >= WARN_EVERY_S:
            self._last[kind] = now
            log.warning(message + " (further ones within %g s are only counted)", *args, WARN_EVERY_S)


class Admission:
    """The producer's handshake: HELLO -> CHALLENGE -> AUTH -> WELCOME (or REFUSE)."""

    def __init__(self, config, engine: NixlEngine, counters: Counter, warnings: ThrottledWarnings,
                 close: Callable[[Connection, str], None], admit: Admit):
        self.config = config  # a ProducerConfig
        self.engine = engine
        self.counters = counters
        self.warnings = warnings
        self._close = close
        self._admit = admit

    def on_hello(self, conn: Connection, hello: wire.Hello) -> None:
        """A decode rank says who it is: prove the key to it and ask it to prove the key too."""
        if conn.engine_id is not None or conn.auth_state is not None:  # this connection already spoke
            self.counters["repeated_hello"] += 1
            return
        key = self.config.side_channel_key
        if not key:
            conn.trust()
            self._check_and_admit(conn, hello)
            return
        if not hello.nonce:
            self._refuse(conn, hello, "the HELLO carries no nonce: this prefill authenticates its side channel with the "
                                      "deployment's key (secret_file in kv_connector_extra_config, written by `kvpush up`)",
                         "failed_auth")
            return
        nonce, hello_digest = auth.new_nonce(), auth.digest(wire.encode(hello))
        conn.auth_state = (hello, nonce, hello_digest)
        conn.send(wire.Challenge(self.config.engine_id, self.config.tp_rank, nonce,
                                 auth.prove(key, "prefill", hello.nonce, nonce, self.config.engine_id,
                                            self.config.tp_rank, hello_digest)))

    def on_auth(self, conn: Connection, msg: wire.Auth) -> None:
        if conn.auth_state is None or conn.authenticated:
            self.counters["unexpected_auth"] += 1
            return
        hello, nonce, hello_digest = conn.auth_state
        conn.auth_state = None
        if not auth.verify(self.config.side_channel_key, msg.proof, "decode", hello.nonce, nonce, hello.engine_id,
                           hello.tp_rank, hello_digest):
            self.counters["failed_auth"] += 1
            self._close(conn, "failed authentication")  # an established peer is never displaced
            self.warnings.warn("failed_auth", "kvpush: a side-channel peer at %s failed authentication as %s rank %d; dropped",
                               conn.peer, hello.engine_id, hello.tp_rank)
            return
        conn.trust()
        self._check_and_admit(conn, hello)

    def _check_and_admit(self, conn: Connection, hello: wire.Hello) -> None:
        reason, plan = self.check_hello(hello)
        if plan is not None:
            try:
                peer = self.engine.add_peer(hello.agent_metadata, hello.regions, hello.device_id, plan.segments)
            except TransferError as exc:
                reason = str(exc)
        if reason is not None:
            self._refuse(conn, hello, reason)
            return
        self._admit(conn, hello, peer, plan)

    def _refuse(self, conn: Connection, hello: wire.Hello, reason: str, counter: str = "refused_handshake") -> None:
        self.counters[counter] += 1
        self.warnings.warn(counter, "kvpush: refused handshake from %s rank %d (%s): %s", hello.engine_id, hello.tp_rank,
                           conn.peer, reason)
        conn.send(wire.Refuse(self.config.engine_id, reason))
        self._close(conn, "handshake refused")

    def check_hello(self, hello: wire.Hello) -> tuple[str | None, Plan | None]:
        """Why this decode rank cannot be written into (None if it can), else how: the pairing of
        this rank's heads with the decode rank's, region by region."""
        cfg = self.config
        if hello.engine_id not in cfg.allowed_engines:
            return f"engine {hello.engine_id!r} is not in this prefill's allowed_engines {sorted(cfg.allowed_engines)}", None
        diffs = cfg.identity.mismatches(hello.identity)
        if diffs:
            return f"KV layout of prefill {cfg.engine_id} vs decode {hello.engine_id} differs: " + "; ".join(diffs), None
        try:
            decode = HeadSharding(cfg.sharding.total_heads, hello.tp_size)
        except ShardingError as exc:
            return f"decode {hello.engine_id}: {exc}", None
        pieces = [p for p in pieces_for_prefill(cfg.tp_rank, cfg.sharding, decode) if p.d_rank == hello.tp_rank]
        if not pieces:
            return (f"decode rank {hello.tp_rank} (TP {hello.tp_size}) takes no KV heads from prefill rank {cfg.tp_rank} "
                    f"(TP {cfg.sharding.tp_size}, {cfg.sharding.total_heads} KV heads) but reached its side channel"), None
        piece = pieces[0]
        local_heads = cfg.head_layouts or tuple(HeadLayout.whole(r.block_len) for r in self.engine.regions)
        try:
            segments = slice_segments(
                self.engine.regions, local_heads, piece.start - cfg.sharding.heads_of(cfg.tp_rank).start,
                hello.regions, hello.head_layouts, piece.start - decode.heads_of(hello.tp_rank).start, piece.num_heads)
        except CoalesceError as exc:
            return f"KV blocks of prefill {cfg.engine_id} rank {cfg.tp_rank} and decode {hello.engine_id} rank {hello.tp_rank} do not pair: {exc}", None
        return None, Plan(segments, self.engine.device_id, hello.device_id)
