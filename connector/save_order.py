"""P on a GPU: each step's pushes start once the forward pass that wrote their KV is done, and
vLLM's compute thread never waits for that.

`wait_for_save` runs right after vLLM launched a forward pass: its kernels are still queued on the
compute thread's current stream. That is the stream vLLM's model runner launches the forward on
(a stream of its own per worker; CUDA graph replays, the compute of DBO micro-batches and a draft
model run there too), so the KV of every request the step computed is complete once the work
queued there so far is done. The worker hands the step's sends to a `SaveQueue` with a mark of that
point (a CUDA event, recorded off the compute thread: step_marks.py). The queue's own thread makes
each WRITE meanwhile (`Producer.prepare`), waits for the mark, then offers the blocks, which posts
the WRITE. UCX copies on streams of its own that know nothing of vLLM's: the wait on the host is
what puts the copy after the KV. Nothing waits for other work on the GPU (earlier WRITEs still
copying, vLLM's other streams), and the compute thread only queues the step.

Steps are handled in the order they were saved, which is their order on the stream. A forward
pass that failed (waiting for its mark raises) withdraws its pushes: D hears FAIL and the blocks
are freed; vLLM reports the error itself. A decode peer that goes away while a step waits is
handled by the Producer when the blocks are offered, as on any path (refused, blocks freed).
A request's blocks are freed only after its WRITE ended (the Producer's outcome), never when the
step is queued or offered.
"""
from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

from .metadata import SendSpec

log = logging.getLogger(__name__)


class ForwardMark(Protocol):
    """A point on the compute stream: `synchronize` returns once the work queued before it is done
    (a torch.cuda.Event recorded there, step_marks.StepMark), and raises if that work failed."""

    def synchronize(self) -> None: ...


class PushService(Protocol):
    """What the queue asks of the Producer (producer.py)."""

    def prepare(self, transfer_id: str, block_ids: Sequence[int], peer_engine: str, peer_tp_size: int) -> bool: ...

    def offer(
        self, transfer_id: str, req_id: str, block_ids: list[int], peer_engine: str, peer_tp_size: int
    ) -> None: ...

    def withdraw(self, transfer_id: str, req_id: str, reason: str, peer_tp_size: int) -> None: ...

    def abort(self, transfer_id: str, reason: str, peer_tp_size: int) -> None: ...


@dataclass(frozen=True)
class _Step:
    mark: ForwardMark | None  # None: nothing in this step waits for the GPU (aborts only)
    sends: tuple[SendSpec, ...]
    aborts: tuple[tuple[str, str, int], ...]  # (transfer id, reason, decode TP size)


class SaveQueue:
    """The pushes of each saved step, in step order, on a thread of their own."""

    def __init__(self, producer: PushService, name: str = "kvpush-save"):
        self._producer = producer
        # the compute thread's end is one C call (SimpleQueue.put): no lock it could find held
        self._steps: queue.SimpleQueue[_Step | None] = queue.SimpleQueue()
        self._submitted = 0  # steps queued, by the compute thread
        self._handled = 0  # steps handled, by the queue's thread (under _cond, for drain)
        self._cond = threading.Condition(threading.Lock())
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # ---- compute thread ------------------------------------------------------------------------
    def submit(self, mark: ForwardMark | None, sends: Sequence[SendSpec],
               aborts: Sequence[tuple[str, str, int]] = ()) -> None:
        """Queue a step: its sends are offered once `mark` is reached, then its aborts are told."""
        if self._closed:
            log.warning("kvpush: push of %d requests after shutdown dropped", len(sends))
            return
        self._submitted += 1
        self._steps.put(_Step(mark, tuple(sends), tuple(aborts)))

    def drain(self, timeout_s: float) -> bool:
        """Wait until every queued step was handled (its WRITEs posted or refused); False on timeout."""
        submitted = self._submitted
        with self._cond:
            return self._cond.wait_for(lambda: self._handled >= submitted or self._closed, timeout_s)

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop: nothing more is offered, also not the step in hand, and steps still queued are
        dropped (the Producer closes next, which ends every push with its peers)."""
        self._closed = True
        self._steps.put(None)
        with self._cond:
            self._cond.notify_all()
        self._thread.join(timeout_s)  # a forward pass that never ends leaves a daemon thread behind

    # ---- the queue's thread ----------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            step = self._steps.get()
            if step is None or self._closed:
                return
            try:
                self._handle(step)
            finally:
                with self._cond:
                    self._handled += 1
                    self._cond.notify_all()

    def _handle(self, step: _Step) -> None:
        for s in step.sends:  # made while the GPU still computes the KV
            self._guarded(s, "make the WRITE of", self._producer.prepare, s.transfer_id, s.block_ids, s.peer_engine,
                          s.peer_tp_size)
        failure = ""
        if step.mark is not None:
            try:
                step.mark.synchronize()
            except Exception as exc:  # the forward pass itself failed: its KV is not to be trusted
                failure = f"prefill's forward pass failed before its KV was complete: {exc}"
                log.error("kvpush: %s; withdrawing %d pushes", failure, len(step.sends))
        if self._closed:  # the Producer is closing: it takes no more WRITEs
            return
        for s in step.sends:
            if failure:
                self._guarded(s, "withdraw", self._producer.withdraw, s.transfer_id, s.req_id, failure, s.peer_tp_size)
            elif not self._guarded(s, "offer", self._producer.offer, s.transfer_id, s.req_id, list(s.block_ids),
                                   s.peer_engine, s.peer_tp_size):
                self._guarded(s, "withdraw", self._producer.withdraw, s.transfer_id, s.req_id,
                              "prefill error while offering its KV", s.peer_tp_size)
        for tid, reason, peer_tp_size in step.aborts:
            try:
                self._producer.abort(tid, reason, peer_tp_size)
            except Exception:
                log.exception("kvpush: could not tell decode that transfer %s was aborted", tid)

    @staticmethod
    def _guarded(send: SendSpec, what: str, call: Callable[..., Any], *args: Any) -> bool:
        """A bug in one push must cost that push, not the queue's thread (and with it every later push)."""
        try:
            call(*args)
            return True
        except Exception:
            log.exception("kvpush: could not %s transfer %s (request %s)", what, send.transfer_id, send.req_id)
            return False

