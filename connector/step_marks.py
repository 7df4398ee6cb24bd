"""P on a GPU: where each saved step's forward pass ends on its stream, marked off vLLM's compute
thread.

The mark is a CUDA event, and recording one is a launch: while CUDA's launch queue is full (the
compute thread runs a step ahead of the GPU) the call waits for room, up to ~0.9 ms on an H200
(benchmarks/results/h200-wait-for-save-2026-12-01). So `wait_for_save` only takes the stream the
forward ran on (`mark`: no launch) and a recorder thread of its own records the event there as soon
as it runs. The stream must be taken on the compute thread: a thread's current stream is its own
setting, and the recorder's is not vLLM's.

Why the event still covers the whole forward pass: a stream runs its work in the order it was
enqueued, whichever thread enqueued it, and every kernel of the forward was enqueued before
`wait_for_save`. So any event recorded on that stream afterwards is reached only once the forward's
kernels are done.

What it may cost is lateness: an event recorded after the compute thread launched more work (the
sampler, the next step's forward pass) is reached only after that work too, and the step's WRITE
waits for it. The recorder needs the GIL, which vLLM's Python between steps holds for
milliseconds; so before the next forward pass is launched (`settle`, from
bind_connector_metadata), the compute thread records each step the recorder has not taken yet
itself, and waits for the one the recorder is recording (one record at most). A step's WRITE so
waits at most for the work launched between its forward pass and the next one's, never for a
whole forward pass. Each step is taken off the queue once, under the lock, by the recorder or by
`settle`: it is recorded exactly once.

The recorder is separate from the save queue's thread (save_order.py), which waits for events:
it is never held up behind an earlier step's wait.
"""
from __future__ import annotations

import logging
import threading
from collections import deque
from typing import Any, Protocol

from .save_order import ForwardMark

log = logging.getLogger(__name__)


class StreamMarks(Protocol):
    """The device side of a mark (CudaStreamMarks; stand-ins in tests)."""

    def current(self) -> Any:
        """The calling thread's current stream (no launch)."""

    def record(self, stream: Any) -> ForwardMark:
        """A new mark recorded on `stream` (a launch)."""


class StepMark:
    """One step's ForwardMark, recorded by whoever takes it: the recorder or the compute thread."""

    __slots__ = ("stream", "_recorded", "_mark", "_error")

    def __init__(self, stream: Any):
        self.stream = stream  # the compute thread's stream when the step was saved
        self._recorded = threading.Event()
        self._mark: ForwardMark | None = None
        self._error: BaseException | None = None

    @property
    def recorded(self) -> bool:
        return self._recorded.is_set()

    def _record(self, marks: StreamMarks) -> None:
        try:
            self._mark = marks.record(self.stream)
        except Exception as exc:  # a broken CUDA context: the step's pushes are withdrawn
            log.error("kvpush: could not mark the end of a forward pass on its stream: %s", exc)
            self._error = exc
        finally:
            self._recorded.set()

    def _abandon(self, reason: str) -> None:
        self._error = RuntimeError(reason)
        self._recorded.set()

    def _wait_recorded(self) -> None:
        self._recorded.wait()

    def synchronize(self) -> None:
        """On the save queue's thread: returns once the step's forward pass is done on the GPU;
        raises if it failed, or if its mark could not be recorded."""
        self._recorded.wait()  # set by the recorder, by settle, or by close
        if self._error is not None:
            raise self._error
        assert self._mark is not None
        self._mark.synchronize()


class StepMarks:
    """Marks the end of each saved step's forward pass on its stream, on a thread of its own."""

    def __init__(self, marks: StreamMarks, name: str = "kvpush-mark"):
        self._marks = marks
        self._untaken: deque[StepMark] = deque()
        self._in_hand: StepMark | None = None  # taken by the recorder, maybe not recorded yet
        self._cond = threading.Condition(threading.Lock())
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # ---- compute thread ------------------------------------------------------------------------
    def mark(self) -> StepMark:
        """In wait_for_save: the step's mark-to-be, on the stream the forward was launched on."""
        step = StepMark(self._marks.current())
        with self._cond:
            if self._closed:
                step._abandon("kvpush shut down before the step's forward pass was marked")
                return step
            self._untaken.append(step)
            self._cond.notify()
        return step

    def settle(self) -> int:
        """Before the next forward pass is launched: every saved step marked. Records those the
        recorder has not taken and waits for the one it is recording; returns how many this
        thread recorded."""
        with self._cond:
            if not self._untaken and self._in_hand is None:
                return 0
            mine = list(self._untaken)
            self._untaken.clear()
            in_hand = self._in_hand
        for step in mine:
            step._record(self._marks)
        if in_hand is not None:
            in_hand._wait_recorded()
        if mine:
            log.debug("kvpush: %d forward-pass marks recorded on the compute thread (the recorder had not run)",
                      len(mine))
        return len(mine)

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the recorder. Every step saved so far is marked first (here, if the recorder has
        not), so that the save queue's waits end when the GPU is done; it offers nothing more."""
        self.settle()
        with self._cond:
            self._closed = True
            left = list(self._untaken)  # none, unless a step was saved during close
            self._untaken.clear()
            self._cond.notify_all()
        for step in left:
            step._abandon("kvpush shut down before the step's forward pass was marked")
        self._thread.join(timeout_s)  # a record stuck in a broken driver leaves a daemon thread behind

    # ---- the recorder's thread -------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._untaken or self._closed)
                if self._closed:
                    return
                step = self._untaken.popleft()
                self._in_hand = step
            step._record(self._marks)
            with self._cond:
                self._in_hand = None


class CudaStreamMarks:
    """StreamMarks on a CUDA device: the calling thread's current stream of `device`, and an event
    recorded on a given stream. The event's waiter (the save queue's thread) spins in the driver,
    CUDA's default, without the GIL: a core while a step with pushes computes, as the compute
    thread's own waits do. An event whose waiter sleeps instead (`blocking`) took twice as long to
    record on an H200 and woke its waiter ~1 ms later (benchmarks/NOTES.md)."""

    def __init__(self, device: Any, blocking: bool = False):
        import torch

        self._cuda = torch.cuda
        self.device = device
        self.blocking = blocking

    def current(self) -> Any:
        return self._cuda.current_stream(self.device)

    def record(self, stream: Any) -> ForwardMark:
        event = self._cuda.Event(blocking=self.blocking)
        event.record(stream)
        return event
