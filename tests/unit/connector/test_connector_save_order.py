"""SaveQueue with stand-in forward marks and a stand-in Producer: a step's WRITEs are made while
its forward pass runs, offered only once it is done, in step order, off the caller's thread; a
failed forward pass withdraws its pushes; a broken push costs that push only."""
from __future__ import annotations

import ast
import threading
from pathlib import Path

import pytest

import kvpush.connector
from kvpush.connector.metadata import SendSpec
from kvpush.connector.save_order import SaveQueue

CONNECTOR = Path(kvpush.connector.__file__).parent
WAIT_S = 5.0  # bounds waits for the queue's thread, never reached when the code is right


class Forward:
    """Stand-in for an event on the compute stream: reached when the test says so."""

    def __init__(self, log: list, name: str, error: Exception | None = None):
        self.log, self.name, self.error = log, name, error
        self.done = threading.Event()
        self.waiting = threading.Event()
        self.waited_on: threading.Thread | None = None

    def synchronize(self) -> None:
        self.waited_on = threading.current_thread()
        self.waiting.set()
        assert self.done.wait(WAIT_S), f"{self.name} never finished"
        self.log.append(("done", self.name))
        if self.error is not None:
            raise self.error


class Producer:
    def __init__(self, log: list, broken: frozenset[str] = frozenset()):
        self.log, self.broken = log, broken
        self.threads: set[threading.Thread] = set()
        self.prepared_all = threading.Event()
        self.expected_prepares = 0

    def _note(self, *entry) -> None:
        self.threads.add(threading.current_thread())
        self.log.append(entry)

    def prepare(self, tid, block_ids, peer, peer_tp_size):
        self._note("prepare", tid)
        if sum(e[0] == "prepare" for e in self.log) == self.expected_prepares:
            self.prepared_all.set()
        return True

    def offer(self, tid, req_id, block_ids, peer, peer_tp_size):
        if tid in self.broken:
            raise RuntimeError("bug")
        self._note("offer", tid)

    def withdraw(self, tid, req_id, reason, peer_tp_size):
        self._note("withdraw", tid, reason)

    def abort(self, tid, reason, peer_tp_size):
        self._note("abort", tid)


def send(tid: str) -> SendSpec:
    return SendSpec(f"req-{tid}", tid, (1, 2, 3), "D")


@pytest.fixture
def queue_and_log():
    log: list = []
    producer = Producer(log)
    queue = SaveQueue(producer)
    yield queue, producer, log
    queue.close()


def test_writes_are_made_while_the_forward_runs_and_offered_after_it_off_the_callers_thread(queue_and_log):
    queue, producer, log = queue_and_log
    producer.expected_prepares = 2
    forward = Forward(log, "step1")
    queue.submit(forward, [send("a"), send("b")], [("x", "request gone", 1)])  # returns with the forward running
    assert producer.prepared_all.wait(WAIT_S)
    assert not queue.drain(0.05)  # still waiting for the forward pass
    assert log == [("prepare", "a"), ("prepare", "b")]
    forward.done.set()
    assert queue.drain(WAIT_S)
    assert log == [("prepare", "a"), ("prepare", "b"), ("done", "step1"), ("offer", "a"), ("offer", "b"), ("abort", "x")]
    assert producer.threads == {forward.waited_on} and threading.current_thread() not in producer.threads


def test_steps_are_offered_in_the_order_they_were_saved(queue_and_log):
    queue, _, log = queue_and_log
    first, second = Forward(log, "step1"), Forward(log, "step2")
    queue.submit(first, [send("a")])
    queue.submit(second, [send("b")])
    second.done.set()  # cannot happen on one stream, and must not let step 2 overtake step 1 anyway
    assert not queue.drain(0.05)
    assert ("offer", "b") not in log
    first.done.set()
    assert queue.drain(WAIT_S)
    offers = [e for e in log if e[0] in ("offer", "done")]
    assert offers == [("done", "step1"), ("offer", "a"), ("done", "step2"), ("offer", "b")]


def test_a_failed_forward_withdraws_its_pushes_and_the_next_step_still_goes(queue_and_log):
    queue, _, log = queue_and_log
    failed = Forward(log, "step1", RuntimeError("CUDA error: an illegal memory access was encountered"))
    good = Forward(log, "step2")
    queue.submit(failed, [send("a"), send("b")])
    queue.submit(good, [send("c")])
    failed.done.set()
    good.done.set()
    assert queue.drain(WAIT_S)
    withdrawn = [e for e in log if e[0] == "withdraw"]
    assert [e[1] for e in withdrawn] == ["a", "b"] and "illegal memory access" in withdrawn[0][2]
    assert [e[1] for e in log if e[0] == "offer"] == ["c"]


def test_a_push_that_breaks_is_withdrawn_and_the_others_go_on():
    log: list = []
    queue = SaveQueue(Producer(log, broken=frozenset({"a"})))
    try:
        forward = Forward(log, "step1")
        forward.done.set()
        queue.submit(forward, [send("a"), send("b")])
        assert queue.drain(WAIT_S)
        assert [e[:2] for e in log if e[0] in ("offer", "withdraw")] == [("withdraw", "a"), ("offer", "b")]
    finally:
        queue.close()


def test_aborts_alone_wait_for_no_forward_pass(queue_and_log):
    queue, _, log = queue_and_log
    queue.submit(None, [], [("x", "request gone", 1)])
    assert queue.drain(WAIT_S)
    assert log == [("abort", "x")]


def test_close_returns_while_a_forward_pass_is_still_running_and_nothing_is_offered_after_it():
    log: list = []
    queue = SaveQueue(Producer(log))
    forward = Forward(log, "never")
    queue.submit(forward, [send("a")])
    queue.submit(Forward(log, "queued"), [send("b")])
    assert forward.waiting.wait(WAIT_S)
    queue.close(timeout_s=0.05)  # the thread is still inside the first step's wait
    queue.submit(Forward(log, "late"), [send("c")])  # after shutdown: dropped
    forward.done.set()
    queue._thread.join(WAIT_S)
    assert not queue._thread.is_alive()
    assert [e for e in log if e[0] != "prepare"] == [("done", "never")]  # the Producer is closing: no WRITE


DEVICE_WIDE = {"torch", "torch.cuda", "cuda", "torch.accelerator", "accelerator", "torch.xpu", "torch.mps"}


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        inner = _dotted(node.value)
        return f"{inner}.{node.attr}" if inner else ""
    return ""


def test_no_device_wide_synchronize_anywhere_in_the_connector_and_no_wait_on_the_compute_thread():
    """vLLM's compute thread must never wait for the GPU on a push's behalf: no device-wide
    synchronize anywhere in the connector, and the one wait for an event is the save queue's (a
    StepMark's synchronize is what the queue's thread calls)."""
    device_wide, waits = [], []
    for path in sorted(CONNECTOR.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if "synchronize" not in name.lower():
                continue
            receiver = _dotted(func.value) if isinstance(func, ast.Attribute) else ""
            where = f"{path.name}:{node.lineno} {ast.unparse(func)}"
            if receiver in DEVICE_WIDE or not isinstance(func, ast.Attribute) or name != "synchronize":
                device_wide.append(where)
            else:
                waits.append((path.name, ast.unparse(func)))
    assert device_wide == []
    assert waits == [("save_order.py", "step.mark.synchronize"),  # SaveQueue._handle, on the queue's thread
                     ("step_marks.py", "self._mark.synchronize")]  # StepMark.synchronize, called from there
