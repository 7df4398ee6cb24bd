"""P's push service: accepts D's handshakes and registrations on the side channel, matches them
with finished blocks, WRITEs with NIXL and tells D DONE or FAIL.

On a GPU, `prepare()` is called (by the worker's save queue, save_order.py) while the GPU still
runs the forward pass in which a request's prefill completes: if D's registration is already here,
the request's coalesced WRITE is made then (see transfer.prepare_write), off the critical path.
`offer()` is called once the forward is done (on CPU by the compute thread, on a GPU by the save
queue); if D's registration is here, the WRITE (made ahead, or now) is posted right there. With
`stream_writes` (CPU) the compute thread instead writes layer by layer (streamed_write.py), so that
D's forward pass overlaps the copy. Who may connect is admission.py's call. `take_freed()` hands
back the requests whose blocks P may free (WRITE done or failed, or never matched before the timeout).

Three threads: the compute thread (vLLM's, the methods above), the side channel's reactor
(channel.py: reads and checks D's frames, answers PING and the handshake's proofs; it never calls
NIXL and never takes this module's lock, so a busy engine never delays a PONG), and the transfer
thread (transfer_thread.py), which gets everything else the reactor reads, in order: making D a
NIXL peer, registrations (and the WRITE of one that arrives after its offer), cancels, lost
connections; it also polls the WRITEs in flight and expires what waited too long.

This module matches offers with registrations and speaks to D; a matched push's WRITE, from
posting to its outcome, is pushes.py's.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from typing import Callable, Sequence

from kvpush.common.kv_params import PromptIdentity

from . import wire
from .admission import Handshake, Pairing, ThrottledWarnings
from .channel import Connection
from .fanin import base_name, rank_key, rank_of
from .instance_loss import InstanceLoss
from .peers import Peers
from .producer_channel import ProducerChannel
from .producer_config import ProducerConfig
from .pushes import Pushes, SendRecord
from .sharding import HeadSharding, ShardingError, targets_of
from .state import Match, Offer, ProducerState, Registration, Rejection, counts_since
from .transfer import NixlEngine, Peer
from .transfer_thread import TransferThread

log = logging.getLogger(__name__)
# Counters that are outcomes, not dropped or refused input (those are exported by `take_counts`)
_OUTCOME_COUNTERS = frozenset({"sent", "failed"})
__all__ = ["Producer", "ProducerConfig"]


class Producer:
    def __init__(self, config: ProducerConfig, engine: NixlEngine):
        self.config = config
        self.engine = engine
        self._lock = threading.RLock()
        self._state = ProducerState(config.timeout_s)
        self._peers = Peers()
        self._writing: set[str] = set()  # transfer ids the compute thread writes right now (no lock held)
        # transfer id -> its request's prompt, from the accept until its offer (or abort)
        self._prompt_of: dict[str, PromptIdentity | None] = {}
        self._counted: Counter = Counter()  # what take_counts already handed out
        self._warnings = ThrottledWarnings()
        self.counters: Counter = Counter()  # under the lock
        self._loss = InstanceLoss(config.engine_id, self._lock, self._fail_waiting,
                                  lambda: bool(self._writing or self._pushes.inflight))
        self._jobs = TransferThread(f"kvpush-p-{config.engine_id}-transfer", self._next_wait, self._tick)
        self._channel = ProducerChannel(config, engine, self._jobs, self._count, self._warnings,
                                        self._on_transfer_message, self._closed, self._pair)
        self._reactor = self._channel.reactor
        self._admission = self._channel.admission
        self._pushes = Pushes(config, engine, self._lock, self._peers, self.counters, self._jobs.wake)
        self.port = self._reactor.listen(config.host, config.port)
        self._jobs.start()
        self._reactor.start()

    # ---- compute thread ----------------------------------------------------------------------
    def prepare(self, transfer_id: str, block_ids: Sequence[int], peer_engine: str,
                peer_tp_size: int = 1) -> bool:
        """Make the WRITEs of a request whose prefill is about to complete, one per decode rank
        whose registration and connection are here; `offer` then only posts them. False if
        nothing was made."""
        made = False
        for rank in self._targets(peer_tp_size):
            made |= self._prepare(rank_key(transfer_id, rank), block_ids, rank_key(peer_engine, rank), transfer_id)
        return made

    def _prepare(self, key: str, block_ids: Sequence[int], peer_engine: str, transfer_id: str) -> bool:
        with self._lock:
            reg = self._state.registrations.get(key)
            if reg is not None and reg.prompt != self._prompt_of.get(transfer_id):
                return False  # its offer is refused (state._match): nothing to make
            return self._pushes.prepare(key, block_ids, peer_engine, reg)

    def has_registration(self, transfer_id: str, peer_tp_size: int = 1) -> bool:
        """Whether every decode rank this rank writes into has registered its blocks for the transfer."""
        with self._lock:
            targets = self._targets(peer_tp_size)
            return bool(targets) and all(rank_key(transfer_id, r) in self._state.registrations for r in targets)

    def peer(self, engine_id: str, rank: int = 0) -> Peer | None:
        """The NIXL peer of a decode rank that completed its handshake."""
        with self._lock:
            return self._peers.nixl.get(rank_key(engine_id, rank))

    def offer(self, transfer_id: str, req_id: str, block_ids: list[int], peer_engine: str,
              peer_tp_size: int = 1) -> None:
        """The request's prefill is done and these are its blocks: one push per decode rank that
        takes KV heads from this rank. Copies (CPU) happen on this thread without the producer's
        lock, so the reactor keeps answering D meanwhile. Its blocks are freed once every push ended."""
        now = time.monotonic()
        here: list[Match] = []
        with self._lock:
            if self._loss.reason:
                self.withdraw(transfer_id, req_id, self._loss.reason, peer_tp_size)
                return
            targets = self._targets(peer_tp_size)
            if peer_engine not in self.config.allowed_engines or not targets:
                if targets:
                    self.counters["refused_peer"] += 1
                    log.error("kvpush: request %s names decode engine %r, which is not in allowed_engines %s; not "
                              "sending its KV", req_id, peer_engine, sorted(self.config.allowed_engines))
                self._pushes.free_now(req_id)  # else no decode rank takes heads from this rank
                return
            self._pushes.expect(req_id, len(targets))
            prompt = self._prompt_of.pop(transfer_id, None)
            for rank in targets:
                key = rank_key(transfer_id, rank)
                result = self._state.offer(Offer(key, req_id, tuple(block_ids), rank_key(peer_engine, rank), now,
                                                 prompt))
                log.debug("kvpush P offer %s req=%s blocks=%d t=%.6f matched=%s", key, req_id, len(block_ids), now,
                          result is not None)
                if isinstance(result, Match) and self.config.drive_writes:  # this thread copies it
                    self._writing.add(key)
                    here.append(result)
                else:
                    self._settle(result)
        # Streamed only where this rank writes into one decode rank. Writing into several, it
        # would stream into one after the other; decode's ranks meet in an all-reduce in every
        # layer, where the first spins waiting for one whose layers this rank has not reached,
        # on a CPU host on a core this rank may share, keeping this rank off it. Unstreamed,
        # decode's ranks compute only once every WRITE is there.
        write = self._pushes.stream if self.config.stream_writes and len(targets) == 1 else self._pushes.drive
        for match in here:
            key = match.offer.transfer_id
            try:
                write(match)
            except Exception as exc:  # a bug here must cost this push, not the engine's compute thread
                log.exception("kvpush: WRITE %s failed unexpectedly", key)
                with self._lock:
                    self._pushes.finish(match, self._pushes.wanted(match)[0], now, time.monotonic(), False,
                                        f"prefill error during the WRITE: {exc!r}")
            finally:
                with self._lock:
                    self._writing.discard(key)
        self._jobs.wake()

    def _targets(self, peer_tp_size: int) -> list[int]:
        """The decode ranks (of a decode instance with this TP size) this rank writes into."""
        try:
            decode = HeadSharding(self.config.sharding.total_heads, peer_tp_size)
        except ShardingError:
            return []  # refused at the decode rank's handshake; nothing to write
        return targets_of(self.config.tp_rank, self.config.sharding, decode)

    def accept(self, transfers: list[tuple[str, int, PromptIdentity | None]]) -> None:
        """P's scheduler has these requests (queued or prefilling), given as (transfer id, decode
        TP size, its prompt's identity): tell each decode rank, whose no-show timer stops, now or
        when it registers. The identity goes with the request's offer, which a registration must match."""
        with self._lock:
            for tid, peer_tp_size, prompt in transfers:
                self._prompt_of[tid] = prompt
                for rank in self._targets(peer_tp_size):
                    reg = self._state.accept(rank_key(tid, rank))
                    if reg is not None:
                        self._send(reg.peer_engine, wire.Accepted(tid))

    def abort(self, transfer_id: str, reason: str, peer_tp_size: int = 1) -> None:
        """P's request ended before its prefill completed: tell D's ranks now or when they register."""
        with self._lock:
            self._prompt_of.pop(transfer_id, None)
            for rank in self._targets(peer_tp_size):
                reg = self._state.abort(rank_key(transfer_id, rank), reason, time.monotonic())
                if reg is not None:
                    self._send_fail(reg.peer_engine, transfer_id, reason)

    def withdraw(self, transfer_id: str, req_id: str, reason: str, peer_tp_size: int = 1) -> None:
        """A request whose prefill completed but whose KV is not to be sent after all (the forward
        pass that wrote it failed): D's ranks hear FAIL, now or when they register, and its blocks
        are free."""
        with self._lock:
            self._prompt_of.pop(transfer_id, None)
            self.counters["failed"] += 1
            log.warning("kvpush: push %s (request %s) withdrawn: %s", transfer_id, req_id, reason)
            for rank in self._targets(peer_tp_size):
                key = rank_key(transfer_id, rank)
                reg = self._state.abort(key, reason, time.monotonic())
                if reg is not None:
                    self._send_fail(reg.peer_engine, transfer_id, reason)
                self._pushes.release_prepared(key)
            self._pushes.free_now(req_id)

    def watch_siblings(self, handles: dict[int, str], gone: list[str],
                       on_lost: Callable[[], None] = lambda: None) -> None:
        """The other ranks of this instance (pidfd -> name, siblings.py): once one ends, this
        rank's forward passes stop in their next collective, so nothing here will be offered.
        `on_lost` then runs on the transfer thread, after decode has been told and once no push
        this rank had already matched is still being written; both side-channel threads
        (`side_channel_threads`) must keep running after it, to answer decode."""
        self._loss.watch(handles, gone, on_lost, self._reactor.watch_exit, self._jobs.submit)

    def side_channel_threads(self) -> set[int]:
        """Native ids of the reactor and transfer threads, which answer decode."""
        return {t for t in (self._reactor.native_id, self._jobs.native_id) if t is not None}

    def lose_instance(self, why: str) -> bool:
        """Fail every registration decode holds here now, and every later one on arrival: this
        rank's siblings are gone, and its own process may live on for seconds until vLLM ends it.
        False if that was done before."""
        return self._loss.lose(why)

    def _fail_waiting(self, reason: str) -> int:
        """Lock held: fail every registration decode holds here; how many there were."""
        waiting = list(self._state.registrations.values())
        for reg in waiting:
            self._state.abort(reg.transfer_id, reason, time.monotonic())
            self._send_fail(reg.peer_engine, base_name(reg.transfer_id), reason)
        return len(waiting)

    def take_freed(self) -> list[str]:
        with self._lock:
            return self._pushes.take_freed()

    def take_counts(self) -> Counter:
        """Messages and requests dropped or refused since the last call, by reason."""
        with self._lock:
            self.counters["connection_cap"] = self._reactor.refused_connections
            return counts_since(self.counters + self._state.dropped + self._channel.side_counts.copy(), self._counted,
                                _OUTCOME_COUNTERS)

    def take_records(self) -> list[SendRecord]:
        with self._lock:
            return self._pushes.take_records()

    def close(self) -> None:
        self._reactor.stop()
        self._jobs.stop()
        with self._lock:
            self._pushes.release_all_prepared()

    # ---- both threads (under the lock) ---------------------------------------------------------
    def _settle(self, result: Match | Rejection | None) -> None:
        if isinstance(result, Rejection):
            self.counters["rejected"] += 1
            if result.tell_decode:
                self._send_fail(result.peer_engine, base_name(result.transfer_id), result.reason)
            else:
                log.warning("kvpush: request %s refused: %s", result.req_id, result.reason)
            if result.req_id is not None:
                self._pushes.push_ended(result.req_id)
        elif isinstance(result, Match):
            self._pushes.queue(self._pushes.post(result))

    def _send_fail(self, engine_id: str, transfer_id: str, reason: str) -> None:
        self._send(engine_id, wire.Fail(transfer_id, reason))

    def _send(self, engine_id: str, msg: wire.Message) -> None:
        conn = self._peers.conns.get(engine_id)
        if conn is not None:
            conn.send(msg)

    def _count(self, kind: str) -> None:
        with self._lock:
            self.counters[kind] += 1

    # ---- transfer thread -----------------------------------------------------------------------
    def _next_wait(self) -> float | None:
        with self._lock:
            poll = self._pushes.next_poll()
            if poll is not None:
                return poll
            deadline = self._state.next_deadline()
        return None if deadline is None else max(0.0, deadline - time.monotonic())

    def _tick(self) -> None:
        with self._lock:
            self._pushes.poll()
            offers, regs = self._state.expire(time.monotonic())
            self._pushes.release_stale_prepared(self._state.registrations, self._writing)
            for o in offers:
                log.warning("kvpush: decode engine %s never registered transfer %s (request %s) within %g s; freeing "
                            "its blocks", o.peer_engine, o.transfer_id, o.req_id, self.config.timeout_s)
                self._pushes.push_ended(o.req_id)
            for r in regs:
                tid = base_name(r.transfer_id)
                self._send_fail(r.peer_engine, tid, f"prefill {self.config.engine_id} had no request for transfer "
                                                    f"{tid} within {self.config.timeout_s:g} s")
        self._loss.run_if_idle()

    def _closed(self, conn: Connection, reason: str) -> None:
        with self._lock:
            engine_id = conn.engine_id
            generation, live = self._peers.closed(conn)
            if generation:  # its registrations go with it, and its WRITEs still copying are drained
                assert engine_id is not None, "an admitted connection names its engine"
                self._state.peer_gone(engine_id, time.monotonic(), generation)
                self._pushes.poll(gone=conn, why=reason)
            if live:
                log.info("kvpush: decode engine %s disconnected (%s)", engine_id, reason)

    def _on_transfer_message(self, conn: Connection, msg: wire.Register | wire.Cancel, now: float) -> None:
        if conn.engine_id is None:  # its handshake was refused, or is not done (nothing of it is kept)
            self._count("before_handshake")
            return
        peer_key = conn.engine_id
        late: Match | None = None
        with self._lock:
            if isinstance(msg, wire.Register):
                key = self._part_key(msg.transfer_id, peer_key)
                log.debug("kvpush P register %s from %s blocks=%d t=%.6f", key, peer_key, len(msg.block_ids), now)
                bad = self._bad_registration(peer_key, msg)
                if bad:
                    self.counters["bad_registration"] += 1
                    log.warning("kvpush: refused registration %s from %s: %s", msg.transfer_id, peer_key, bad)
                if bad or self._loss.reason:
                    offer = self._state.cancel(key, peer_key, now)
                    if offer is not None:
                        self._pushes.push_ended(offer.req_id)
                    conn.send(wire.Fail(msg.transfer_id, bad or self._loss.reason))
                    return
                claimed = PromptIdentity(msg.prompt_tokens, msg.prompt_digest) if msg.prompt_digest else None
                result = self._state.register(Registration(key, peer_key, msg.block_ids, msg.first_block, now,
                                                           self._peers.generation(conn), claimed))
                if result is None and key in self._state.accepted:
                    conn.send(wire.Accepted(msg.transfer_id))
                if isinstance(result, Match):  # its offer came first: written here, outside the lock
                    late = result
                    self._writing.add(key)
                else:
                    self._settle(result)
            else:
                key = self._part_key(msg.transfer_id, peer_key)
                offer = self._state.cancel(key, peer_key, now)
                if offer is not None:
                    self._pushes.push_ended(offer.req_id)
                if key in self._writing:  # checked right before each post, and each streamed part
                    self._pushes.cancelled.add(key)
                writing = key in self._writing or self._pushes.busy(key)
                if not writing:  # else the WRITE's own DONE or FAIL answers
                    conn.send(wire.Fail(msg.transfer_id, "cancelled by decode"))
        if late is not None:
            self._post(late)

    def _post(self, match: Match) -> None:
        """Post a matched WRITE and hand it to the polling; the lock is not held across NIXL's post."""
        item = None
        try:
            item = self._pushes.post(match)
        finally:
            with self._lock:
                self._writing.discard(match.offer.transfer_id)
                self._pushes.queue(item)

    @staticmethod
    def _part_key(transfer_id: str, peer_key: str) -> str:
        """This side's name of the push of `transfer_id` to the decode rank behind `peer_key`."""
        return rank_key(transfer_id, rank_of(peer_key))

    def _bad_registration(self, engine_id: str, msg: wire.Register) -> str:
        """Why D's registration cannot be written into as it stands ("" if it can)."""
        peer = self._peers.nixl.get(engine_id)
        num_blocks = peer.regions[0].num_blocks if peer is not None else 0
        if msg.block_ids and max(msg.block_ids) >= num_blocks:
            return f"block ids up to {max(msg.block_ids)}, but decode engine {engine_id} registered {num_blocks} blocks"
        return ""

    def _pair(self, conn: Connection, handshake: Handshake, layout: wire.Layout) -> None:
        """A proven decode rank's LAYOUT: make it a NIXL peer (no lock held) and admit it."""
        if conn.closed:
            return
        pairing = self._admission.pair(conn, handshake, layout)
        if pairing is not None:
            self._admit(conn, pairing)

    def _admit(self, conn: Connection, pairing: Pairing) -> None:
        """A decode rank proved the key and pairs with this rank: its pushes may start."""
        hello = pairing.hello
        key = rank_key(hello.engine_id, hello.tp_rank)
        with self._lock:
            conn.engine_id = key
            old = self._peers.admit(key, conn, pairing.peer)
        if old is not None:
            self._reactor.close(old, "replaced by a new connection")
        conn.send(wire.Welcome(self.config.engine_id))
        log.info("kvpush: handshake with decode engine %s rank %d (%s) done %.3f s after its proof: %d segment(s) per "
                 "block run", hello.engine_id, hello.tp_rank, conn.peer, time.monotonic() - pairing.proven_at,
                 len(pairing.plan.segments))
