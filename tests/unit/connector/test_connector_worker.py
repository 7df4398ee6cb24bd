"""Worker-side bookkeeping with stand-in push services: when vLLM hears finished/failed."""
from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from kvpush.connector.metadata import PushMetadata, RecvSpec, SendSpec
from kvpush.connector.state import Outcome, Pending
from kvpush.connector.stats import PushStats
from kvpush.connector.step_marks import StepMarks
from kvpush.connector.worker import PushWorker


class FakeProducer:
    def __init__(self, log=None):
        self.offers, self.freed, self.accepted, self.prepared = [], [], [], []
        self.log = log if log is not None else []

    def prepare(self, *args):
        self.prepared.append(args)
        self.log.append("prepare")
        return True

    def offer(self, *args):
        self.offers.append(args)
        self.log.append("offer")

    def abort(self, *args):
        self.log.append("abort")

    def withdraw(self, *args):
        self.log.append("withdraw")

    def accept(self, tids):
        self.accepted += tids

    def close(self):
        pass

    def take_freed(self):
        freed, self.freed = self.freed, []
        return freed

    def take_records(self):
        return []

    def take_counts(self):
        return {}


class FakeConsumer:
    def __init__(self):
        self.expected, self.outcomes, self.waits, self.started, self.landing_waits = [], [], [], [], []
        self.unfenced: list[str] = []  # transfers whose fenced blocks nothing writes into any more
        self.settled: set[str] = set()  # transfer ids whose outcome was handed out
        self.forced_waits = 0  # idle waits asked for with nothing pending

    def take(self):
        started, self.started = self.started, []
        unfenced, self.unfenced = self.unfenced, []
        return started, self.take_outcomes(), unfenced

    def wait_landed(self, transfer_ids, regions, timeout_s):
        self.landing_waits.append((sorted(transfer_ids), regions))

    def wait_for_outcome(self, timeout_s, even_if_none_pending=False):
        self.waits.append(timeout_s)
        self.forced_waits += even_if_none_pending

    def expect(self, *args):
        self.expected.append(args)

    def cancel(self, tid):
        return tid not in self.settled

    def take_outcomes(self):
        out, self.outcomes = self.outcomes, []
        self.settled.update(o.pending.transfer_id for o in out)
        return out

    dropped: dict = {}

    def take_counts(self):
        counts, self.dropped = self.dropped, {}
        return counts


def worker(producer: bool, late_write_hold_s: float = 30.0) -> PushWorker:
    settings = SimpleNamespace(tp_size=1, is_producer=producer, idle_wait_ms=7.0, transfer_timeout_s=30.0,
                               late_write_hold_s=late_write_hold_s)
    w = PushWorker(settings, num_blocks=10, tp_rank=0)
    if producer:
        w.producer = FakeProducer()
    else:
        w.consumer = FakeConsumer()
    return w


def test_prefill_reports_sent_only_after_scheduler_finished_it():
    w = worker(True)
    w.save(PushMetadata(sends=[SendSpec("r", "t", (1, 2), "D")]))
    w.producer.freed.append("r")
    assert w.get_finished(set()) == (None, None)  # pushed, but vLLM has not finished it yet
    assert w.get_finished({"r", "other"}) == ({"r"}, None)
    assert w.get_finished({"r"}) == (None, None)


def test_prefill_reports_when_push_ends_after_finish():
    w = worker(True)
    w.bind(PushMetadata(accepts=[("t", 1)]))
    assert w.producer.accepted == [("t", 1)]
    w.save(PushMetadata(sends=[SendSpec("r", "t", (1,), "D")]))
    assert w.get_finished({"r"}) == (None, None)
    w.producer.freed.append("r")
    assert w.get_finished(set()) == ({"r"}, None)


class ForwardPass:
    """Stand-in for the event marking the end of the forward pass on its stream: reached when the
    test says."""

    def __init__(self, log: list):
        self.log = log
        self.done = threading.Event()
        self.waited_on: threading.Thread | None = None

    def synchronize(self) -> None:
        self.waited_on = threading.current_thread()
        assert self.done.wait(5)
        self.log.append("forward done")


