"""StepMarks with stand-in streams and events: each saved step's mark is recorded once, on the
stream taken on the compute thread, by the recorder thread or, if it has not got to it before the
next forward pass, by the compute thread in settle(); with a SaveQueue, a step's pushes are offered
in save order and only once its mark was recorded and reached."""
from __future__ import annotations

import threading

import pytest

from kvpush.connector.metadata import SendSpec
from kvpush.connector.save_order import SaveQueue
from kvpush.connector.step_marks import StepMarks

WAIT_S = 5.0  # bounds waits for the other threads, never reached when the code is right


class Stream:
    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return f"Stream({self.name})"


class Event:
    """A mark recorded on a stand-in stream: reached at once, or failing if the forward failed."""

    def __init__(self, log: list, stream: Stream, error: Exception | None):
        self.log, self.stream, self.error = log, stream, error

    def synchronize(self) -> None:
        self.log.append(("reached", self.stream.name))
        if self.error is not None:
            raise self.error


class Marks:
    """StreamMarks stand-in. The current stream is per thread, as CUDA's is; a record can be held
    (a full launch queue) until the test lets it go."""

    def __init__(self, log: list | None = None):
        self.log = log if log is not None else []
        self._local = threading.local()
        self.records: list[tuple[str, threading.Thread]] = []
        self.entered: dict[str, threading.Event] = {}
        self.gates: dict[str, threading.Event] = {}
        self.record_errors: dict[str, Exception] = {}
        self.forward_errors: dict[str, Exception] = {}
        self._lock = threading.Lock()

    def use(self, name: str) -> None:
        self._local.stream = Stream(name)

    def hold(self, name: str) -> threading.Event:
        self.entered[name] = threading.Event()
        self.gates[name] = threading.Event()
        return self.gates[name]

    def current(self) -> Stream:
        return getattr(self._local, "stream", Stream("default"))

    def record(self, stream: Stream) -> Event:
        if stream.name in self.entered:
            self.entered[stream.name].set()
            assert self.gates[stream.name].wait(WAIT_S), f"record on {stream.name} never let go"
        if stream.name in self.record_errors:
            raise self.record_errors[stream.name]
        with self._lock:
            self.records.append((stream.name, threading.current_thread()))
            self.log.append(("recorded", stream.name))
        return Event(self.log, stream, self.forward_errors.get(stream.name))

    def recorded(self, name: str) -> list[threading.Thread]:
        return [thread for n, thread in self.records if n == name]


class Producer:
    def __init__(self, log: list):
        self.log = log

    def prepare(self, tid, block_ids, peer, peer_tp_size):
        return True

    def offer(self, tid, req_id, block_ids, peer, peer_tp_size):
        self.log.append(("offer", tid))

    def withdraw(self, tid, req_id, reason, peer_tp_size):
        self.log.append(("withdraw", tid, reason))

    def abort(self, tid, reason, peer_tp_size):
        self.log.append(("abort", tid))


def send(tid: str) -> SendSpec:
    return SendSpec(f"req-{tid}", tid, (1, 2, 3), "D")


@pytest.fixture
def marks_and_steps():
    marks = Marks()
    steps = StepMarks(marks)
    yield marks, steps
    for gate in marks.gates.values():
        gate.set()
    steps.close()


def recorded(step) -> bool:
    """Wait for a step's mark to be recorded (WAIT_S bounds a hang only)."""
    if not step._done.acquire(timeout=WAIT_S):
        return False
    step._done.release()
    return True


def in_thread(fn) -> tuple[threading.Thread, list]:
    """Run fn on another thread (standing in for the compute thread while this one watches)."""
    result: list = []
    thread = threading.Thread(target=lambda: result.append(fn()))
    thread.start()
    return thread, result


def test_the_recorder_records_on_the_stream_taken_at_save_not_on_its_own_current_stream(marks_and_steps):
    marks, steps = marks_and_steps
    marks.use("compute")
    step = steps.mark()
    assert recorded(step)
    [recorder] = marks.recorded("compute")
    assert recorder is not threading.current_thread()
    assert marks.recorded("default") == []  # the recorder thread's own current stream
    assert steps.settle() == 0  # nothing left for the compute thread


