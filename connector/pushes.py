"""P's pushes from WRITE to outcome: the WRITEs made ahead of a prefill's end, posting a match's
WRITE (or streaming it part by part), the WRITEs in flight polled to their end or deadline, and what
each ended push leaves behind (DONE or FAIL to D, a SendRecord, the request's blocks freed after
its last push).

Right before each post, and before each part of a streamed WRITE, the push must still be wanted:
not cancelled by D, its registration's connection still the decode rank's live one (a
registration from an older connection is refused, counted `stale_generation`, never written),
and that connection not closed (asked of the kernel, so a P that resumes from a stall sees D's
close before its side-channel thread read it). A WRITE given up on while still copying (past its
deadline, or its connection lost) cannot be called back: its handles are kept and polled
(`draining`) until each ended, and then D hears QUIESCED, the word that ends its hold on the blocks.
With verify_kv, DONE (and each streamed LANDED) carries the digest of the source bytes the push
wrote (kv_digest.py), hashed right after the post, which decode compares with its blocks.

The producer (producer.py) decides when a push may start and owns the side channel; everything here
runs under the producer's lock, except the copies themselves, which `post`, `drive` and `stream`
make with the lock released so the reactor keeps answering D meanwhile.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from typing import TYPE_CHECKING, Callable, Sequence

from . import kv_digest, wire
from .channel import Connection
from .fanin import base_name, rank_of
from .kv_digest import DigestError
from .peers import Peers
from .push_records import Draining, InFlight, Prepared, SendRecord
from .state import Match, Registration
from .streamed_write import MAX_SLEEP_S, stream_parts, wait_while_copying
from .transfer import NixlEngine, Peer, TransferError, Write

if TYPE_CHECKING:
    from .producer_config import ProducerConfig

log = logging.getLogger(__name__)
__all__ = ["Pushes", "SendRecord"]
SYNC_DRIVE_S = 0.5  # at most this long the compute thread drives a WRITE it posted itself
DRAIN_POLL_S = 0.01  # how often WRITEs given up on are polled for their end (they are overdue already)
POLL_S = 0.0002  # completion polling period, only while WRITEs are in flight, easing off on a
# CPU host to the compute thread's longest sleep between polls as they stay there (`next_poll`)


class Pushes:
    """The producer's pushes past matching. `wake` rouses the reactor thread, which polls the
    WRITEs in flight (`poll`) and may sleep until a distant deadline otherwise."""

    def __init__(self, config: ProducerConfig, engine: NixlEngine, lock: threading.RLock, peers: Peers,
                 counters: Counter, wake: Callable[[], None]):
        self.config = config
        self.engine = engine
        self._lock = lock
        self._peers = peers
        self._counters = counters
        self._wake = wake
        self.inflight: list[InFlight] = []  # WRITEs the reactor thread polls to their end
        self.draining: list[Draining] = []  # WRITEs given up on, polled until their handles ended
        # pushes D cancelled while a thread was about to write them (or writing): not posted further
        self.cancelled: set[str] = set()
        self._prepared: dict[str, Prepared] = {}  # transfer id ->
        self._freed: list[str] = []
        self._parts_left: dict[str, int] = {}  # request -> pushes (one per decode rank) not yet ended
        self._records: list[SendRecord] = []

    # ---- WRITEs made ahead -----------------------------------------------------------------------
    def prepare(self, transfer_id: str, block_ids: Sequence[int], peer_engine: str,
                reg: Registration | None) -> bool:
        """Make the WRITE of one push ahead, if its registration and peer are here (caller holds the lock)."""
        peer = self._peers.nixl.get(peer_engine)
        if reg is None or peer is None or reg.peer_engine != peer_engine or transfer_id in self._prepared:
            return False
        end = reg.first_block + len(reg.block_ids)
        if not reg.block_ids or end > len(block_ids):
            return False  # offer() answers these without a WRITE
        src = tuple(block_ids[reg.first_block:end])
        try:
            write = self.engine.prepare_write(peer, src, reg.block_ids)
        except TransferError as exc:
            log.debug("kvpush P could not make %s ahead: %s", transfer_id, exc)
            return False
        self._prepared[transfer_id] = Prepared(peer_engine, peer, src, reg.block_ids, write)
        return True

    def release_prepared(self, transfer_id: str) -> None:
        prepared = self._prepared.pop(transfer_id, None)
        if prepared is not None:
            self.engine.release(prepared.write)

    def release_stale_prepared(self, registrations: dict, being_written: set[str]) -> None:
        """WRITEs made ahead whose registration went away (cancelled, expired, peer gone). A
        matched push's registration is gone too, but until the compute thread posts its WRITE
        (`being_written`) the one made ahead is still to be used."""
        for tid in [t for t in self._prepared if t not in registrations and t not in being_written]:
            self.release_prepared(tid)

    def release_all_prepared(self) -> None:
        for tid in list(self._prepared):
            self.release_prepared(tid)

    def _take_prepared(self, match: Match, engine_id: str, peer: Peer) -> Write | None:
        """The WRITE made ahead for this match, if it still fits (same peer connection and blocks)."""
        prepared = self._prepared.pop(match.offer.transfer_id, None)
        if prepared is None:
            return None
        if (prepared.peer is peer and prepared.engine_id == engine_id and prepared.src_blocks == tuple(match.src_blocks)
                and prepared.dst_blocks == tuple(match.dst_blocks)):
            return prepared.write
        self.engine.release(prepared.write)
        return None

    # ---- starting a push's WRITE -------------------------------------------------------------------
    def post(self, match: Match) -> InFlight | None:
        """Post the match's WRITE; its in-flight record, or None if the push already ended here.
        The lock is taken for the bookkeeping only: on CPU the copy happens inside the post."""
        engine_id = match.registration.peer_engine
        now = time.monotonic()
        with self._lock:
            conn, why = self.wanted(match)
            peer = self._peers.nixl.get(engine_id)
            if why or peer is None:
                self._count_stale(match)
                self.finish(match, conn, now, now, False, f"{why} before the WRITE" if why else
                            f"decode engine {engine_id} has no NIXL peer here")
                return None
            assert conn is not None, "wanted() gives no reason to stop only with the connection at hand"
            try:
                slices = self._slices(peer)
            except DigestError as exc:
                self.finish(match, conn, now, now, False, str(exc))
                return None
            if not match.src_blocks:
                conn.send(wire.Done(base_name(match.offer.transfer_id), 0, self._digest(match, slices)))
                self.finish(match, None, now, now, True)
                return None
            write = self._take_prepared(match, engine_id, peer)
        ahead = write is not None
        try:
            if write is None:
                write = self.engine.prepare_write(peer, match.src_blocks, match.dst_blocks)
            # from the post call on: over CUDA IPC the post can return with most of the copy done (2 GiB
            # pushes inside vLLM ended 0.35 ms after it returned, a third of a device copy of 2 GiB)
            posted = time.monotonic()
            self.engine.post(write, engine_id)
        except TransferError as exc:
            with self._lock:
                self.finish(match, conn, now, time.monotonic(), False, str(exc))
            return None
        log.debug("kvpush P post %s bytes=%d descs=%d ahead=%s wait=%.6f t=%.6f", match.offer.transfer_id,
                  write.num_bytes, write.num_descriptors, ahead, match.wait_s, now)
        item = InFlight(match, [write], conn, posted, ahead, num_bytes=write.num_bytes,
                        deadline=posted + self.config.timeout_s)
        try:  # while the copy runs (on a GPU): the source bytes stay as they are
            item.digest = self._digest(match, slices)
        except Exception as exc:  # posted already: FAIL once it is no longer in flight
            item.error = f"prefill could not hash the KV it wrote (verify_kv): {exc!r}"
        return item

    def queue(self, item: InFlight | None) -> None:
        """Hand a posted WRITE to the reactor thread, which polls it to its end."""
        if item is not None:
            self.inflight.append(item)
            self._wake()  # it may be asleep until a distant deadline

    def drive(self, match: Match) -> None:
        """Post the WRITE and complete it before returning: on a CPU host the copy is CPU work on
        this instance's cores either way, and finishing it here hands the KV over without waiting
        for another thread to be scheduled. It joins `inflight` only then, so the reactor does
        not release it under this thread's feet."""
        item = self.post(match)
        if item is None:
            return
        wait_while_copying(self.engine, item.writes, time.monotonic() + SYNC_DRIVE_S)
        with self._lock:
            self.inflight.append(item)
            self.poll()

    def stream(self, match: Match) -> None:
        """Write part by part, telling D as each lands (streamed_write.py); parts still copying
        join `inflight` only once all are posted, so the reactor does not release them early."""
        engine_id = match.registration.peer_engine
        with self._lock:
            conn, why = self.wanted(match)
            peer = self._peers.nixl.get(engine_id)
            if why or conn is None or peer is None or not match.src_blocks:
                self.queue(self.post(match))  # answers these as usual: FAIL (unwanted) or DONE (nothing to write)
                return
        started = time.monotonic()
        try:
            slices = self._slices(peer)
            parts = self.engine.prepare_parts(peer, match.src_blocks, match.dst_blocks)
        except (TransferError, DigestError) as exc:
            with self._lock:
                self.finish(match, conn, started, time.monotonic(), False, str(exc))
            return
        memory = self.config.verify_kv
        digests = (
            None if memory is None else lambda regions: kv_digest.digest(memory, slices, match.src_blocks, regions)
        )
        outcome = stream_parts(self.engine, conn, engine_id, base_name(match.offer.transfer_id), parts,
                               lambda: self.wanted(match)[1], digests)
        digest = kv_digest.to_wire(outcome.digest) if digests is not None else ""
        with self._lock:
            if outcome.error:
                self._count_stale(match)
            if outcome.copying:
                self.queue(InFlight(match, outcome.copying, conn, started, False, outcome.error,
                                    outcome.landed_bytes + outcome.copying_bytes,
                                    time.monotonic() + self.config.timeout_s, digest))
            elif outcome.error:
                self.finish(match, conn, started, time.monotonic(), False, outcome.error,
                            num_descriptors=outcome.num_descriptors)
            else:
                self.finish(match, conn, started, time.monotonic(), True, num_bytes=outcome.landed_bytes,
                            num_descriptors=outcome.num_descriptors, digest=digest)

    # ---- verify_kv --------------------------------------------------------------------------------
    def _slices(self, peer: Peer) -> list[kv_digest.Slice]:
        """What a push to this peer writes, as the digest covers it ([] without verify_kv)."""
        if self.config.verify_kv is None:
            return []
        return kv_digest.producer_slices(peer.plan.segments, self.engine.regions, peer.regions)

    def _digest(self, match: Match, slices: list[kv_digest.Slice]) -> str:
        """For the wire: the digest of the source bytes this match writes, "" without verify_kv."""
        if self.config.verify_kv is None:
            return ""
        return kv_digest.to_wire(kv_digest.digest(self.config.verify_kv, slices, match.src_blocks))

    # ---- whether a push is still wanted -------------------------------------------------------
    def wanted(self, match: Match) -> tuple[Connection | None, str]:
        """The connection the match's registration came on, and why not to write it now ("" to
        go on; the caller says when, e.g. "before the WRITE"). Reads only: the compute thread asks
        it between streamed parts without the lock."""
        engine_id, generation = match.registration.peer_engine, match.registration.generation
        conn = self._peers.live(engine_id, generation)
        if match.offer.transfer_id in self.cancelled:
            return conn, "cancelled by decode"
        if conn is None:
            if engine_id in self._peers.conns:  # a newer connection replaced the registration's
                return None, f"decode engine {engine_id} replaced the connection it registered this transfer on"
            return None, f"decode engine {engine_id} disconnected"
        if conn.gone():  # D closed it, maybe while this process was stalled: its blocks may be another's now
            return conn, f"decode engine {engine_id} disconnected"
        return conn, ""

    def _count_stale(self, match: Match) -> None:
        """A push refused because its registration came on a connection since replaced (lock held)."""
        engine_id = match.registration.peer_engine
        if engine_id in self._peers.conns and self._peers.live(engine_id, match.registration.generation) is None:
            self._counters["stale_generation"] += 1

    # ---- WRITEs in flight ------------------------------------------------------------------------
    def in_flight(self, transfer_id: str) -> bool:
        return any(i.match.offer.transfer_id == transfer_id for i in self.inflight)

    def busy(self, transfer_id: str) -> bool:
        """A WRITE of this push is still posted (in flight or draining): D hears its end from it."""
        return self.in_flight(transfer_id) or any(d.transfer_id == transfer_id for d in self.draining)

    def next_poll(self) -> float | None:
        """Lock held: how soon the WRITEs in flight or draining want polling; None if there are none.
        On a CPU host a WRITE in flight for long waits on its decode process (the first WRITE to a
        rank ends only once that process has run), which may need this very core; polling that never
        pauses would hold it, so the period grows with the youngest WRITE's age. The GPU's copy
        engines need no core."""
        if self.inflight:
            if not self.config.drive_writes:
                return POLL_S
            age = time.monotonic() - max(item.posted for item in self.inflight)
            return min(MAX_SLEEP_S, max(POLL_S, age / 8))
        return DRAIN_POLL_S if self.draining else None

    def poll(self, gone: Connection | None = None, why: str = "") -> None:
        """Finish WRITEs that completed or failed, or still copy past their deadline, or go over
        the connection `gone` (caller holds the lock). One given up on while copying is drained:
        FAIL says it may still land, QUIESCED follows once its handles ended."""
        if self.inflight:
            still = []
            now = time.monotonic()
            for item in self.inflight:
                state = item.state(self.engine)
                engine_id = item.match.registration.peer_engine
                reason = item.error or f"NIXL WRITE to {engine_id} failed"
                copying = state == "PROC"
                if copying:
                    if gone is not None and item.conn is gone:
                        reason = f"decode engine {engine_id} disconnected during the WRITE ({why})"
                    elif now > item.deadline:
                        reason = (
                            f"NIXL WRITE to {engine_id} still copying {self.config.timeout_s:g} s after it was posted"
                        )
                    else:
                        still.append(item)
                        continue
                    self.draining.append(Draining(item.match.offer.transfer_id, item.writes, item.conn))
                else:
                    for write in item.writes:
                        self.engine.release(write)
                ok = state == "DONE"
                self.finish(item.match, item.conn, item.posted, time.monotonic(), ok, "" if ok else reason,
                            item.num_bytes if ok else 0, sum(w.num_descriptors for w in item.writes),
                            item.prepared_ahead, may_still_land=copying, digest=item.digest)
            self.inflight = still
        if self.draining:
            self._drain()

    def _drain(self) -> None:
        """Handles given up on that ended: released, and D told QUIESCED on the connection the push
        went over (closed: D no longer waits for it, or this side's process went away)."""
        still = []
        for item in self.draining:
            if any(self.engine.state(w) == "PROC" for w in item.writes):
                still.append(item)
                continue
            for write in item.writes:
                self.engine.release(write)
            if item.conn is not None:
                item.conn.send(wire.Quiesced(base_name(item.transfer_id)))
            log.info("kvpush: push %s given up on earlier has no WRITE left in flight", item.transfer_id)
        self.draining = still

    # ---- a push's end ----------------------------------------------------------------------------
    def expect(self, req_id: str, pushes: int) -> None:
        """The request's blocks are freed once these many more of its pushes have ended."""
        self._parts_left[req_id] = self._parts_left.get(req_id, 0) + pushes

    def finish(self, match: Match, conn: Connection | None, posted: float, now: float, ok: bool,
               reason: str = "", num_bytes: int = 0, num_descriptors: int = 0, ahead: bool = False,
               may_still_land: bool = False, digest: str = "") -> None:
        tid = match.offer.transfer_id
        self.cancelled.discard(tid)
        if ok:
            self._counters["sent"] += 1
            if conn is not None:
                conn.send(wire.Done(base_name(tid), num_bytes, digest))
        else:
            self._counters["failed"] += 1
            log.warning("kvpush: push %s (request %s) failed: %s", tid, match.offer.req_id, reason)
            if conn is not None:
                conn.send(wire.Fail(base_name(tid), reason, may_still_land))
        self.push_ended(match.offer.req_id)
        self._records.append(SendRecord(base_name(tid), match.offer.req_id, ok, num_bytes, match.offer.created,
                                        match.registration.created, posted, now, reason, num_descriptors, ahead,
                                        rank_of(tid)))
        log.debug("kvpush P done %s ok=%s bytes=%d prefill_end_to_done=%.6f t=%.6f", tid, ok, num_bytes,
                  now - match.offer.created, now)

    def push_ended(self, req_id: str) -> None:
        """One of the request's pushes ended (any way): its blocks are free after the last."""
        left = self._parts_left.get(req_id, 1) - 1
        if left > 0:
            self._parts_left[req_id] = left
            return
        self._parts_left.pop(req_id, None)
        self._freed.append(req_id)

    def free_now(self, req_id: str) -> None:
        """A request none of whose pushes will run: its blocks are free at once."""
        self._freed.append(req_id)

    def take_freed(self) -> list[str]:
        freed, self._freed = self._freed, []
        return freed

    def take_records(self) -> list[SendRecord]:
        records, self._records = self._records, []
        return records