class StreamMarks:
    """StreamMarks stand-in: records `forward` on the stream taken at save; the first record can be
    held (`gate`)."""

    def __init__(self, forward: ForwardPass):
        self.forward = forward
        self.recorded_on: list[threading.Thread] = []
        self.entered, self.gate, self.recorded = threading.Event(), threading.Event(), threading.Event()
        self.gate.set()
        self._first = True

    def current(self):
        return "compute stream"

    def record(self, stream):
        assert stream == "compute stream"
        if self._first:
            self._first = False
            self.entered.set()
            assert self.gate.wait(5)
        self.recorded_on.append(threading.current_thread())
        self.recorded.set()
        return self.forward


def gpu_worker(forward: ForwardPass) -> tuple[PushWorker, StreamMarks]:
    w = worker(True)
    marks = StreamMarks(forward)
    w._step_marks = StepMarks(marks)
    return w, marks


def test_gpu_prefill_returns_at_once_and_its_blocks_are_freed_only_after_the_write_ended():
    log: list = []
    forward = ForwardPass(log)
    w, marks = gpu_worker(forward)
    w.producer.log = log
    w.save(PushMetadata(sends=[SendSpec("r", "t", (1, 2), "D")], aborts=[("t0", "request gone", 1)]))
    try:
        assert "offer" not in log  # back in vLLM while the forward's kernels still run
        assert w.get_finished({"r"}) == (None, None)
        forward.done.set()
        assert w._saves.drain(5)
        assert log == ["prepare", "forward done", "offer", "abort"]  # the WRITE made ahead, posted after the KV
        assert forward.waited_on not in (None, threading.current_thread())
        assert marks.recorded_on and threading.current_thread() not in marks.recorded_on  # marked off this thread
        assert w.get_finished(set()) == (None, None)  # offered and finished in vLLM, but the WRITE is still on
        w.producer.freed.append("r")  # the Producer saw the WRITE end
        assert w.get_finished(set()) == ({"r"}, None)
    finally:
        w.shutdown()


def test_gpu_prefill_marks_before_the_next_forward_what_the_recorder_has_not_and_counts_it():
    forward = ForwardPass([])
    w, marks = gpu_worker(forward)
    try:
        marks.gate.clear()
        w.save(PushMetadata(sends=[SendSpec("r1", "t1", (1,), "D")]))
        assert marks.entered.wait(5)  # the recorder holds step 1's record (a full launch queue, say)
        w.save(PushMetadata(sends=[SendSpec("r2", "t2", (2,), "D")]))
        binding = threading.Thread(target=w.bind, args=(PushMetadata(),))  # vLLM's compute thread binds
        binding.start()  # the next step's metadata, then launches its forward pass
        assert marks.recorded.wait(5)  # step 2 marked by the compute thread; step 1 still held
        assert marks.recorded_on == [binding] and binding.is_alive()
        marks.gate.set()
        binding.join(5)
        assert not binding.is_alive() and len(marks.recorded_on) == 2  # both marked before the next forward
        assert w.take_stats().data["marks_on_compute_thread"] == 1
        w.bind(PushMetadata())
        assert w.take_stats() is None  # nothing left to mark
        forward.done.set()
        assert w._saves.drain(5)
    finally:
        w.shutdown()


def test_cpu_prefill_offers_at_once():
    w = worker(True)  # no device to wait for: offer makes and posts the WRITE itself
    w.save(PushMetadata(sends=[SendSpec("r", "t", (1, 2), "D")]))
    assert w.producer.log == ["offer"]


def test_gpu_prefill_without_sends_marks_nothing_on_the_stream():
    w, marks = gpu_worker(ForwardPass([]))
    marks.current = lambda: (_ for _ in ()).throw(AssertionError("marked a step with nothing to push"))
    try:
        w.bind(PushMetadata(accepts=[("t", 1)]))
        w.save(PushMetadata())
        assert w.producer.prepared == [] and w.producer.offers == [] and w._saves is None
    finally:
        w.shutdown()


