"""Selection policies and the out-of-rotation bookkeeping."""
from __future__ import annotations

from kvpush.router.config import Upstream
from kvpush.router.metrics import RouterMetrics
from kvpush.router.pool import InstanceLoad, LeftRotation, Pool


def make_pool(n: int, policy: str = "round-robin", eject_after: int = 2) -> Pool:
    """A pool whose instances all answered their first health probe."""
    ups = [Upstream(name=f"i{k}", url=f"http://h:{k}", engine_id=f"e{k}", side_channel_host="h", side_channel_port=k)
           for k in range(n)]
    pool = Pool("decode", ups, policy, eject_after, RouterMetrics())
    for inst in pool.instances:
        pool.restore(inst)
    return pool


def test_instances_enter_rotation_only_once_seen_healthy():
    ups = [Upstream(name="i0", url="http://h:0", engine_id="e0", side_channel_host="h", side_channel_port=0)]
    pool = Pool("decode", ups, "round-robin", 2, RouterMetrics())
    assert pool.pick() is None
    pool.restore(pool.instances[0])
    assert pool.pick().name == "i0"


def test_round_robin_cycles_all_instances():
    pool = make_pool(3)
    assert [pool.pick().name for _ in range(6)] == ["i0", "i1", "i2", "i0", "i1", "i2"]


def test_avoid_prefers_others_but_falls_back_to_the_same():
    pool = make_pool(2)
    assert {pool.pick(avoid={"i0"}).name for _ in range(4)} == {"i1"}
    single = make_pool(1)
    assert single.pick(avoid={"i0"}).name == "i0"


def test_least_loaded_uses_own_inflight_then_scraped_foreign_load():
    pool = make_pool(3, "least-loaded")
    a, b, c = pool.instances
    pool.leg_started(a)
    pool.leg_started(a)
    pool.leg_started(b)
    assert pool.pick().name == "i2"
    pool.observe_load(c, InstanceLoad(running=5, waiting=1, kv_usage=0.2))  # load from another router
    assert pool.pick().name == "i1"
    pool.leg_ended(a)
    pool.leg_ended(a)
    assert pool.pick().name == "i0"


def test_least_loaded_discounts_its_own_legs_seen_in_the_scrape():
    pool = make_pool(2, "least-loaded")
    a, b = pool.instances
    pool.leg_started(a)
    pool.observe_load(a, InstanceLoad(running=1))  # the one running request is ours
    pool.observe_load(b, InstanceLoad(running=0, kv_usage=0.9))
    assert a.score() == 1.0 and b.score() == 0.9
    assert pool.pick().name == "i1"


def test_ejects_after_consecutive_failures_and_restores():
    pool = make_pool(2, eject_after=2)
    a = pool.instances[0]
    pool.failed(a, "connect")
    pool.succeeded(a)
    pool.failed(a, "connect")
    assert a.in_rotation  # success in between resets the count
    pool.failed(a, "connect")
    assert not a.in_rotation
    assert {pool.pick().name for _ in range(4)} == {"i1"}
    pool.restore(a)
    assert a.in_rotation and {pool.pick().name for _ in range(4)} == {"i0", "i1"}


def test_no_instance_in_rotation_gives_none():
    pool = make_pool(1, eject_after=1)
    pool.failed(pool.instances[0], "connect")
    assert pool.pick() is None


def test_only_an_unreachable_or_unhealthy_instance_is_ejected_not_a_failed_or_slow_generation():
    pool = make_pool(1, eject_after=2)
    inst = pool.instances[0]
    for reason in ("timeout", "stream_idle", "http_500", "generation_error", "bad_answer", "no_kv_transfer_params") * 3:
        pool.failed(inst, reason)
    assert inst.in_rotation and inst.consecutive_failures == 0
    pool.failed(inst, "mid_stream")
    pool.failed(inst, "health")
    assert not inst.in_rotation
    samples = {s.labels["reason"]: s.value for s in pool.metrics.leg_failures.collect()[0].samples if s.name.endswith("_total")}
    assert samples["http_500"] == 3 and samples["health"] == 1  # every failure is still counted


def ups(*names: str, port: int = 0) -> list[Upstream]:
    return [Upstream(name=n, url=f"http://h:{port + k}", engine_id=f"e.{n}", side_channel_host="h", side_channel_port=k)
            for k, n in enumerate(names)]