def test_settle_records_exactly_the_steps_the_recorder_has_not_taken_and_waits_for_the_one_it_holds(marks_and_steps):
    marks, steps = marks_and_steps
    gate = marks.hold("step1")
    marks.use("step1")
    first = steps.mark()
    assert marks.entered["step1"].wait(WAIT_S)  # the recorder is inside step 1's record
    marks.use("step2")
    second = steps.mark()
    marks.use("step3")
    third = steps.mark()
    settling, late = in_thread(steps.settle)  # the next forward pass is about to be launched
    assert recorded(second) and recorded(third)
    assert settling.is_alive() and not first.recorded  # it waits for the record in the recorder's hands
    gate.set()
    settling.join(WAIT_S)
    assert not settling.is_alive() and late == [2] and first.recorded
    assert marks.recorded("step1") != [settling] and len(marks.recorded("step1")) == 1
    assert marks.recorded("step2") == [settling] and marks.recorded("step3") == [settling]
    assert steps.settle() == 0


def test_no_step_is_recorded_twice_however_settle_and_the_recorder_interleave(marks_and_steps):
    marks, steps = marks_and_steps
    saved, late = [], 0
    for i in range(600):
        marks.use(f"s{i}")
        saved.append(steps.mark())
        if i % 3 == 2:
            late += steps.settle()
    late += steps.settle()
    assert all(step.recorded for step in saved)  # settle returns with every saved step recorded
    for i in range(600):
        assert len(marks.recorded(f"s{i}")) == 1
    on_caller = sum(thread is threading.current_thread() for _, thread in marks.records)
    assert late == on_caller


def test_pushes_are_offered_in_save_order_and_each_only_after_its_mark_was_recorded_and_reached():
    log: list = []
    marks = Marks(log)
    steps = StepMarks(marks)
    queue = SaveQueue(Producer(log))
    try:
        gate = marks.hold("step1")
        marks.use("step1")
        queue.submit(steps.mark(), [send("a")])
        assert marks.entered["step1"].wait(WAIT_S)
        marks.use("step2")
        second = steps.mark()
        queue.submit(second, [send("b")], [("x", "request gone", 1)])
        settling, late = in_thread(steps.settle)
        assert recorded(second)  # step 2 marked before step 1 ...
        assert not [e for e in log if e[0] == "offer"]  # ... and still nothing offered
        gate.set()
        settling.join(WAIT_S)
        assert queue.drain(WAIT_S) and late == [1]
        assert log == [("recorded", "step2"), ("recorded", "step1"), ("reached", "step1"), ("offer", "a"),
                       ("reached", "step2"), ("offer", "b"), ("abort", "x")]
    finally:
        steps.close()
        queue.close()


@pytest.mark.parametrize("where", ["forward", "record"])
def test_a_failed_forward_or_a_failed_record_withdraws_the_steps_pushes_and_the_next_step_goes(where):
    log: list = []
    marks = Marks(log)
    error = RuntimeError("CUDA error: an illegal memory access was encountered")
    (marks.forward_errors if where == "forward" else marks.record_errors)["step1"] = error
    steps = StepMarks(marks)
    queue = SaveQueue(Producer(log))
    try:
        marks.use("step1")
        queue.submit(steps.mark(), [send("a"), send("b")])
        marks.use("step2")
        queue.submit(steps.mark(), [send("c")])
        steps.settle()
        assert queue.drain(WAIT_S)
        withdrawn = [e for e in log if e[0] == "withdraw"]
        assert [e[1] for e in withdrawn] == ["a", "b"] and "illegal memory access" in withdrawn[0][2]
        assert [e[1] for e in log if e[0] == "offer"] == ["c"]
    finally:
        steps.close()
        queue.close()


def test_close_marks_every_saved_step_stops_the_recorder_and_abandons_later_marks():
    marks = Marks()
    steps = StepMarks(marks)
    gate = marks.hold("step1")
    marks.use("step1")
    first = steps.mark()
    assert marks.entered["step1"].wait(WAIT_S)
    marks.use("step2")
    second = steps.mark()
    closing, _ = in_thread(steps.close)
    assert recorded(second)  # recorded by close itself: the queue's wait for it ends
    gate.set()
    closing.join(WAIT_S)
    assert not closing.is_alive() and first.recorded and not steps._thread.is_alive()
    marks.use("step3")
    late = steps.mark()  # after shutdown: never recorded, its pushes withdrawn
    assert late.recorded and marks.recorded("step3") == []
    with pytest.raises(RuntimeError, match="shut down"):
        late.synchronize()