def test_decode_failure_reports_blocks_and_finished():
    w = worker(False)
    w.bind(PushMetadata(recvs=[RecvSpec("r", "t", "P", "h", 5, 1, (3, 4), 0, 200)]))
    assert w.consumer.expected[0][:2] == ("r", "t")
    w.consumer.outcomes.append(Outcome(Pending("t", "r", "P", (3, 4), 0.0), False, "gone"))
    assert w.get_finished(set()) == (None, {"r"})
    assert w.load_errors() == {3, 4} and w.load_errors() == set()
    assert w.take_stats().data["recvs_failed"] == 1


def streaming_decode() -> PushWorker:
    """D with request r's transfer t (blocks 3, 4) reported received as P started streaming it."""
    w = worker(False)
    w._layer_regions, w._all_regions = {"layer.0": (0,), "layer.1": (1,)}, (0, 1)
    w.wait_for_layer("layer.0")  # vLLM's forward passes call the hook
    w.bind(PushMetadata(recvs=[RecvSpec("r", "t", "P", "h", 5, 1, (3, 4), 0, 200)]))
    w.consumer.started.append(Pending("t", "r", "P", (3, 4), 0.0))
    assert w.get_finished(set()) == (None, {"r"})
    return w


def test_without_vllm_calling_the_layer_hook_a_streamed_write_is_reported_at_its_outcome():
    w = worker(False)
    w.bind(PushMetadata(recvs=[RecvSpec("r", "t", "P", "h", 5, 1, (3, 4), 0, 200)]))
    w.consumer.started.append(Pending("t", "r", "P", (3, 4), 0.0))
    assert w.get_finished(set()) == (None, None) and not w._landing
    w.consumer.outcomes.append(Outcome(Pending("t", "r", "P", (3, 4), 0.0), True))
    assert w.get_finished(set()) == (None, {"r"})


def test_streamed_receipt_is_reported_once_and_each_layer_waits_until_the_outcome():
    w = streaming_decode()
    w.bind(PushMetadata(loading=["r"]))
    w.wait_for_layer("layer.1")
    w.wait_for_layer("unknown")  # a layer vLLM did not register with us waits for everything
    assert w.consumer.landing_waits == [(["t"], (1,)), (["t"], (0, 1))]
    w.consumer.outcomes.append(Outcome(Pending("t", "r", "P", (3, 4), 0.0), True, num_bytes=10))
    assert w.get_finished(set()) == (None, None) and w.load_errors() == set()
    w.wait_for_layer("layer.0")
    assert len(w.consumer.landing_waits) == 2  # nothing lands any more: no wait
    stats = w.take_stats().data
    assert stats["recvs_ok"] == 1 and len(stats["layer_wait_s"]) == 1  # one forward pass waited


def test_streamed_failure_is_reported_now_and_in_the_step_that_computes_the_request():
    w = streaming_decode()
    w.consumer.outcomes.append(Outcome(Pending("t", "r", "P", (3, 4), 0.0), False, "gone"))
    assert w.get_finished(set()) == (None, None)
    assert w.load_errors() == {3, 4}  # for a running request that found them in the prefix cache
    assert w.take_evictions() == {3, 4} and w.take_evictions() == set()
    w.bind(PushMetadata())
    assert w.load_errors() == set()  # r is not computed in this step: vLLM would not look for it
    w.bind(PushMetadata(loading=["r"]))
    assert w.load_errors() == {3, 4}
    w.bind(PushMetadata(loading=["r"]))
    assert w.load_errors() == set()


