"""D's push service: registers freshly allocated blocks with the prefill engine that will write
them, and turns P's DONE/FAIL, a lost connection or a timeout into one outcome per request.

`expect()` is called from the compute thread; connecting and sending happen on the reactor thread.
A WRITE that P streams (STREAMING, then LANDED per layer, then DONE) is handed out twice: as
started (`take`: vLLM may schedule the request now) and as its outcome; in between the
compute thread waits for each layer's bytes in `wait_landed`.
One connection per P engine, opened on first use with a HELLO carrying this agent's NIXL metadata
and KV layout; what is sent to a P while its connection is being made waits for it (the reactor
never blocks on a connect). A connection that dies fails every transfer pending on it at once.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass

from . import wire
from .channel import Connection, Reactor
from .liveness import DEFAULT_SILENCE_S, PeerLiveness
from .state import ConsumerState, Outcome, Pending, counts_since

log = logging.getLogger(__name__)


@dataclass
class ConsumerConfig:
    engine_id: str
    tp_rank: int
    identity: wire.LayoutIdentity
    allowed_engines: frozenset[str]
    timeout_s: float = 5.0
    connect_timeout_s: float = 1.0
    peer_silence_s: float = DEFAULT_SILENCE_S  # a P waited on that answers no ping this long is gone
    accepted_timeout_s: float = 300.0  # a P that accepted a transfer and then sent nothing this long


class Consumer:
    def __init__(self, config: ConsumerConfig, agent_name: str, agent_metadata: bytes, regions: tuple[wire.Region, ...],
                 device_id: int = 0):
        self.config = config
        self._hello = wire.Hello(config.engine_id, config.tp_rank, agent_name, agent_metadata, config.identity, regions,
                                 device_id)
        self._lock = threading.Lock()
        self._outcome_ready = threading.Condition(self._lock)
        self._state = ConsumerState(config.timeout_s, config.accepted_timeout_s)
        self._liveness = PeerLiveness(silence_s=config.peer_silence_s)  # reactor thread only
        self._conns: dict[str, Connection] = {}
        self._connecting: dict[str, list[wire.Message]] = {}  # P engine -> what waits for its connection
        self._silenced: set[str] = set()  # P engines this side hung up on for not answering (reactor thread)
        self._outcomes: list[Outcome] = []
        self._started: list[Pending] = []  # streamed transfers whose WRITE began
        self.counters: Counter = Counter()
        self._counted: Counter = Counter()  # what take_counts already handed out
        self._reactor = Reactor(f"kvpush-d-{config.engine_id}", self)
        self._reactor.start()

    # ---- compute thread ----------------------------------------------------------------------
    def expect(self, req_id: str, transfer_id: str, peer_engine: str, host: str, port: int,
               block_ids: list[int], first_block: int, num_tokens: int) -> None:
        now = time.monotonic()
        pending = Pending(transfer_id, req_id, peer_engine, tuple(block_ids), now)
        with self._lock:
            if peer_engine not in self.config.allowed_engines:
                self.counters["refused_peer"] += 1
                self._add_outcomes([Outcome(pending, False, f"prefill engine {peer_engine!r} is not in allowed_engines {sorted(self.config.allowed_engines)}")])
                return
            if not self._state.add(pending):
                return
        log.debug("kvpush D expect %s req=%s blocks=%d first=%d t=%.6f", transfer_id, req_id, len(block_ids), first_block, now)
        msg = wire.Register(transfer_id, tuple(block_ids), first_block, num_tokens)
        self._reactor.call_soon(lambda: self._send(peer_engine, host, port, msg))

    def cancel(self, transfer_id: str) -> bool:
        """D's request went away: ask P not to write (the outcome still arrives, or times out).
        False if the transfer has its outcome already."""
        with self._lock:
            pending = self._state.pending.get(transfer_id)
        if pending is not None:
            self._reactor.call_soon(lambda: self._send_existing(pending.peer_engine, wire.Cancel(transfer_id)))
        return pending is not None

    def take_outcomes(self) -> list[Outcome]:
        with self._lock:
            out, self._outcomes = self._outcomes, []
            return out

    def take(self) -> tuple[list[Pending], list[Outcome]]:
        """Streamed WRITEs that began, and outcomes, taken together: a transfer that started and
        ended since the last call is in both lists, never in the outcomes alone."""
        with self._lock:
            started, self._started = self._started, []
            outcomes, self._outcomes = self._outcomes, []
            return started, outcomes

    def take_counts(self) -> Counter:
        """Messages and requests dropped or refused since the last call, by reason."""
        with self._lock:
            return counts_since(self.counters + self._state.dropped, self._counted, frozenset({"landed_parts"}))

    def wait_for_outcome(self, timeout_s: float, even_if_none_pending: bool = False) -> None:
        """Sleep until an outcome (or a streamed WRITE's start) is ready or `timeout_s` passes; at
        once when one is ready, or when nothing is pending unless `even_if_none_pending` (vLLM
        steps for blocks the worker holds back). For an engine step that computes nothing: vLLM
        would otherwise step again after 1 ms, and on CPU those idle steps take a whole core from
        whatever shares it."""
        with self._outcome_ready:
            if not self._outcomes and not self._started and (self._state.pending or even_if_none_pending):
                self._outcome_ready.wait(timeout_s)

    def wait_landed(self, transfer_ids: list[str], regions: tuple[int, ...], timeout_s: float) -> None:
        """Block until those regions of every one of these streamed transfers hold their bytes or
        the transfer has its outcome. One still short of that after `timeout_s` is failed here."""
        deadline = time.monotonic() + timeout_s
        with self._outcome_ready:
            while True:
                short = [t for t in transfer_ids if not self._state.has_landed(t, regions)]
                left = deadline - time.monotonic()
                if not short or left <= 0:
                    break
                self._outcome_ready.wait(left)
            for tid in short:
                pending = self._state.pending.get(tid)
                if pending is not None:
                    self._add_outcomes([self._state.fail(tid, pending.peer_engine,
                                                         f"streamed KV from {pending.peer_engine} did not land within {timeout_s:g} s",
                                                         may_still_land=True)])
                    self._reactor.call_soon(lambda p=pending: self._send_existing(p.peer_engine, wire.Cancel(p.transfer_id)))

    def _add_outcomes(self, outcomes: list[Outcome]) -> None:
        """Lock held."""
        if outcomes:
            self._outcomes.extend(outcomes)
            self._outcome_ready.notify_all()

    def close(self) -> None:
        self._reactor.stop()

    # ---- reactor thread --------------------------------------------------------------------------
    def _send(self, peer_engine: str, host: str, port: int, msg: wire.Message) -> None:
        conn = self._conns.get(peer_engine)
        if conn is not None and not conn.closed:
            if not conn.send(msg):
                self._reactor.close(conn, "send failed")
            return
        if peer_engine in self._connecting:
            self._connecting[peer_engine].append(msg)
            return
        self._connecting[peer_engine] = [msg]
        self._reactor.connect(host, port, self.config.connect_timeout_s,
                              lambda c, error: self._on_connected(peer_engine, f"{host}:{port}", c, error))

    def _on_connected(self, peer_engine: str, address: str, conn: Connection | None, error: str) -> None:
        waiting = self._connecting.pop(peer_engine, [])
        if conn is None:
            self._peer_failed(peer_engine, f"cannot reach prefill {peer_engine} side channel at {address}: {error}")
            return
        conn.engine_id = peer_engine
        self._conns[peer_engine] = conn
        for msg in [self._hello] + waiting:
            if not conn.send(msg):
                self._reactor.close(conn, "send failed")
                return

    def _send_existing(self, peer_engine: str, msg: wire.Message) -> None:
        """To a P this side has a connection to, or is connecting to; else dropped."""
        if peer_engine in self._connecting:
            self._connecting[peer_engine].append(msg)
            return
        conn = self._conns.get(peer_engine)
        if conn is not None:
            conn.send(msg)

    def _peer_failed(self, peer_engine: str, reason: str, may_still_land: bool = False) -> None:
        with self._lock:
            lost = self._state.peer_gone(peer_engine, reason, len(self._hello.regions), may_still_land)
            self._add_outcomes(lost)
        failed = [o for o in lost if not o.ok]
        if failed:
            log.warning("kvpush: %d transfer(s) from %s failed: %s", len(failed), peer_engine, reason)

    def _busy_peers(self) -> set[str]:
        """P engines with a transfer pending and a connection to ask them on (lock held)."""
        return {p.peer_engine for p in self._state.pending.values() if p.peer_engine in self._conns}

    def timeout(self) -> float | None:
        with self._lock:
            deadlines = [d for d in (self._state.next_deadline(), self._liveness.next_deadline(self._busy_peers()))
                         if d is not None]
        return None if not deadlines else max(0.0, min(deadlines) - time.monotonic())

    def on_tick(self) -> None:
        now = time.monotonic()
        with self._lock:
            late = self._state.expire(now)
            self._add_outcomes(late)
            to_ping, silent = self._liveness.due(self._busy_peers(), now)
        for engine_id in silent:
            self._silenced.add(engine_id)
            self._reactor.close(self._conns[engine_id],
                                f"no answer on the side channel for {self._liveness.silence_s:g} s; prefill is dead or hung")
        for engine_id in to_ping:
            self._send_existing(engine_id, wire.Ping())
        for o in late:
            log.warning("kvpush: transfer %s (request %s) failed: %s", o.pending.transfer_id, o.pending.req_id, o.reason)
        for o in late:  # let P free its side if it is still holding it
            self._send_existing(o.pending.peer_engine, wire.Cancel(o.pending.transfer_id))

    def on_malformed(self, conn: Connection, error: str) -> None:
        self.counters["malformed"] += 1
        log.warning("kvpush: dropped malformed message from %s: %s", conn.peer, error)

    def on_closed(self, conn: Connection, reason: str) -> None:
        if conn.engine_id is not None and self._conns.get(conn.engine_id) is conn:
            del self._conns[conn.engine_id]
            self._liveness.forget(conn.engine_id)
            silenced = conn.engine_id in self._silenced  # else P went away: nothing of it lands later
            self._silenced.discard(conn.engine_id)
            self._peer_failed(conn.engine_id, f"side channel to prefill {conn.engine_id} lost ({reason})", silenced)

    def on_message(self, conn: Connection, msg: wire.Message) -> None:
        now = time.monotonic()
        engine_id = conn.engine_id or ""
        self._liveness.heard(engine_id)
        if isinstance(msg, wire.Pong):
            return
        if isinstance(msg, wire.Welcome):
            if msg.engine_id != engine_id:
                self._reactor.close(conn, f"peer says it is {msg.engine_id!r}")
            return
        if isinstance(msg, wire.Refuse):
            log.error("kvpush: prefill %s refused the handshake: %s", engine_id, msg.reason)
            self._peer_failed(engine_id, f"handshake refused by {engine_id}: {msg.reason}")
            return
        with self._lock:
            if isinstance(msg, wire.Accepted):
                self._state.accept(msg.transfer_id, engine_id, now)
                log.debug("kvpush D accepted %s t=%.6f", msg.transfer_id, now)
                return
            if isinstance(msg, wire.Streaming):
                started = self._state.streaming(msg.transfer_id, engine_id)
                if started is not None:
                    self._started.append(started)
                    self._outcome_ready.notify_all()
                log.debug("kvpush D streaming %s t=%.6f", msg.transfer_id, now)
                return
            if isinstance(msg, wire.Landed):
                if self._state.landed(msg.transfer_id, engine_id, msg.regions, len(self._hello.regions)):
                    self.counters["landed_parts"] += 1
                    self._outcome_ready.notify_all()
                return
            if isinstance(msg, wire.Done):
                outcome = self._state.done(msg.transfer_id, engine_id, msg.num_bytes)
            elif isinstance(msg, wire.Fail):
                outcome = self._state.fail(msg.transfer_id, engine_id, msg.reason, msg.may_still_land)
            else:
                self.counters["unexpected"] += 1
                return
            if outcome is not None:
                self._add_outcomes([outcome])
        if outcome is not None:
            log.debug("kvpush D outcome %s req=%s ok=%s bytes=%d since_register=%.6f t=%.6f", msg.transfer_id,
                      outcome.pending.req_id, outcome.ok, outcome.num_bytes, now - outcome.pending.created, now)
            if not outcome.ok:
                log.warning("kvpush: transfer %s (request %s) failed: %s", msg.transfer_id, outcome.pending.req_id, outcome.reason)
