"""Scheduler-side bookkeeping with stand-in vLLM objects: what goes into each step's metadata."""
from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from kvpush.common.kv_params import ParamsError, PromptIdentity, PushParams
from kvpush.connector.scheduler import PushScheduler

BS = 4


@dataclass
class Req:
    request_id: str
    prompt_token_ids: list[int]
    kv_transfer_params: dict | None
    num_computed_tokens: int = 0
    status: object = field(default_factory=lambda: SimpleNamespace(name="FINISHED_ABORTED"))

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


def params(role: str, tid: str = "t1") -> dict:
    return {"kvpush_role": role, "transfer_id": tid, "peer_engine_id": "X.e", "peer_host": "h", "peer_port": 5, "peer_tp_size": 1}


class Blocks:
    def __init__(self, ids):
        self.ids = ids

    def get_block_ids(self):
        return (self.ids,)


def sched_out(**scheduled):
    return SimpleNamespace(num_scheduled_tokens=scheduled, total_num_scheduled_tokens=sum(scheduled.values()))


def test_params_parse_and_reject():
    assert PushParams.parse(None) is None and PushParams.parse({"do_remote_decode": True}) is None
    assert PushParams.parse(params("consumer")).peer_port == 5
    with pytest.raises(ParamsError):
        PushParams.parse({**params("consumer"), "kvpush_role": "both"})
    with pytest.raises(ParamsError):
        PushParams.parse({"kvpush_role": "producer"})


def test_decode_loads_whole_prompt_async_and_registers_at_alloc():
    s = PushScheduler(BS, is_producer=False, engine_id="D.e")
    r = Req("r", list(range(10)), params("consumer"))
    assert s.get_num_new_matched_tokens(r, 0) == (10, True)
    s.update_state_after_alloc(r, Blocks([7, 3, 9]), 10)
    [recv] = s.build_connector_meta(sched_out()).recvs
    assert recv.block_ids == (7, 3, 9) and recv.first_block == 0 and recv.report
    # vLLM calls again after the load: nothing more to load, nothing re-registered
    assert s.get_num_new_matched_tokens(r, 0) == (0, False)
    s.update_state_after_alloc(r, Blocks([7, 3, 9, 11]), 0)
    assert s.build_connector_meta(sched_out()).recvs == []


def test_decode_local_prefix_hit_registers_only_the_rest():
    s = PushScheduler(BS, is_producer=False, engine_id="D.e")
    r = Req("r", list(range(10)), params("consumer"))
    assert s.get_num_new_matched_tokens(r, 8) == (2, True)
    s.update_state_after_alloc(r, Blocks([1, 2, 5]), 2)
    [recv] = s.build_connector_meta(sched_out()).recvs
    assert recv.block_ids == (5,) and recv.first_block == 2


def test_decode_full_local_hit_only_tells_prefill():
    s = PushScheduler(BS, is_producer=False, engine_id="D.e")
    r = Req("r", list(range(8)), params("consumer"))
    assert s.get_num_new_matched_tokens(r, 8) == (0, False)
    s.update_state_after_alloc(r, Blocks([1, 2]), 0)
    [recv] = s.build_connector_meta(sched_out()).recvs
    assert recv.block_ids == () and not recv.report
    assert s.request_finished(r, [1, 2]) == (False, None)


def test_decode_abort_while_waiting_cancels_and_holds_blocks():
    s = PushScheduler(BS, is_producer=False, engine_id="D.e")
    r = Req("r", list(range(5)), params("consumer"))
    s.get_num_new_matched_tokens(r, 0)
    s.update_state_after_alloc(r, Blocks([1, 2]), 5)
    s.build_connector_meta(sched_out())
    assert s.request_finished(r, [1, 2]) == (True, None)
    assert s.build_connector_meta(sched_out()).cancels == ["t1"]
    s.update_connector_output(None, {"r"})
    assert s.request_finished(r, [1, 2]) == (False, None)


def test_decode_abort_before_worker_saw_it_frees_at_once():
    s = PushScheduler(BS, is_producer=False, engine_id="D.e")
    r = Req("r", list(range(5)), params("consumer"))
    s.get_num_new_matched_tokens(r, 0)
    s.update_state_after_alloc(r, Blocks([1, 2]), 5)
    assert s.request_finished(r, [1, 2]) == (False, None)
    assert s.build_connector_meta(sched_out()).recvs == []


def received_request(s: PushScheduler) -> Req:
    r = Req("r", list(range(5)), params("consumer"))
    s.get_num_new_matched_tokens(r, 0)
    s.update_state_after_alloc(r, Blocks([1, 2]), 5)
    s.build_connector_meta(sched_out())
    s.update_connector_output(None, {"r"})  # the worker reported it received (maybe still landing)
    return r


def test_decode_names_a_received_request_in_the_step_that_first_computes_it():
    s = PushScheduler(BS, is_producer=False, engine_id="D.e")
    r = received_request(s)
    assert s.build_connector_meta(sched_out(other=1)).loading == []
    assert s.build_connector_meta(sched_out(r=1)).loading == ["r"]
    assert s.build_connector_meta(sched_out(r=1)).loading == []
    assert s.request_finished(r, [1, 2]) == (True, None)  # computed; the worker says when nothing can land
    assert s.build_connector_meta(sched_out()).releases == [("r", "t1")]


