"""Which decode ranks prefill lets in, in two halves on two threads.

On the reactor thread, `before_proof` takes a connection's first frames, all small: HELLO (who D
says it is, its nonce), then AUTH (D's proof of the deployment's key, auth.py). Anything else, a
second HELLO, a proof nobody asked for or a wrong one closes the connection; nothing of D's layout
is read before the proof. Once D is proven, its LAYOUT (NIXL metadata, KV regions) is handed to
the producer's transfer thread, where `pair` checks that it is the LAYOUT D's proof covers, names
an allowed engine and pairs with this rank's KV layout, and makes D a NIXL peer. What comes out is
that peer and the segments to write, handed to the producer; every refusal is counted and logged
at most once per WARN_EVERY_S per kind.

Touches no producer state and takes no lock.
"""
from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass
from typing import Callable

from . import auth, frame_mac, wire
from .channel import Connection
from .coalesce import CoalesceError, Plan, slice_segments
from .regions import HeadLayout
from .sharding import HeadSharding, ShardingError, pieces_for_prefill
from .transfer import NixlEngine, Peer, TransferError

log = logging.getLogger(__name__)
WARN_EVERY_S = 10.0  # refusals of one kind are logged at most this often (all are counted)


class ThrottledWarnings:
    """At most one warning per kind per WARN_EVERY_S: a flood of bad peers is counted, not logged."""

    def __init__(self, logger: logging.Logger = log) -> None:
        self._last: dict[str, float] = {}
        self._log = logger  # the module whose refusals these are

    def warn(self, kind: str, message: str, *args: object) -> None:
        now = time.monotonic()
        if now - self._last.get(kind, float("-inf")) >= WARN_EVERY_S:
            self._last[kind] = now
            self._log.warning(message + " (further ones within %g s are only counted)", *args, WARN_EVERY_S)


@dataclass
class Handshake:
    """One connection's handshake as far as it got (the reactor thread's, in `conn.auth_state`)."""

    hello: wire.Hello
    nonce: str = ""  # P's challenge to D, once sent
    hello_digest: str = ""
    layout_digest: str = ""  # what D's proof says its LAYOUT hashes to
    layout_taken: bool = False  # its LAYOUT went to the transfer thread (once per connection)
    proven_at: float = 0.0  # monotonic time D proved the key (or sent HELLO, unauthenticated)


@dataclass(frozen=True)
class Pairing:
    """A proven decode rank that pairs with this rank: its NIXL peer and the segments to write."""

    hello: wire.Hello
    layout: wire.Layout
    peer: Peer
    plan: Plan
    proven_at: float  # when D proved the key: admission's time runs from there (liveness.py's bound)