def test_strict_avoid_gives_none_rather_than_an_avoided_instance():
    pool = make_pool(2)
    assert pool.pick(avoid={"i0", "i1"}) is not None
    assert pool.pick(avoid={"i0", "i1"}, strict=True) is None
    assert pool.pick(avoid={"i0"}, strict=True).name == "i1"


def test_a_new_list_keeps_unchanged_instances_as_they_are_and_adds_new_ones_out_of_rotation():
    pool = Pool("decode", ups("a", "b"), "round-robin", 2, RouterMetrics())
    a, b = pool.instances
    pool.restore(a)
    pool.leg_started(a)
    added, removed = pool.replace(ups("a", "c"))
    assert pool.instances[0] is a and a.in_rotation and a.inflight == 1
    assert [i.name for i in added] == ["c"] and not added[0].in_rotation
    assert removed == [b] and b.removed and not pool.draining  # b carried nothing
    pool.restore(b)
    assert not b.in_rotation  # a removed instance never comes back


def test_a_removed_instance_drains_its_legs_and_transfers_before_it_is_forgotten():
    pool = Pool("prefill", ups("a", "b"), "round-robin", 2, RouterMetrics())
    a = pool.instances[0]
    pool.restore(a)
    pool.leg_started(a)
    pool.transfer_started(a)
    pool.replace(ups("a", "b")[1:])
    draining = lambda: {s.labels["instance"]: s.value for s in pool.metrics.draining.collect()[0].samples}  # noqa: E731
    assert pool.draining == [a] and not a.in_rotation and draining() == {"a": 2}
    assert pool.pick() is None  # a is out, b never answered a probe
    pool.leg_ended(a)
    assert pool.draining == [a] and draining() == {"a": 1}
    pool.transfer_ended(a)
    assert pool.draining == [] and draining() == {"a": 0}


def test_a_changed_address_under_the_same_name_is_a_new_instance():
    pool = Pool("decode", ups("a"), "round-robin", 2, RouterMetrics())
    old = pool.instances[0]
    added, removed = pool.replace(ups("a", port=100))
    assert removed == [old] and added == pool.instances and added[0] is not old


class Answer:
    def __init__(self):
        self.failed_with = None

    def fail(self, exc):
        self.failed_with = exc


def test_ejection_fails_the_answers_still_waiting_on_the_instance():
    pool = make_pool(2, eject_after=2)
    a = pool.instances[0]
    waiting = Answer()
    a.waiting.add(waiting)
    pool.failed(a, "health")
    assert waiting.failed_with is None
    pool.failed(a, "health")
    assert isinstance(waiting.failed_with, LeftRotation) and "i0 left rotation (2 failures in a row" in str(waiting.failed_with)
    assert not a.waiting


def test_a_changed_start_time_counts_a_restart_and_the_first_one_seen_does_not():
    pool = make_pool(1)
    a = pool.instances[0]
    pool.observe_start_time(a, 100.0)
    pool.observe_start_time(a, 100.0)
    pool.observe_start_time(a, None)  # a page that does not say
    assert a.restarts == 0
    pool.observe_start_time(a, 160.0)
    assert a.restarts == 1 and a.start_time == 160.0


# --- prefix-aware ------------------------------------------------------------------------------

def _turns(conversation: int, turns: int, tokens: int = 96) -> list[dict]:
    """A conversation's completion bodies: each turn's prompt is the last one plus an answer and more."""
    rng = __import__("random").Random(conversation)
    prompt, bodies = [], []
    for _ in range(turns):
        prompt = prompt + [rng.randrange(1000) for _ in range(tokens)]
        bodies.append({"model": "m", "prompt": list(prompt)})
        prompt = prompt + [rng.randrange(1000) for _ in range(8)]  # the answer
    return bodies


def _send(pool: Pool, body: dict, chat: bool = False):
    prompt = pool.prompt_of(body, chat)
    inst = pool.pick(prompt=prompt)
    pool.sent(inst, prompt)
    return inst


def test_prefix_aware_sends_each_turn_of_a_conversation_back_to_the_decode_holding_its_history():
    pool = make_pool(3, "prefix-aware")
    conversations = {c: _turns(c, 5) for c in range(6)}
    where: dict[int, set[str]] = {c: set() for c in conversations}
    for turn in range(5):
        for c, bodies in conversations.items():  # turns of the conversations interleave
            where[c].add(_send(pool, bodies[turn]).name)
    assert all(len(names) == 1 for names in where.values())
    assert sorted(len([c for c in where if where[c] == {i.name}]) for i in pool.instances) == [2, 2, 2]


