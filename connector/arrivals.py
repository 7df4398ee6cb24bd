"""D's transfers as the worker sees them: from registration to an outcome, and on to the moment
nothing can write into their blocks any more. Shared by the compute thread (which takes what
arrived and waits for streamed layers) and the consumer's reactor thread (which feeds it P's
messages), under one lock.

A transfer is handed out as started (a streamed WRITE began: vLLM may schedule the request), as an
outcome (once every part from every source rank has one), and, for an outcome whose blocks were
fenced (fences.py: a source may still write into them), once more as unfenced: only then may vLLM
have the blocks back.

With verify_kv (kv_digest_check.py), a LANDED or DONE counts only once the bytes it announces
match prefill's digest; one that does not fails the part (a load failure: vLLM recomputes or the
router retries), counted.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from typing import Callable

from . import wire
from .fanin import Parts, base_name
from .kv_digest_check import KvCheck
from .state import ConsumerState, Outcome, Pending

log = logging.getLogger(__name__)
# (prefill rank's engine key, transfer id as the wire spells it): ask that rank to stop writing
SendCancel = Callable[[str, str], None]


class Arrivals:
    def __init__(self, state: ConsumerState, send_cancel: SendCancel, num_regions: int, counters: Counter,
                 check: KvCheck | None = None):
        self.lock = threading.Lock()
        self.check = check  # verify_kv; None: off
        self.ready = threading.Condition(self.lock)
        self.state = state  # under the lock
        self.parts = Parts()  # under the lock
        self._send_cancel = send_cancel
        self._num_regions = num_regions  # of this rank's KV cache (LANDED names them by index)
        self._counters = counters  # the consumer's, under the lock
        self._outcomes: list[Outcome] = []
        self._started: list[Pending] = []  # streamed transfers whose WRITE began
        self._unfenced: list[str] = []  # transfer ids whose fenced blocks are free of writers now

    # ---- reactor thread -------------------------------------------------------------------------
    def on_message(self, msg: wire.Message, key: str, peer_engine: str, generation: int, now: float) -> Outcome | None:
        """P's word about part `key`, on that connection; the part's outcome if this was it."""
        if self.check is not None and isinstance(msg, (wire.Landed, wire.Done)):
            refused = self._checked(msg, key, peer_engine, generation, now)
            if refused is not None:
                return refused
        with self.lock:
            state = self.state
            if isinstance(msg, wire.Accepted):
                state.accept(key, peer_engine, now, generation)
                log.debug("kvpush D accepted %s t=%.6f", key, now)
            elif isinstance(msg, wire.Streaming):
                if state.streaming(key, peer_engine, generation) is not None:
                    whole = self.parts.streaming(key)
                    if whole is not None:
                        self.started(whole)
                log.debug("kvpush D streaming %s t=%.6f", key, now)
            elif isinstance(msg, wire.Landed):
                if state.landed(key, peer_engine, msg.regions, self._num_regions, generation):
                    self._counters["landed_parts"] += 1
                    self.ready.notify_all()
            else:
                if isinstance(msg, wire.Done):
                    outcome = state.done(key, peer_engine, msg.num_bytes, generation, now)
                elif isinstance(msg, wire.Fail):
                    outcome = state.fail(key, peer_engine, msg.reason, msg.may_still_land, generation, now)
                else:
                    state.quiesced(key, peer_engine, generation)
                    outcome = None
                self.add_parts([outcome] if outcome is not None else [])
                return outcome
            return None

    def _checked(self, msg: wire.Landed | wire.Done, key: str, peer_engine: str, generation: int,
                 now: float) -> Outcome | None:
        """verify_kv: the part's failure if the bytes `msg` announces differ from prefill's digest,
        else None (and `msg` is taken as usual). Hashes without the lock."""
        assert self.check is not None
        with self.lock:
            pending = self.state.pending.get(key)
            if pending is None or pending.peer_engine != peer_engine or pending.generation != generation:
                return None  # not this connection's part: on_message drops it as before
            blocks = pending.block_ids
        if isinstance(msg, wire.Landed):
            counter, why = self.check.landed(key, msg.regions, msg.digest, blocks)
        else:
            counter, why = self.check.done(key, msg.digest, blocks)
        if not why:
            if counter:
                with self.lock:
                    self._counters[counter] += 1
            return None
        with self.lock:
            self._counters[counter] += 1
            if isinstance(msg, wire.Landed):  # P may still be writing the layers after it: fenced, cancelled
                outcome = self.state.give_up(key, why, now)
                if outcome is not None:
                    self._send_cancel(peer_engine, base_name(key))
            else:  # DONE: nothing of it is in flight any more
                outcome = self.state.fail(key, peer_engine, why, False, generation, now)
            self.add_parts([outcome] if outcome is not None else [])
            return outcome

    # ---- lock held -------------------------------------------------------------------------------
    def add_parts(self, outcomes: list[Outcome]) -> None:
        """Parts' outcomes: a transfer's outcome once all its parts have one; the parts still
        running when one fails are cancelled."""
        for part in outcomes:
            if self.check is not None:
                self.check.forget(part.pending.transfer_id)
            whole, cancel, started = self.parts.settle(part)
            if started is not None:
                self.started(started)
            for key in cancel:
                pending = self.state.pending.get(key)
                if pending is not None:
                    self._send_cancel(pending.peer_engine, base_name(key))
            if whole is not None:
                self.add_whole(whole)
        self.collect_unfenced()

    def add_whole(self, outcome: Outcome) -> None:
        self._outcomes.append(outcome)
        self.ready.notify_all()

    def started(self, whole: Pending) -> None:
        self._started.append(whole)
        self.ready.notify_all()

    def collect_unfenced(self) -> None:
        """Fences that ended (P's word, P's death, the backstop): transfers free of writers."""
        for key in self.state.fences.take_ended():
            tid = self.parts.unfenced(key)
            if tid is not None:
                self._unfenced.append(tid)
                self.ready.notify_all()

    # ---- compute thread --------------------------------------------------------------------------
    def take_outcomes(self) -> list[Outcome]:
        with self.lock:
            out, self._outcomes = self._outcomes, []
            return out

    def take(self) -> tuple[list[Pending], list[Outcome], list[str]]:
        """Streamed WRITEs that began, outcomes, and transfers whose fenced blocks are free of
        writers, taken together: a transfer that started and ended since the last call is in the
        first two lists, never in the outcomes alone; one unfenced is in the third only once its
        outcome was handed out (now or before)."""
        with self.lock:
            started, self._started = self._started, []
            outcomes, self._outcomes = self._outcomes, []
            unfenced, self._unfenced = self._unfenced, []
            return started, outcomes, unfenced

    def wait(self, timeout_s: float, even_if_none_pending: bool = False) -> None:
        """Sleep until something is ready to take or `timeout_s` passes; at once when something
        is, or when nothing is pending unless `even_if_none_pending` (vLLM steps for blocks the
        worker holds back, which a fence's end frees)."""
        with self.ready:
            if not (self._outcomes or self._started or self._unfenced) and (self.state.pending or even_if_none_pending):
                self.ready.wait(timeout_s)

    def wait_landed(self, transfer_ids: list[str], regions: tuple[int, ...], timeout_s: float) -> None:
        """Block until those regions of every one of these streamed transfers hold their bytes
        (from every source rank) or the transfer is over or failing. One still short of that after
        `timeout_s` is given up on here (and fenced: its source may still be writing)."""
        deadline = time.monotonic() + timeout_s
        with self.ready:
            while True:
                short = [k for t in transfer_ids if not self.parts.failing(t)
                         for k in self.parts.running(t) if not self.state.has_landed(k, regions)]
                left = deadline - time.monotonic()
                if not short or left <= 0:
                    break
                self.ready.wait(left)
            now = time.monotonic()
            for key in short:
                pending = self.state.pending.get(key)
                if pending is not None:
                    given_up = self.state.give_up(key, f"streamed KV from {pending.peer_engine} did not land "
                                                       f"within {timeout_s:g} s", now)
                    assert given_up is not None, "a pending part is given up"
                    self.add_parts([given_up])
                    self._send_cancel(pending.peer_engine, base_name(key))