class Admission:
    """The producer's handshake: HELLO -> CHALLENGE -> AUTH -> LAYOUT -> WELCOME (or REFUSE).

    `side_counts` is counted into on the reactor thread only; `count` is called on the transfer
    thread (the producer counts under its lock)."""

    def __init__(self, config, engine: NixlEngine, side_counts: Counter, count: Callable[[str], None],
                 warnings: ThrottledWarnings, close: Callable[[Connection, str], None]):
        self.config = config  # a ProducerConfig
        self.engine = engine
        self.side_counts = side_counts
        self._count = count
        self.warnings = warnings
        self._close = close  # callable from any thread

    # ---- reactor thread --------------------------------------------------------------------------
    def before_proof(self, conn: Connection, msg: wire.Message) -> None:
        """A frame from a connection that has not proven the key: only the handshake's next step
        is taken; anything else closes the connection."""
        if isinstance(msg, wire.Hello) and conn.auth_state is None:
            self._on_hello(conn, msg)
        elif isinstance(msg, wire.Auth) and isinstance(conn.auth_state, Handshake) and conn.auth_state.nonce:
            self._on_auth(conn, msg, conn.auth_state)
        else:
            kind = {wire.Hello: "repeated_hello", wire.Auth: "unexpected_auth"}.get(type(msg), "before_handshake")
            self._drop(conn, kind, f"{type(msg).__name__.upper()} before the handshake's proof")

    def _on_hello(self, conn: Connection, hello: wire.Hello) -> None:
        key = self.config.side_channel_key
        conn.auth_state = Handshake(hello)
        if not key:
            conn.trust()  # an unauthenticated side channel (tests, benchmarks): the LAYOUT may come
            conn.auth_state.proven_at = time.monotonic()
            return
        if not hello.nonce:
            self.side_counts["failed_auth"] += 1
            self._refuse(
                conn,
                hello,
                "the HELLO carries no nonce: this prefill authenticates its side channel with the "
                "deployment's key (secret_file in kv_connector_extra_config, written by `kvpush up`)",
                "failed_auth",
            )
            return
        state = conn.auth_state
        state.nonce, state.hello_digest = auth.new_nonce(), auth.digest(wire.encode(hello))
        conn.send(wire.Challenge(self.config.engine_id, self.config.tp_rank, state.nonce,
                                 auth.prove(key, "prefill", hello.nonce, state.nonce, self.config.engine_id,
                                            self.config.tp_rank, state.hello_digest)))
        conn.seal_sends(frame_mac.session_keys(key, hello.nonce, state.nonce).sealer("prefill"))  # all after CHALLENGE

    def _on_auth(self, conn: Connection, msg: wire.Auth, state: Handshake) -> None:
        hello = state.hello
        if not auth.verify(self.config.side_channel_key, msg.proof, "decode", hello.nonce, state.nonce, hello.engine_id,
                           hello.tp_rank, state.hello_digest, msg.layout_digest):
            self.side_counts["failed_auth"] += 1
            self._close(conn, "failed authentication")  # an established peer is never displaced
            self.warnings.warn(
                "failed_auth",
                "kvpush: a side-channel peer at %s failed authentication as %s rank %d; dropped",
                conn.peer,
                hello.engine_id,
                hello.tp_rank,
            )
            return
        state.layout_digest, state.proven_at = msg.layout_digest, time.monotonic()
        conn.trust(frame_mac.session_keys(self.config.side_channel_key, hello.nonce, state.nonce).opener("prefill"))

    def take_layout(self, conn: Connection) -> Handshake | None:
        """A proven connection's LAYOUT: its handshake, to pair on the transfer thread; None (and
        counted) if this connection sent one before."""
        state = conn.auth_state
        if not isinstance(state, Handshake) or state.layout_taken:
            self.side_counts["repeated_layout"] += 1
            return None
        state.layout_taken = True
        return state

    def _drop(self, conn: Connection, kind: str, why: str) -> None:
        self.side_counts[kind] += 1
        self.warnings.warn(kind, "kvpush: closed the side-channel connection from %s: %s", conn.peer, why)
        self._close(conn, why)

    # ---- transfer thread ---------------------------------------------------------------------------
    def pair(self, conn: Connection, state: Handshake, layout: wire.Layout) -> Pairing | None:
        """Check a proven decode rank's LAYOUT and make it a NIXL peer; None if refused (D is told
        and the connection closed)."""
        hello = state.hello
        if self.config.side_channel_key and auth.digest(wire.encode(layout)) != state.layout_digest:
            self._count("failed_auth")
            self.warnings.warn(
                "failed_auth",
                "kvpush: the LAYOUT from %s (%s rank %d) is not the one its proof covers; dropped",
                conn.peer,
                hello.engine_id,
                hello.tp_rank,
            )
            self._close(conn, "LAYOUT does not match the proof")
            return None
        reason, plan = self.check(hello, layout)
        if plan is not None:
            try:
                peer = self.engine.add_peer(layout.agent_metadata, layout.regions, layout.device_id, plan.segments)
            except TransferError as exc:
                reason = str(exc)
        if reason is not None:
            self._count("refused_handshake")
            self._refuse(conn, hello, reason, "refused_handshake")
            return None
        assert plan is not None, "check() gives a plan wherever it gives no reason"
        return Pairing(hello, layout, peer, plan, state.proven_at)

    # ---- either ------------------------------------------------------------------------------------
    def _refuse(self, conn: Connection, hello: wire.Hello, reason: str, kind: str) -> None:
        self.warnings.warn(kind, "kvpush: refused handshake from %s rank %d (%s): %s", hello.engine_id, hello.tp_rank,
                           conn.peer, reason)
        conn.send(wire.Refuse(self.config.engine_id, reason))
        self._close(conn, "handshake refused")

    def check(self, hello: wire.Hello, layout: wire.Layout) -> tuple[str | None, Plan | None]:
        """Why this decode rank cannot be written into (None if it can), else how: the pairing of
        this rank's heads with the decode rank's, region by region. Pure."""
        cfg = self.config
        if hello.engine_id not in cfg.allowed_engines:
            return (
                f"engine {hello.engine_id!r} is not in this prefill's allowed_engines {sorted(cfg.allowed_engines)}",
                None,
            )
        diffs = cfg.identity.mismatches(layout.identity)
        if diffs:
            return f"KV layout of prefill {cfg.engine_id} vs decode {hello.engine_id} differs: " + "; ".join(
                diffs
            ), None
        try:
            decode = HeadSharding(cfg.sharding.total_heads, hello.tp_size)
        except ShardingError as exc:
            return f"decode {hello.engine_id}: {exc}", None
        pieces = [p for p in pieces_for_prefill(cfg.tp_rank, cfg.sharding, decode) if p.d_rank == hello.tp_rank]
        if not pieces:
            return (
                f"decode rank {hello.tp_rank} (TP {hello.tp_size}) takes no KV heads from prefill rank {cfg.tp_rank} "
                f"(TP {cfg.sharding.tp_size}, {cfg.sharding.total_heads} KV heads) but reached its side channel"
            ), None
        piece = pieces[0]
        local_heads = cfg.head_layouts or tuple(HeadLayout.whole(r.block_len) for r in self.engine.regions)
        try:
            segments = slice_segments(
                self.engine.regions,
                local_heads,
                piece.start - cfg.sharding.heads_of(cfg.tp_rank).start,
                layout.regions,
                layout.head_layouts,
                piece.start - decode.heads_of(hello.tp_rank).start,
                piece.num_heads,
            )
        except CoalesceError as exc:
            return (
                f"KV blocks of prefill {cfg.engine_id} rank {cfg.tp_rank} and decode {hello.engine_id} rank "
                f"{hello.tp_rank} do not pair: {exc}",
                None,
            )
        return None, Plan(segments, self.engine.device_id, layout.device_id)
