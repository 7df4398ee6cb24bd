"""D's push service: registers freshly allocated blocks with the prefill engine that will write
them, and turns P's DONE/FAIL, a lost connection or a timeout into one outcome per request.

`expect()` is called from the compute thread; connecting and sending happen on the reactor thread.
A WRITE that P streams (STREAMING, then LANDED per layer, then DONE) is handed out twice: as
started (`take`: vLLM may schedule the request now) and as its outcome; in between the
compute thread waits for each layer's bytes in `wait_landed`.
One connection per P rank this rank takes KV heads from (its side channel listens on the
instance's port + its rank), opened on first use with a small HELLO (who this rank is, a nonce);
this agent's NIXL metadata and KV layout (LAYOUT) go only to a P that proved the deployment's key
(auth.py). What is sent to a P while its connection is being made waits for it (the reactor
never blocks on a connect). A connection that dies fails every transfer pending on it at once.
A transfer from a prefill with another TP size has one part per source rank (fanin.py): vLLM
hears of it once, when every part is in; the first part to fail cancels the others.
Connections to a P rank are numbered (generations): a part takes P's word only from the one its
REGISTER went out on. A part failed while P may still write into its blocks stays fenced
(fences.py, arrivals.py) until that word, P's death, or the backstop (`_backstop`). A silent P is
given up on without closing its connection (`_give_up`).
"""
from __future__ import annotations

import errno
import logging
import time
from collections import Counter
from dataclasses import replace
from functools import partial

from kvpush.common.kv_params import PromptIdentity

from . import auth, wire
from .arrivals import Arrivals
from .channel import AUTH_DEADLINE_S, Connection, Reactor
from .consumer_config import ConsumerConfig
from .decode_auth import answer_challenge
from .expectation import Refused, expected_parts, prefill_sharding
from .fanin import RANK_SEPARATOR, base_name, rank_key, rank_of
from .kv_digest import DigestError
from .kv_digest_check import KvCheck
from .liveness import PeerLiveness
from .regions import HeadLayout, Region
from .state import ConsumerState, Outcome, Pending, counts_since

log = logging.getLogger(__name__)
__all__ = ["Consumer", "ConsumerConfig"]
# How the reactor (channel.py) names a connection P's side ended (its FIN, or a reset: a process that
# died with bytes unread). Only these prove P gone; one this side closed, or that failed otherwise
# (a timeout, a send error), proves nothing of what P still writes.
_CLOSED_BY_PEER = ("connection closed by peer", f"connection error: [Errno {errno.ECONNRESET}]")


