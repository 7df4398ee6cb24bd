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
bind_connector_metadata), the compute thread records each step the recorder has not claimed
itself, and waits for the one the recorder is recording (one record at most). A step's WRITE so
waits at most for the work launched between its forward pass and the next one's, never for a
whole forward pass. Each step is claimed once (a lock taken without waiting, by the recorder or by
`settle`, whichever comes first): it is recorded exactly once.

The compute thread's part is a few C calls (the stream, two locks, a queue put), none of which
lets go of the GIL or waits for a lock another thread holds (only CPython's forced switch, after
another thread waited 5 ms for the GIL, can still stop it there). The recorder is
separate from the save queue's thread (save_order.py), which waits for events: it is never held
up behind an earlier step's wait.
"""
from __future__ import annotations

import logging
import queue
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
        """A new mark recorded on `stream`, as `current` gave it (a launch)."""


class StepMark:
    """One step's ForwardMark, recorded by whoever claims it first: the recorder or the compute
    thread. Built from two plain locks, whose calls are C calls that never let go of the GIL: the
    compute thread makes one per push step, and each Python-level step there costs it time."""

    __slots__ = ("stream", "_claim", "_done", "_mark", "_error")

    def __init__(self, stream: Any):
        self.stream = stream  # the compute thread's stream when the step was saved
        self._claim = threading.Lock()  # taken once, by whoever records the mark
        self._done = threading.Lock()  # held until the mark is recorded (or abandoned)
        self._done.acquire()
        self._mark: ForwardMark | None = None
        self._error: BaseException | None = None

    @property
    def recorded(self) -> bool:
        return not self._done.locked()

    def _claimed(self) -> bool:
        return self._claim.acquire(False)

    def _record(self, marks: StreamMarks) -> None:
        """By the claimer only."""
        try:
            self._mark = marks.record(self.stream)
        except Exception as exc:  # a broken CUDA context: the step's pushes are withdrawn
            log.error("kvpush: could not mark the end of a forward pass on its stream: %s", exc)
            self._error = exc
        finally:
            self._done.release()

    def _abandon(self, reason: str) -> None:
        """By the claimer only."""
        self._error = RuntimeError(reason)
        self._done.release()

    def _wait_recorded(self) -> None:
        with self._done:
            pass

    def synchronize(self) -> None:
        """On the save queue's thread: returns once the step's forward pass is done on the GPU;
        raises if it failed, or if its mark could not be recorded."""
        self._wait_recorded()  # recorded by the recorder, by settle, or abandoned by close
        if self._error is not None:
            raise self._error
        assert self._mark is not None
        self._mark.synchronize()


class StepMarks:
    """Marks the end of each saved step's forward pass on its stream, on a thread of its own."""

    def __init__(self, marks: StreamMarks, name: str = "kvpush-mark"):
        self._marks = marks
        self._queue: queue.SimpleQueue[StepMark | None] = queue.SimpleQueue()  # to the recorder
        self._pending: deque[StepMark] = deque()  # saved and maybe not recorded: the compute thread's
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # ---- compute thread ------------------------------------------------------------------------
    def mark(self) -> StepMark:
        """In wait_for_save: the step's mark-to-be, on the stream the forward was launched on."""
        step = StepMark(self._marks.current())
        if self._closed:
            step._claimed()
            step._abandon("kvpush shut down before the step's forward pass was marked")
            return step
        self._pending.append(step)
        self._queue.put(step)
        return step

    def settle(self) -> int:
        """Before the next forward pass is launched: every saved step marked. Records those the
        recorder has not claimed and waits for those it has (one record at most is still under
        way); returns how many this thread recorded."""
        mine, theirs = 0, []
        while self._pending:
            step = self._pending.popleft()
            if step._claimed():
                step._record(self._marks)
                mine += 1
            else:
                theirs.append(step)
        for step in theirs:
            step._wait_recorded()
        if mine:
            log.debug("kvpush: %d forward-pass marks recorded on the compute thread (the recorder had not run)",
                      mine)
        return mine

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the recorder. Every step saved so far is marked first (here, if the recorder has
        not), so that the save queue's waits end when the GPU is done; it offers nothing more."""
        self.settle()
        self._closed = True
        self._queue.put(None)
        self._thread.join(timeout_s)  # a record stuck in a broken driver leaves a daemon thread behind

    # ---- the recorder's thread -------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            step = self._queue.get()
            if step is None:
                return
            if step._claimed():  # else settle took it
                step._record(self._marks)


class CudaStreamMarks:
    """StreamMarks on a CUDA device.

    `current` takes the calling thread's current stream of the device as torch's (stream id,
    device index, device type) triple: one C call. torch.cuda.current_stream() wraps that triple
    in a Stream object, which cost the compute thread ~65 us on an H200 right after a 16k-token
    prefill's launches (6 us at rest); the recorder makes the object from the triple instead.

    The event's waiter (the save queue's thread) spins in the driver, CUDA's default, without the
    GIL: a core while a step with pushes computes, as the compute thread's own waits do. An event
    whose waiter sleeps instead (`blocking`) took twice as long to record on an H200 and woke its
    waiter ~1 ms later (benchmarks/notes/gpu-wait-for-save.md, "Spinning rather than sleeping on the event")."""

    def __init__(self, device: Any, blocking: bool = False):
        import torch

        self._cuda = torch.cuda
        self.device = torch.device(device)
        self.blocking = blocking
        index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        take = getattr(torch._C, "_cuda_getCurrentStream", None)
        self._take = (lambda: take(index)) if take is not None else (lambda: self._cuda.current_stream(index))

    def current(self) -> Any:
        return self._take()

    def record(self, stream: Any) -> ForwardMark:
        if isinstance(stream, tuple):
            stream_id, device_index, device_type = stream
            stream = self._cuda.Stream(stream_id=stream_id, device_index=device_index, device_type=device_type)
        event = self._cuda.Event(blocking=self.blocking)
        event.record(stream)
        return event
