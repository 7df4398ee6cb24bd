"""A push written part by part (one layer of a layer-major cache each) from the compute thread,
telling decode STREAMING before the first part and LANDED after each, so decode can schedule the
request and compute each layer as soon as it is there.

A part still copying after STREAM_DRIVE_S is not waited for: it and the parts after it are posted
and handed back still copying, for the producer's reactor to poll to their end; decode then
learns of them from DONE or FAIL only. Polls spin only briefly (`wait_while_copying`). Before
each part it asks the caller whether decode still wants the push (`unwanted`: cancelled, its
connection replaced or closed); once not, nothing more is posted. With verify_kv, each LANDED
carries the digest of its part (`part_digest`), and the outcome the sum over every part posted,
which DONE carries. Uses the NIXL engine and the connection; no producer state.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from . import kv_digest, wire
from .channel import Connection
from .transfer import NixlEngine, TransferError, Write

STREAM_DRIVE_S = 1.0  # at most this long the compute thread drives one part; decode already computes on it
# The first WRITE to a decode rank completes only once that process has run (UCX finishes
# connecting then: tests/integration/connector/test_transfer_nixl.py), so a poll that keeps
# failing sleeps between tries instead of spinning on a core decode may need.
SPIN_S = 0.0002  # polls back to back this long, which covers a WRITE that completes at once
FIRST_SLEEP_S = 0.00005
MAX_SLEEP_S = 0.001


@dataclass
class StreamOutcome:
    error: str = ""  # why the push failed ("" if it did not, or not yet)
    landed_bytes: int = 0  # of the parts that completed on this thread
    num_descriptors: int = 0
    copying: list[Write] = field(default_factory=list)  # posted parts left for the reactor to finish
    digest: int = 0  # verify_kv: the sum of every posted part's digest (kv_digest.py)

    @property
    def copying_bytes(self) -> int:
        return sum(w.num_bytes for w in self.copying)


def wait_while_copying(engine: NixlEngine, writes: list[Write], deadline: float) -> list[str]:
    """The writes' states once none is still copying, or at `deadline` (monotonic)."""
    started = time.monotonic()
    pause = FIRST_SLEEP_S
    while True:
        states = [engine.state(w) for w in writes]
        now = time.monotonic()
        if "PROC" not in states or now >= deadline:
            return states
        if now - started >= SPIN_S:
            time.sleep(min(pause, deadline - now))
            pause = min(2 * pause, MAX_SLEEP_S)


PartDigest = Callable[[tuple[int, ...]], int]


def stream_parts(engine: NixlEngine, conn: Connection, engine_id: str, transfer_id: str,
                 parts: list[tuple[Write, tuple[int, ...]]], unwanted: Callable[[], str],
                 part_digest: PartDigest | None = None) -> StreamOutcome:
    """Post and drive each part to `engine_id` in turn; every part not handed back is released.
    `unwanted()`: why decode no longer wants the push ("" while it does). `part_digest(regions)`:
    the digest of the source bytes of those regions (verify_kv), hashed while the part copies."""
    outcome = StreamOutcome(num_descriptors=sum(w.num_descriptors for w, _ in parts))
    conn.send(wire.Streaming(transfer_id))
    for i, (write, regions) in enumerate(parts):
        later = [w for w, _ in parts[i + 1:]]
        why = unwanted()
        if why:  # decode gave up on this prefill (or died): its blocks may be another request's by now
            _release(engine, [write] + later)
            outcome.error = f"{why} during the streamed WRITE (before layer part {i + 1} of {len(parts)})"
            return outcome
        try:
            engine.post(write, engine_id)
        except TransferError as exc:  # post released this part's handle
            _release(engine, later)
            outcome.error = str(exc)
            return outcome
        digest = _digest_of(part_digest, regions, outcome)
        [state] = wait_while_copying(engine, [write], time.monotonic() + STREAM_DRIVE_S)
        if state == "PROC":
            _go_on_in_flight(engine, engine_id, write, parts[i + 1:], outcome, unwanted, part_digest)
            return outcome
        engine.release(write)
        if state != "DONE":
            _release(engine, later)
            outcome.error = f"NIXL WRITE to {engine_id} failed (layer part {i + 1} of {len(parts)})"
            return outcome
        outcome.landed_bytes += write.num_bytes
        conn.send(wire.Landed(transfer_id, regions, digest))
    return outcome


def _digest_of(part_digest: PartDigest | None, regions: tuple[int, ...], outcome: StreamOutcome) -> str:
    """A posted part's digest for the wire ("" without verify_kv), added to the push's."""
    if part_digest is None:
        return ""
    value = part_digest(regions)
    outcome.digest = (outcome.digest + value) & kv_digest.MASK
    return kv_digest.to_wire(value)


def _go_on_in_flight(engine: NixlEngine, engine_id: str, copying: Write, rest: list[tuple[Write, tuple[int, ...]]],
                     outcome: StreamOutcome, unwanted: Callable[[], str], part_digest: PartDigest | None) -> None:
    """Post the remaining parts without waiting; stop posting at the first error, or once decode
    no longer wants the push."""
    outcome.copying.append(copying)
    for write, regions in rest:
        why = "" if outcome.error else unwanted()
        if why:
            outcome.error = f"{why} during the streamed WRITE"
        if outcome.error:
            engine.release(write)
            continue
        try:
            engine.post(write, engine_id)
            outcome.copying.append(write)
        except TransferError as exc:
            outcome.error = str(exc)
            continue
        _digest_of(part_digest, regions, outcome)


def _release(engine: NixlEngine, writes: list[Write]) -> None:
    for write in writes:
        engine.release(write)