class Consumer:
    def __init__(self, config: ConsumerConfig, agent_name: str, agent_metadata: bytes, regions: tuple[Region, ...],
                 device_id: int = 0):
        self.config = config
        head_layouts = config.head_layouts or tuple(HeadLayout.whole(r.block_len) for r in regions)
        self._hello = wire.Hello(config.engine_id, config.tp_rank, config.sharding.tp_size)
        # sent only once P proved the key (auth.py); D's proof covers its digest
        self._layout = wire.Layout(agent_name, agent_metadata, config.identity, regions, head_layouts, device_id)
        self._layout_digest = auth.digest(wire.encode(self._layout))
        self.counters: Counter = Counter()  # under the lock
        self._arrivals = Arrivals(ConsumerState(config.timeout_s, config.accepted_timeout_s), self._cancel_soon,
                                  len(regions), self.counters,
                                  KvCheck(config.verify_kv) if config.verify_kv is not None else None)
        self._lock = self._arrivals.lock
        self._state = self._arrivals.state  # under the lock
        self._parts = self._arrivals.parts  # under the lock
        self._liveness = PeerLiveness(
            silence_s=config.peer_silence_s, admission_s=config.admission_timeout_s
        )  # reactor thread only
        self._conns: dict[str, Connection] = {}
        self._connecting: dict[str, list[wire.Message]] = {}  # P engine -> what waits for its connection
        # open connection -> its number among its P rank's (reactor thread)
        self._generations: dict[Connection, int] = {}
        self._numbered: Counter = Counter()  # P rank -> connections made to it so far
        self._closed_here: set[Connection] = set()  # connections this side is closing (reactor thread)
        self._counted: Counter = Counter()  # what take_counts already handed out
        self._handshakes: dict[str, tuple[Connection, wire.Hello]] = {}  # P rank -> connection proving itself
        self._reactor = Reactor(f"kvpush-d-{config.engine_id}", self,
                                auth_deadline_s=AUTH_DEADLINE_S if config.side_channel_key else None)
        self._reactor.start()

    # ---- compute thread ----------------------------------------------------------------------
    def expect(self, req_id: str, transfer_id: str, peer_engine: str, host: str, port: int,
               block_ids: list[int], first_block: int, num_tokens: int, peer_tp_size: int = 1,
               prompt: PromptIdentity | None = None, refused: str = "") -> None:
        """Register these blocks with every rank of prefill `peer_engine` (TP `peer_tp_size`, side
        channel on `port` + rank) that holds KV heads of this rank; P writes only if its request's
        prompt is `prompt`. `refused`: the request's params were refused, its load fails at once."""
        now = time.monotonic()
        whole = Pending(transfer_id, req_id, peer_engine, tuple(block_ids), now)
        with self._lock:
            if refused:
                self._arrivals.add_whole(Outcome(whole, False, refused))
                return
            try:
                prefill = prefill_sharding(self.config, peer_engine, host, port, peer_tp_size)
            except Refused as refusal:
                self.counters[refusal.counter] += 1
                self._arrivals.add_whole(Outcome(whole, False, refusal.reason))
                return
            if transfer_id in self._parts:
                self._state.dropped["duplicate_registration"] += 1
                return
            check = self._arrivals.check
            try:
                parts = expected_parts(self.config, self._layout, prefill, transfer_id, len(block_ids),
                                       verify=check is not None)
            except DigestError as exc:
                self._arrivals.add_whole(Outcome(whole, False, str(exc)))
                return
            for part in parts:
                if check is not None and part.slices is not None:
                    check.expect(part.key, part.slices)
            self._parts.add(whole, [part.key for part in parts])
            for part in parts:
                self._state.add(Pending(part.key, req_id, rank_key(peer_engine, part.p_rank), tuple(block_ids), now,
                                        expected_bytes=part.expected_bytes))
            sources = [part.p_rank for part in parts]
        log.debug("kvpush D expect %s req=%s blocks=%d first=%d from ranks %s t=%.6f", transfer_id, req_id,
                  len(block_ids), first_block, sources, now)
        msg = wire.Register(transfer_id, tuple(block_ids), first_block, num_tokens,
                            prompt.tokens if prompt else -1, prompt.digest if prompt else "")
        for rank in sources:
            self._reactor.call_soon(partial(self._send, rank_key(peer_engine, rank), host, port + rank, msg))

    def cancel(self, transfer_id: str) -> bool:
        """D's request went away: ask P's ranks not to write (the outcome still arrives, or times
        out). False if the transfer has its outcome already."""
        with self._lock:
            running = [self._state.pending[k] for k in self._parts.running(transfer_id) if k in self._state.pending]
        for pending in running:
            self._reactor.call_soon(partial(self._send_existing, pending.peer_engine, wire.Cancel(transfer_id)))
        return bool(running)

    def take_outcomes(self) -> list[Outcome]:
        return self._arrivals.take_outcomes()

    def take(self) -> tuple[list[Pending], list[Outcome], list[str]]:
        """What arrived since the last call (arrivals.Arrivals.take): streamed WRITEs that began,
        outcomes, and transfers whose fenced blocks are free of writers now."""
        return self._arrivals.take()

    def take_counts(self) -> Counter:
        """Messages and requests dropped or refused since the last call, by reason."""
        with self._lock:
            return counts_since(self.counters + self._state.dropped, self._counted, frozenset({"landed_parts"}))

    def wait_for_outcome(self, timeout_s: float, even_if_none_pending: bool = False) -> None:
        """Sleep until an outcome (or a streamed WRITE's start, or a fence's end) is ready or
        `timeout_s` passes (arrivals.Arrivals.wait). For an engine step that computes nothing:
        vLLM would otherwise step again after 1 ms, and on CPU those idle steps take a whole core
        from whatever shares it."""
        self._arrivals.wait(timeout_s, even_if_none_pending)

    def wait_landed(self, transfer_ids: list[str], regions: tuple[int, ...], timeout_s: float) -> None:
        self._arrivals.wait_landed(transfer_ids, regions, timeout_s)

    def _cancel_soon(self, peer_engine: str, transfer_id: str) -> None:
        """Any thread: ask that P rank to stop writing this transfer."""
        self._reactor.call_soon(lambda: self._send_existing(peer_engine, wire.Cancel(transfer_id)))

    def close(self) -> None:
        self._reactor.stop()

    # ---- reactor thread --------------------------------------------------------------------------
    def _send(self, peer_engine: str, host: str, port: int, msg: wire.Message) -> None:
        conn = self._conns.get(peer_engine)
        if conn is not None and not conn.closed:
            self._write(peer_engine, conn, msg)
            return
        if peer_engine in self._connecting:
            self._connecting[peer_engine].append(msg)
            return
        self._connecting[peer_engine] = [msg]
        self._reactor.connect(host, port, self.config.connect_timeout_s,
                              lambda c, error: self._on_connected(peer_engine, f"{host}:{port}", c, error))

    def _on_connected(self, peer_engine: str, address: str, conn: Connection | None, error: str) -> None:
        if conn is None:
            self._connecting.pop(peer_engine, None)
            self._peer_failed(
                peer_engine, f"cannot reach prefill {_named(peer_engine)} side channel at {address}: {error}"
            )
            return
        conn.engine_id = peer_engine
        self._numbered[peer_engine] += 1
        self._generations[conn] = self._numbered[peer_engine]
        if not self.config.side_channel_key:
            conn.trust()
            conn.send(self._hello)
            conn.send(self._layout)
            self._established(peer_engine, conn)
            return
        hello = replace(self._hello, nonce=auth.new_nonce())
        self._handshakes[peer_engine] = (conn, hello)  # what waits for this P goes out once it proved the key
        conn.send(hello)

    def _on_challenge(self, conn: Connection, msg: wire.Challenge) -> None:
        peer_engine = conn.engine_id or ""
        conn_of, hello = self._handshakes.get(peer_engine, (None, None))
        if conn_of is not conn or hello is None:
            self.counters["unexpected_challenge"] += 1
            return
        answered = answer_challenge(self.config.side_channel_key, hello, msg, peer_engine, self.config.engine_id,
                                    self.config.tp_rank, self._layout_digest)
        if answered is None:
            self.counters["failed_auth"] += 1
            self._reactor.close(conn, f"the side channel at {conn.peer} failed to prove it is {_named(peer_engine)}")
            return  # on_closed fails what waited for it
        del self._handshakes[peer_engine]
        proof, keys = answered
        conn.trust(keys.opener("decode"))  # every frame of P's after its CHALLENGE carries its MAC
        conn.send(proof)
        conn.seal_sends(keys.sealer("decode"))  # ... and every frame of this side's after its AUTH
        conn.send(self._layout)  # what P makes a NIXL peer of, only to a P that proved the key
        self._established(peer_engine, conn)

    def _established(self, peer_engine: str, conn: Connection) -> None:
        """The connection speaks for this P rank now: send what waited for it."""
        self._conns[peer_engine] = conn
        self._liveness.proven(peer_engine, time.monotonic())
        for msg in self._connecting.pop(peer_engine, []):
            if not self._write(peer_engine, conn, msg):
                return

    def _write(self, peer_engine: str, conn: Connection, msg: wire.Message) -> bool:
        """Send on an established connection; a REGISTER only for a transfer still pending, and
        from then on that part takes P's word only from this connection. False if it broke."""
        if isinstance(msg, wire.Register):
            with self._lock:
                if not self._state.sent(
                    rank_key(msg.transfer_id, rank_of(peer_engine)), self._generations.get(conn, 0)
                ):
                    return True  # it ended before it went out: P must never learn these blocks
                sent = conn.send(msg)
        else:
            sent = conn.send(msg)
        if not sent:
            self._close_here(conn, "send failed")
        return sent

    def _close_here(self, conn: Connection, reason: str) -> None:
        """Close a connection from this side: not a sign of P's death, so what P may still write
        over it stays fenced."""
        self._closed_here.add(conn)
        self._reactor.close(conn, reason)

    def _send_existing(self, peer_engine: str, msg: wire.Message) -> None:
        """To a P this side has a connection to, or is connecting to; else dropped."""
        if peer_engine in self._connecting:
            self._connecting[peer_engine].append(msg)
            return
        conn = self._conns.get(peer_engine)
        if conn is not None:
            conn.send(msg)

    def _peer_failed(
        self, peer_engine: str, reason: str, may_still_land: bool = False, generation: int = 0
    ) -> list[Outcome]:
        """Every transfer pending on that P rank fails. `may_still_land`: P may be alive and
        writing (their parts are fenced); else connection `generation` proved P gone or refusing."""
        with self._lock:
            lost = self._state.peer_gone(peer_engine, reason, len(self._layout.regions), may_still_land, generation,
                                         time.monotonic())
            self._arrivals.add_parts(lost)
        failed = [o for o in lost if not o.ok]
        if failed:
            log.warning("kvpush: %d transfer(s) from %s failed: %s", len(failed), _named(peer_engine), reason)
        return failed

    def _give_up(self, peer_engine: str, reason: str) -> None:
        """P went silent. Its transfers fail now, but its connection stays, and each is cancelled:
        a P that resumes answers there (DONE, FAIL or, for a WRITE it had posted, QUIESCED once it
        ended), which ends their fences with evidence; closing would leave only the backstop."""
        conn = self._conns[peer_engine]
        failed = self._peer_failed(peer_engine, reason, may_still_land=True, generation=self._generations.get(conn, 0))
        self._liveness.forget(peer_engine)  # a transfer registered from now on waits a whole silence bound again
        for o in failed:
            self._send_existing(peer_engine, wire.Cancel(base_name(o.pending.transfer_id)))

    def _backstop(self, now: float) -> None:
        """Fences older than late_write_hold_s: drop the connection they came on, then let the
        blocks go. In that order: the close (this thread's own socket close, so the FIN is on its
        way before anything else happens here) is what a resumed P checks right before each post;
        blocks handed back first could be another request's while P still finds the connection
        open. The one way blocks come back without evidence: counted and logged."""
        with self._lock:
            overdue = self._state.fences.overdue(now, self.config.late_write_hold_s)
        for (peer_engine, generation), _ in overdue.items():
            conn = self._conns.get(peer_engine)
            live = conn is not None and self._generations.get(conn) == generation
            if conn is not None and live:
                self._close_here(
                    conn, f"no word from prefill on its late WRITEs within {self.config.late_write_hold_s:g} s"
                )
            log.warning("kvpush: prefill %s neither said its WRITEs into given-up blocks ended nor went away within "
                        "late_write_hold_s (%g s); %s and released the blocks", _named(peer_engine),
                        self.config.late_write_hold_s, "dropped its connection" if live else "its connection was gone")
        if overdue:
            with self._lock:
                released = self._state.fences.end_by_backstop([f for fences in overdue.values() for f in fences])
                self.counters["late_write_backstop"] += released
                self._arrivals.collect_unfenced()

    def _busy_peers(self) -> set[str]:
        """P engines with a transfer pending and a connection to ask them on (lock held)."""
        return {p.peer_engine for p in self._state.pending.values() if p.peer_engine in self._conns}

    def timeout(self) -> float | None:
        with self._lock:
            deadlines = [d for d in (self._state.next_deadline(), self._liveness.next_deadline(self._busy_peers()),
                                     self._state.fences.next_deadline(self.config.late_write_hold_s)) if d is not None]
        return None if not deadlines else max(0.0, min(deadlines) - time.monotonic())

    def on_tick(self) -> None:
        now = time.monotonic()
        with self._lock:
            late = self._state.expire(now)
            self._arrivals.add_parts(late)
            busy = self._busy_peers()
            to_ping, silent = self._liveness.due(busy, now)
            unadmitted = self._liveness.unadmitted(busy, now)
        for engine_id in unadmitted:
            self._close_here(self._conns[engine_id], f"prefill did not admit this decode rank within "
                                                     f"{self.config.admission_timeout_s:g} s of proving its key")
        for engine_id in silent:
            if engine_id in self._conns:
                self._give_up(engine_id, f"side channel to prefill {_named(engine_id)}: no answer for "
                                         f"{self._liveness.silence_s:g} s; prefill is dead or hung")
        self._backstop(now)
        for engine_id in to_ping:
            self._send_existing(engine_id, wire.Ping())
        for o in late:
            log.warning(
                "kvpush: transfer %s (request %s) failed: %s", o.pending.transfer_id, o.pending.req_id, o.reason
            )
        for o in late:  # let P free its side if it is still holding it
            self._send_existing(o.pending.peer_engine, wire.Cancel(base_name(o.pending.transfer_id)))

    def on_malformed(self, conn: Connection, error: str, kind: str) -> None:
        self.counters[kind] += 1
        log.warning("kvpush: dropped malformed message from %s: %s", conn.peer, error)

    def on_closed(self, conn: Connection, reason: str) -> None:
        generation = self._generations.pop(conn, 0)
        by_peer = conn not in self._closed_here and reason.startswith(_CLOSED_BY_PEER)  # P's process is gone
        self._closed_here.discard(conn)
        if conn.engine_id is not None and self._handshakes.get(conn.engine_id, (None,))[0] is conn:
            del self._handshakes[conn.engine_id]
            self._connecting.pop(conn.engine_id, None)
            self._peer_failed(conn.engine_id, f"side channel to prefill {_named(conn.engine_id)} closed during its "
                                              f"handshake ({reason})")
            return
        if conn.engine_id is not None and self._conns.get(conn.engine_id) is conn:
            del self._conns[conn.engine_id]
            self._liveness.forget(conn.engine_id)
            self._peer_failed(conn.engine_id, f"side channel to prefill {_named(conn.engine_id)} lost ({reason})",
                              may_still_land=not by_peer, generation=generation)

    def on_message(self, conn: Connection, msg: wire.Message) -> None:
        now = time.monotonic()
        peer_key = conn.engine_id or ""
        if isinstance(msg, wire.Challenge):
            self._on_challenge(conn, msg)
            return
        if not conn.authenticated and not isinstance(msg, wire.Refuse):
            self.counters["before_handshake"] += 1
            return
        self._liveness.heard(peer_key)
        if isinstance(msg, wire.Pong):
            return
        if isinstance(msg, wire.Welcome):
            if msg.engine_id != base_name(peer_key):
                self._close_here(conn, f"peer says it is {msg.engine_id!r}")
            else:
                self._liveness.admitted(peer_key)
            return
        if isinstance(msg, wire.Refuse):
            log.error("kvpush: prefill %s refused the handshake: %s", _named(peer_key), msg.reason)
            self._peer_failed(peer_key, f"handshake refused by {_named(peer_key)}: {msg.reason}")
            return
        if not isinstance(msg, (wire.Accepted, wire.Streaming, wire.Landed, wire.Done, wire.Fail, wire.Quiesced)):
            self.counters["unexpected"] += 1
            return
        key = rank_key(msg.transfer_id, rank_of(peer_key))
        outcome = self._arrivals.on_message(msg, key, peer_key, self._generations.get(conn, 0), now)
        if outcome is not None:
            log.debug("kvpush D outcome %s req=%s ok=%s bytes=%d since_register=%.6f t=%.6f", key,
                      outcome.pending.req_id, outcome.ok, outcome.num_bytes, now - outcome.pending.created, now)
            if not outcome.ok:
                log.warning("kvpush: transfer %s (request %s) from %s failed: %s", msg.transfer_id,
                            outcome.pending.req_id, _named(peer_key), outcome.reason)


def _named(peer_key: str) -> str:
    """A prefill rank as a user reads it: engine id and rank."""
    return f"{base_name(peer_key)} rank {rank_of(peer_key)}" if RANK_SEPARATOR in peer_key else peer_key