def test_decode_abort_after_receipt_before_computing_holds_blocks_until_reported_again():
    s = PushScheduler(BS, is_producer=False, engine_id="D.e")
    r = received_request(s)
    assert s.request_finished(r, [1, 2]) == (True, None)
    meta = s.build_connector_meta(sched_out())
    assert meta.releases == [("r", "t1")] and meta.cancels == [] and meta.loading == []


def test_prefill_marks_request_in_the_step_its_prefill_completes():
    s = PushScheduler(BS, is_producer=True, engine_id="P.e")
    s.kv_cache_manager = SimpleNamespace(get_block_ids=lambda rid: ([4, 6, 8],))
    r = Req("r", list(range(10)), params("producer"))
    s.on_new_request(r)
    s.update_state_after_alloc(r, Blocks([4, 6]), 0)
    meta = s.build_connector_meta(sched_out(r=6))  # first chunk: 6 of 10
    assert meta.sends == [] and meta.accepts == [("t1", 1, PromptIdentity.of(range(10)))]
    r.num_computed_tokens = 6
    [send] = s.build_connector_meta(sched_out(r=4)).sends
    assert send.block_ids == (4, 6, 8) and send.peer_engine == "X.e"
    assert s.has_pending_push_work()
    assert s.request_finished(r, [4, 6, 8]) == (True, None)
    s.update_connector_output({"r"}, None)
    assert not s.has_pending_push_work()


def test_prefill_abort_before_completion_frees_and_tells_decode():
    s = PushScheduler(BS, is_producer=True, engine_id="P.e")
    r = Req("r", list(range(10)), params("producer"))
    s.update_state_after_alloc(r, Blocks([4]), 0)
    assert s.request_finished(r, [4]) == (False, None)
    [(tid, reason, peer_tp_size)] = s.build_connector_meta(sched_out()).aborts
    assert tid == "t1" and "FINISHED_ABORTED" in reason


def test_prefill_abort_while_still_queued_tells_decode():
    s = PushScheduler(BS, is_producer=True, engine_id="P.e")
    r = Req("r", list(range(10)), params("producer"))
    s.on_new_request(r)  # never scheduled
    assert s.request_finished(r, []) == (False, None)
    assert s.build_connector_meta(sched_out()).aborts[0][0] == "t1"


def test_requests_without_kvpush_params_are_untouched():
    for producer in (True, False):
        s = PushScheduler(BS, is_producer=producer, engine_id="E")
        r = Req("r", [1, 2, 3], None)
        assert s.get_num_new_matched_tokens(r, 0) == (0, False)
        s.update_state_after_alloc(r, Blocks([1]), 0)
        assert s.request_finished(r, [1]) == (False, None)
        meta = s.build_connector_meta(sched_out(r=3))
        assert not (meta.sends or meta.recvs or meta.aborts or meta.cancels)


def test_a_step_that_computes_nothing_is_marked_idle():
    s = PushScheduler(BS, is_producer=False, engine_id="D.e")
    assert s.build_connector_meta(sched_out()).idle
    assert not s.build_connector_meta(sched_out(r=1)).idle


def test_decode_drops_blocks_of_a_failed_streamed_write_from_the_prefix_cache():
    from kvpush.connector.metadata import Evictions

    s = PushScheduler(BS, is_producer=False, engine_id="D.e")
    evicted = []
    s.kv_cache_manager = SimpleNamespace(evict_blocks=evicted.append)
    tp_ranks = Evictions(frozenset({3})).aggregate(Evictions(frozenset({4})))
    s.evict(tp_ranks.blocks)
    assert evicted == [{3, 4}]


@pytest.mark.parametrize("finished", ["FINISHED_ERROR", "FINISHED_LENGTH_CAPPED", "FINISHED_STOPPED", "FINISHED_ABORTED"])
def test_decode_request_that_finishes_after_computing_leaves_its_blocks_to_the_worker_whatever_the_reason(finished):
    """A streamed WRITE given up on while its request ran may still be landing: vLLM may fail the
    request for it, or (a 1-token prompt, recomputed in its first step) let it finish normally,
    or abort it. In every case its blocks wait for the worker's word that nothing writes there."""
    s = PushScheduler(BS, is_producer=False, engine_id="D.e")
    r = received_request(s)
    assert s.build_connector_meta(sched_out(r=1)).loading == ["r"]
    r.status = SimpleNamespace(name=finished)
    assert s.request_finished(r, [1, 2]) == (True, None)
    assert s.build_connector_meta(sched_out()).releases == [("r", "t1")]


def test_decode_request_without_a_transfer_frees_its_blocks_at_once():
    s = PushScheduler(BS, is_producer=False, engine_id="D.e")
    plain = Req("p", list(range(5)), None, status=SimpleNamespace(name="FINISHED_LENGTH_CAPPED"))
    assert s.request_finished(plain, [1]) == (False, None)