def test_request_cancelled_while_vllm_waited_is_not_reported_when_its_write_starts():
    w = worker(False)
    w._layer_hook_seen = True
    w.bind(PushMetadata(recvs=[RecvSpec("r", "t", "P", "h", 5, 1, (3, 4), 0, 200)]))
    w.bind(PushMetadata(cancels=["t"]))  # aborted while waiting; P had already begun
    w.consumer.started.append(Pending("t", "r", "P", (3, 4), 0.0))
    assert w.get_finished(set()) == (None, None)  # P still writes into r's blocks: do not free them
    w.consumer.outcomes.append(Outcome(Pending("t", "r", "P", (3, 4), 0.0), True))
    assert w.get_finished(set()) == (None, {"r"})


def test_a_write_that_starts_and_ends_between_two_steps_is_reported_once():
    w = worker(False)
    w._layer_hook_seen = True
    w.bind(PushMetadata(recvs=[RecvSpec("r", "t", "P", "h", 5, 1, (3, 4), 0, 200)]))
    w.consumer.started.append(Pending("t", "r", "P", (3, 4), 0.0))
    w.consumer.outcomes.append(Outcome(Pending("t", "r", "P", (3, 4), 0.0), True))
    assert w.get_finished(set()) == (None, {"r"})
    assert w.get_finished(set()) == (None, None) and not w._landing


def test_request_ended_while_its_kv_lands_is_reported_again_after_the_outcome():
    w = streaming_decode()
    w.bind(PushMetadata(releases=[("r", "t")]))
    assert w.get_finished(set()) == (None, None)  # P may still be writing into r's blocks
    w.consumer.outcomes.append(Outcome(Pending("t", "r", "P", (3, 4), 0.0), False, "cancelled"))
    assert w.get_finished(set()) == (None, {"r"}) and w.load_errors() == set()
    assert w.take_evictions() == {3, 4}  # freed with whatever landed: not for the prefix cache


def test_request_ended_after_its_kv_landed_is_reported_again_at_once():
    w = worker(False)
    w.bind(PushMetadata(recvs=[RecvSpec("r", "t", "P", "h", 5, 1, (3, 4), 0, 200)]))
    w.consumer.outcomes.append(Outcome(Pending("t", "r", "P", (3, 4), 0.0), True))
    assert w.get_finished(set()) == (None, {"r"})
    w.bind(PushMetadata(releases=[("r", "t")]))
    assert w.get_finished(set()) == (None, {"r"})


def test_decode_notify_only_transfer_is_not_reported():
    w = worker(False)
    w.bind(PushMetadata(recvs=[RecvSpec("r", "t", "P", "h", 5, 1, (), 2, 0, report=False)]))
    w.consumer.outcomes.append(Outcome(Pending("t", "r", "P", (), 0.0), True))
    assert w.get_finished(set()) == (None, None)


def test_decode_hands_the_prefills_tp_size_and_base_port_to_the_consumer():
    """Which prefill ranks to register with (and their ports, base + rank) follow from the
    prefill's TP size: the consumer decides, for every rank of this decode alike."""
    w = worker(False)
    w.tp_rank = 1
    w.bind(PushMetadata(recvs=[RecvSpec("r", "t", "P", "h", 5, 2, (3,), 0, 100)]))
    assert w.consumer.expected == [("r", "t", "P", "h", 5, [3], 0, 100, 2, None, "")]


def test_stats_reduce_and_aggregate():
    a, b = PushStats(), PushStats()
    a.data["sends_ok"], a.data["send_bytes"], a.data["prefill_end_to_done_s"] = 1, [100], [0.002]
    b.data["sends_failed"] = 1
    merged = a.aggregate(b).reduce()
    assert merged["sends_ok"] == 1 and merged["sends_failed"] == 1 and merged["send_bytes_total"] == 100
    assert merged["prefill_end_to_done_p50_ms"] == 2.0 and not a.is_empty() and PushStats().is_empty()


def test_decode_sleeps_for_an_outcome_only_in_a_step_that_computes_nothing():
    w = worker(False)
    w.bind(PushMetadata(recvs=[RecvSpec("r", "t", "P", "h", 5, 1, (3,), 0, 100)], idle=True))
    w.consumer.outcomes.append(Outcome(Pending("t", "r", "P", (3,), 0.0), True))
    assert w.get_finished(set()) == (None, {"r"}) and w.consumer.waits == [0.007]
    w.bind(PushMetadata(idle=False))  # a forward ran: report at once, never hold the step up
    w.get_finished(set())
    assert w.consumer.waits == [0.007]