def test_prefix_aware_spreads_unrelated_prompts_like_least_loaded():
    pool = make_pool(3, "prefix-aware")
    chosen = []
    for c in range(6):
        inst = _send(pool, _turns(100 + c, 1)[0])
        pool.leg_started(inst)  # still running
        chosen.append(inst.name)
    assert sorted(chosen) == ["i0", "i0", "i1", "i1", "i2", "i2"]


def test_prefix_aware_leaves_a_holder_loaded_beyond_the_weights_bound():
    pool = make_pool(2, "prefix-aware")  # defaults: prefix 1.0, load 0.5: two legs' worth
    body = _turns(1, 1)[0]
    holder = _send(pool, body)
    pool.leg_started(holder)
    assert all(pool.pick(prompt=pool.prompt_of(body, False)) is holder for _ in range(2))
    pool.leg_started(holder)
    pool.leg_started(holder)
    assert pool.pick(prompt=pool.prompt_of(body, False)) is not holder


def test_prefix_aware_sticks_chat_turns_too():
    pool = make_pool(2, "prefix-aware")
    messages = [{"role": "system", "content": "Be brief. " * 30}]
    where = set()
    for turn in range(4):
        messages = messages + [{"role": "user", "content": f"question {turn} " * 20}]
        where.add(_send(pool, {"model": "m", "messages": messages}, chat=True).name)
        other = _send(pool, {"model": "m", "messages": [{"role": "user", "content": f"unrelated {turn} " * 40}]}, True)
        pool.leg_started(other)  # keeps the other decode busier than the holder
        messages = messages + [{"role": "assistant", "content": f"answer {turn} " * 10}]
    assert len(where) == 1


def test_an_ejected_or_restarted_instance_holds_nothing_by_the_record():
    pool = make_pool(2, "prefix-aware")
    body = _turns(3, 1)[0]
    prompt = pool.prompt_of(body, False)
    inst = _send(pool, body)
    assert pool.prefixes.held(inst, prompt) == prompt.length // 32 * 32
    pool.eject(inst, "test")
    assert pool.prefixes.held(inst, prompt) == 0
    pool.restore(inst)
    pool.sent(inst, prompt)
    pool.observe_start_time(inst, 100.0)
    pool.observe_start_time(inst, 200.0)  # restarted
    assert pool.prefixes.held(inst, prompt) == 0


def test_prefix_aware_counts_hits_and_what_decode_lacks():
    pool = make_pool(2, "prefix-aware")
    metrics = pool.metrics
    first, second = _turns(5, 2)
    _send(pool, first)
    _send(pool, second)
    sample = metrics.registry.get_sample_value
    assert sample("kvpush_router_prompt_length_total", {"unit": "tokens"}) == len(first["prompt"]) + len(second["prompt"])
    # the second turn's decode held the first turn's whole blocks
    held = len(first["prompt"]) // 32 * 32
    assert sample("kvpush_router_prompt_to_move_total", {"unit": "tokens"}) == (
        len(first["prompt"]) + len(second["prompt"]) - held)
    assert sample("kvpush_router_prefix_hit_length_count", {"role": "decode", "unit": "tokens"}) == 2
    assert sample("kvpush_router_prefix_hit_length_sum", {"role": "decode", "unit": "tokens"}) == held
    assert sample("kvpush_router_prefix_record_blocks", {"role": "decode"}) == len(second["prompt"]) // 32


def test_the_record_of_a_pool_is_bounded_by_record_blocks():
    from kvpush.router.config import PrefixAwareSettings

    ups = [Upstream(name=f"i{k}", url=f"http://h:{k}", engine_id=f"e{k}", side_channel_host="h", side_channel_port=k)
           for k in range(2)]
    pool = Pool("decode", ups, "prefix-aware", 2, RouterMetrics(), PrefixAwareSettings(record_blocks=20))
    for inst in pool.instances:
        pool.restore(inst)
    for c in range(10):
        _send(pool, _turns(c, 1, tokens=320)[0])  # 10 blocks each
    assert len(pool.prefixes.record) == 20


def test_other_policies_read_no_prompt():
    assert make_pool(2, "least-loaded").prompt_of({"prompt": "x" * 500}, False) is None
