"""The scheduler's check of each request's kv_transfer_params: refused ones move no KV, are counted
by reason and logged once per burst; prefill and decode hand on their prompt's identity."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from types import SimpleNamespace

from kvpush.common.kv_params import EXPIRED, MALFORMED, UNSIGNED, WRONG_ENGINE, WRONG_PROMPT, PromptIdentity, PushParams
from kvpush.connector.scheduler import PushScheduler

KEY = b"k" * 32
NOW = 5_000.0
BS = 4


@dataclass
class Req:
    request_id: str
    prompt_token_ids: list[int]
    kv_transfer_params: dict | None
    num_computed_tokens: int = 0
    cache_salt: str | None = None
    status: object = field(default_factory=lambda: SimpleNamespace(name="FINISHED_ABORTED"))

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


class Blocks:
    def __init__(self, ids):
        self.ids = ids

    def get_block_ids(self):
        return (self.ids,)


def params(role: str, engine: str, ids=None, expires=NOW + 60, key=KEY) -> dict:
    peer = "dep.p0" if role == "consumer" else "dep.d0"
    return PushParams(role, "t1", peer, "h", 5).signed(key, engine, int(expires), ids).to_dict()


def scheduler(producer: bool, key=KEY) -> PushScheduler:
    return PushScheduler(BS, producer, "dep.p0" if producer else "dep.d0", params_key=key, clock=lambda: NOW)


def decode_load(s: PushScheduler, r: Req):
    s.on_new_request(r)
    n, is_async = s.get_num_new_matched_tokens(r, 0)
    s.update_state_after_alloc(r, Blocks([7, 8, 9]), n)
    return n, is_async, s.build_connector_meta(SimpleNamespace(num_scheduled_tokens={}, total_num_scheduled_tokens=0))


def test_decode_with_good_params_registers_with_its_prompts_identity():
    s = scheduler(False)
    r = Req("r", list(range(10)), params("consumer", "dep.d0", list(range(10))), cache_salt="salt")
    n, is_async, meta = decode_load(s, r)
    assert (n, is_async) == (10, True)
    [spec] = meta.recvs
    assert spec.refused == "" and spec.prompt == PromptIdentity.of(range(10), cache_salt="salt")
    assert s.take_refused() == {}


def test_decode_with_refused_params_fails_its_load_without_contacting_prefill():
    """The load is still taken on (blocks allocated, vLLM waits), then fails: the request ends with
    vLLM's load-failure error, which the router retries elsewhere."""
    cases = {UNSIGNED: {**params("consumer", "dep.d0"), "signature": ""},
             EXPIRED: params("consumer", "dep.d0", expires=NOW - 1),
             WRONG_ENGINE: params("consumer", "dep.d1"),
             WRONG_PROMPT: params("consumer", "dep.d0", list(range(100, 110)))}
    for reason, p in cases.items():
        s = scheduler(False)
        _, is_async, meta = decode_load(s, Req("r", list(range(10)), p))
        [spec] = meta.recvs
        assert is_async and reason in spec.refused and spec.report
        assert s.take_refused() == {reason: 1} and s.take_refused() == {}


def test_expiry_is_judged_when_the_request_arrives_not_when_it_is_scheduled():
    now = [NOW]
    s = PushScheduler(BS, False, "dep.d0", params_key=KEY, clock=lambda: now[0])
    r = Req("r", list(range(10)), params("consumer", "dep.d0", expires=NOW + 1))
    s.on_new_request(r)
    now[0] = NOW + 100  # queued behind others
    s.get_num_new_matched_tokens(r, 0)
    s.update_state_after_alloc(r, Blocks([1, 2, 3]), 10)
    assert s.build_connector_meta(SimpleNamespace(num_scheduled_tokens={}, total_num_scheduled_tokens=0)).recvs[0].refused == ""


def test_prefill_with_refused_params_pushes_nothing_and_accepts_nothing():
    s = scheduler(True)
    s.kv_cache_manager = SimpleNamespace(get_block_ids=lambda req_id: ([1, 2, 3],))
    r = Req("r", list(range(10)), params("producer", "dep.p0", expires=NOW - 5))
    s.on_new_request(r)
    s.update_state_after_alloc(r, Blocks([1, 2, 3]), 0)
    meta = s.build_connector_meta(SimpleNamespace(num_scheduled_tokens={"r": 10}, total_num_scheduled_tokens=10))
    assert meta.accepts == [] and meta.sends == []
    assert s.take_refused() == {EXPIRED: 1}


def test_prefill_with_good_params_accepts_with_its_prompts_identity():
    s = scheduler(True)
    r = Req("r", [3, 1, 4, 1, 5], params("producer", "dep.p0"))
    s.on_new_request(r)
    meta = s.build_connector_meta(SimpleNamespace(num_scheduled_tokens={}, total_num_scheduled_tokens=0))
    assert meta.accepts == [("t1", 1, PromptIdentity.of([3, 1, 4, 1, 5]))]


def test_without_a_key_unsigned_params_are_taken():
    """A deployment without a secret: nothing to check them with."""
    s = scheduler(False, key=None)
    unsigned = PushParams("consumer", "t1", "dep.p0", "h", 5).to_dict()
    _, _, meta = decode_load(s, Req("r", list(range(10)), unsigned))
    assert meta.recvs[0].refused == "" and s.take_refused() == {}


def test_malformed_params_are_counted_and_the_request_served_without_transfer():
    s = scheduler(False)
    n, is_async, meta = decode_load(s, Req("r", list(range(10)), {"kvpush_role": "consumer"}))
    assert (n, is_async) == (0, False) and meta.recvs == []
    assert s.take_refused() == {MALFORMED: 1}


def test_a_burst_of_refusals_is_logged_once_per_reason_and_every_one_counted(caplog):
    s = scheduler(False)
    with caplog.at_level(logging.WARNING, logger="kvpush.connector.scheduler"):
        for i in range(20):
            s.on_new_request(Req(f"r{i}", [1, 2, 3], params("consumer", "dep.d1")))
        s.on_new_request(Req("x", [1, 2, 3], params("consumer", "dep.d0", expires=NOW - 1)))
    lines = [r.getMessage() for r in caplog.records if "refused the kv_transfer_params" in r.getMessage()]
    assert len(lines) == 2 and s.take_refused() == {WRONG_ENGINE: 20, EXPIRED: 1}


def test_a_finished_request_is_forgotten():
    s = scheduler(False)
    r = Req("r", list(range(10)), params("consumer", "dep.d0"))
    decode_load(s, r)
    s.request_finished(r, [7, 8, 9])
    assert "r" not in s._checked