def test_dropped_and_refused_messages_reach_vllms_stats():
    w = worker(producer=False)
    w.consumer.dropped = {"malformed": 2, "unknown_done": 1}
    assert w.take_stats().data["dropped"] == {"malformed": 2, "unknown_done": 1}
    assert w.take_stats() is None  # nothing new since


def late_failure(tid="t", req="r") -> Outcome:
    """D gave up on P (silent), which may still be writing into the blocks: the consumer fenced them."""
    return Outcome(Pending(tid, req, "P", (3, 4), 0.0), False, "no answer", may_still_land=True)


def test_a_request_whose_prefill_went_silent_fails_now_but_its_blocks_wait_for_the_fence_to_end():
    w = worker(False)
    w.bind(PushMetadata(recvs=[RecvSpec("r", "t", "P", "h", 5, 1, (3, 4), 0, 200)]))
    w.consumer.outcomes.append(late_failure())
    # load errors now (vLLM fails the request at once), "received" (vLLM frees its blocks) only later
    assert w.get_finished(set()) == (None, None) and w.load_errors() == {3, 4}
    w.bind(PushMetadata(cancels=["t"], idle=True))  # vLLM ended the request: nothing left to cancel
    for _ in range(3):  # however many steps pass: no timer frees them here
        assert w.get_finished(set()) == (None, None) and not w._cancelled
    assert w.consumer.forced_waits == 3  # the idle step sleeps: vLLM keeps stepping for held blocks
    w.consumer.unfenced.append("t")  # prefill's QUIESCED, its death, or the consumer's backstop
    assert w.get_finished(set()) == (None, {"r"})
    assert w.get_finished(set()) == (None, None) and not w._fenced and not w._held


def test_a_late_write_after_a_normal_finish_keeps_the_blocks_held():
    """A 1-token prompt whose streamed WRITE was given up on while it ran: vLLM recomputes the
    token itself, does not fail the request in its first step and finishes it normally
    (max_tokens 1). Its blocks stay held until the fence ends, and once more reported as load errors."""
    w = streaming_decode()
    w.bind(PushMetadata(loading=["r"]))
    w.consumer.outcomes.append(late_failure())
    assert w.get_finished(set()) == (None, None) and w.load_errors() == {3, 4}
    w.bind(PushMetadata(releases=[("r", "t")]))  # finished normally: the scheduler hands its blocks over
    assert w.get_finished(set()) == (None, None)  # held: prefill may still write
    w.consumer.unfenced.append("t")
    assert w.get_finished(set()) == (None, {"r"})


def test_a_request_that_finished_normally_with_its_transfer_done_is_reported_at_once():
    w = worker(False)
    w.bind(PushMetadata(recvs=[RecvSpec("r", "t", "P", "h", 5, 1, (3, 4), 0, 200)]))
    w.consumer.outcomes.append(Outcome(Pending("t", "r", "P", (3, 4), 0.0), True))
    assert w.get_finished(set()) == (None, {"r"})
    w.bind(PushMetadata(loading=["r"]))
    w.bind(PushMetadata(releases=[("r", "t")], idle=True))
    assert w.get_finished(set()) == (None, {"r"}) and w.consumer.waits == []  # reported without an idle sleep


def test_a_streamed_request_failed_while_running_is_held_when_vllm_hands_it_back():
    w = streaming_decode()
    w.consumer.outcomes.append(late_failure())
    assert w.get_finished(set()) == (None, None) and w.load_errors() == {3, 4}
    w.bind(PushMetadata(releases=[("r", "t")]))  # vLLM failed it and left its blocks to us
    assert w.get_finished(set()) == (None, None)
    w.consumer.unfenced.append("t")
    assert w.get_finished(set()) == (None, {"r"})


def test_a_streamed_request_given_up_on_while_running_is_reported_every_step_until_its_fence_ends():
    """vLLM fails a request only for blocks computed before the step: in the request's first step
    (the one that computed its prompt's last token itself) the last block is not among them, so a
    single report would leave it running while P's late WRITE lands in the slots it generates into.
    Once nothing writes there any more, one last report covers a WRITE that landed after the
    request last computed those blocks."""
    w = streaming_decode()
    w.bind(PushMetadata(loading=["r"]))
    w.consumer.outcomes.append(late_failure())
    assert w.get_finished(set()) == (None, None) and w.load_errors() == {3, 4}
    for _ in range(3):  # vLLM did not act on it: still running
        w.bind(PushMetadata())
        assert w.load_errors() == {3, 4}
    w.consumer.unfenced.append("t")
    assert w.get_finished(set()) == (None, None)  # the request still runs: nothing to report received
    assert w.load_errors() == {3, 4} and w.load_errors() == set()
    w.bind(PushMetadata(releases=[("r", "t")]))  # vLLM ended it: nothing writes there, free at once
    assert w.get_finished(set()) == (None, {"r"})


def test_a_streamed_failure_that_cannot_land_later_is_reported_only_where_vllm_looks():
    w = streaming_decode()
    w.bind(PushMetadata(loading=["r"]))
    w.consumer.outcomes.append(Outcome(Pending("t", "r", "P", (3, 4), 0.0), False, "P said FAIL"))
    assert w.get_finished(set()) == (None, None) and w.load_errors() == {3, 4}
    w.bind(PushMetadata())
    assert w.load_errors() == set()


def test_a_request_that_ended_while_its_kv_was_awaited_is_held_after_a_late_failure():
    w = worker(False)
    w.bind(PushMetadata(recvs=[RecvSpec("r", "t", "P", "h", 5, 1, (3, 4), 0, 200)]))
    w.bind(PushMetadata(cancels=["t"]))
    w.consumer.outcomes.append(late_failure())
    assert w.get_finished(set()) == (None, None)
    w.consumer.unfenced.append("t")
    assert w.get_finished(set()) == (None, {"r"})


def test_a_failure_prefill_reported_itself_frees_at_once():
    w = worker(False)
    w.bind(PushMetadata(recvs=[RecvSpec("r", "t", "P", "h", 5, 1, (3, 4), 0, 200)]))
    w.consumer.outcomes.append(Outcome(Pending("t", "r", "P", (3, 4), 0.0), False, "WRITE failed"))
    assert w.get_finished(set()) == (None, {"r"})
    w.bind(PushMetadata(releases=[("r", "t")]))
    assert w.get_finished(set()) == (None, {"r"})


@pytest.mark.parametrize("found, watched", [({7: "VLLM::Worker_TP1"}, True),
                                            ({7: "VLLM::Worker_TP1", 8: "VLLM::Worker_TP1"}, False),  # a stranger too
                                            ({}, False)])
def test_prefill_watches_its_siblings_only_when_exactly_its_other_local_ranks_are_found(monkeypatch, found, watched):
    w = worker(True)
    w.settings.local_ranks = 2
    calls = []
    w.producer.watch_siblings = lambda handles, gone, on_lost: calls.append((handles, gone))
    monkeypatch.setattr("kvpush.connector.worker.sibling_ranks", lambda: found)
    monkeypatch.setattr("kvpush.connector.worker.exit_handles", lambda pids: ({}, [f"{t} (pid {p})" for p, t in pids.items()]))
    w._watch_siblings()
    assert calls == ([({}, ["VLLM::Worker_TP1 (pid 7)"])] if watched else [])


def test_the_late_write_backstop_is_its_own_series_not_a_dropped_message():
    w = worker(producer=False)
    w.consumer.dropped = {"late_write_backstop": 2, "stale_generation": 1}
    data = w.take_stats().data
    assert data["late_write_backstops"] == 2 and data["dropped"] == {"stale_generation": 1}
