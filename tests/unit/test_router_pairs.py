"""router/pairs.py: which pair each attempt at a part goes to after the failures before it."""
from __future__ import annotations

import itertools
import random

import pytest

from kvpush.router.config import Upstream
from kvpush.router.fanout import NO_PREFILL, TRANSFERS_FAILED
from kvpush.router.legs import LegFailure
from kvpush.router.metrics import RouterMetrics
from kvpush.router.pairs import Pair, PartTries
from kvpush.router.pool import Pool


def pool(role: str, n: int, metrics: RouterMetrics) -> Pool:
    p = Pool(role, [Upstream(name=f"{role[0]}{i}", url=f"http://h:{i + 1}", engine_id=f"e.{role}{i}",
                             side_channel_host="h", side_channel_port=i + 1) for i in range(n)],
             "round-robin", 2, metrics)
    for inst in p.instances:
        p.restore(inst)
    return p


def tries(n_prefill: int, n_decode: int) -> PartTries:
    metrics = RouterMetrics()
    return PartTries(pool("prefill", n_prefill, metrics), pool("decode", n_decode, metrics))


def names(pair: Pair | None) -> tuple | None:
    if pair is None:
        return None
    return (pair.prefill.name if pair.prefill else None, pair.decode.name, pair.without_prefill)


def kv_load_failed(pair: Pair) -> LegFailure:
    exc = LegFailure("decode", pair.decode.name, "generation_error", "KV load failed")
    exc.also_avoid.append(("prefill", pair.prefill.name))  # as attempts.py blames a failed load
    return exc


def test_a_failed_kv_load_moves_the_part_to_another_prefill_and_another_decode():
    t = tries(2, 2)
    first = t.next_pair(wants_prefill=True)
    t.failed(first, True, kv_load_failed(first))
    second = t.next_pair(wants_prefill=True)
    assert second.prefill.name != first.prefill.name and second.decode.name != first.decode.name
    assert second.without_prefill is None


def test_once_every_prefill_failed_a_load_decode_computes_the_prompt_on_each_decode_in_turn_then_nothing():
    t = tries(2, 2)
    for _ in range(2):
        pair = t.next_pair(wants_prefill=True)
        t.failed(pair, True, kv_load_failed(pair))
    alone = []
    while (pair := t.next_pair(wants_prefill=True)) is not None:
        assert pair.prefill is None and pair.without_prefill == TRANSFERS_FAILED  # prefills are in rotation
        alone.append(pair.decode.name)
        t.failed(pair, False, LegFailure("decode", pair.decode.name, "http_500", "boom"))
    assert sorted(alone) == ["d0", "d1"] and t.attempts() == 4


def test_a_decode_named_only_by_failed_loads_is_paired_again_with_another_prefill_where_it_is_the_only_one():
    t = tries(2, 1)
    first = t.next_pair(wants_prefill=True)
    t.failed(first, True, kv_load_failed(first))
    assert names(t.next_pair(wants_prefill=True)) == ("p1" if first.prefill.name == "p0" else "p0", "d0", None)


def test_a_decode_that_failed_on_its_own_gets_no_other_prefill_but_may_compute_the_prompt_itself():
    t = tries(2, 1)
    first = t.next_pair(wants_prefill=True)
    t.failed(first, True, LegFailure("decode", "d0", "connect", "refused"))  # no prefill named
    assert names(t.next_pair(wants_prefill=True)) == (None, "d0", TRANSFERS_FAILED)


def test_a_prefills_failure_leaves_its_decode_free_to_take_the_next_transfer():
    t = tries(2, 1)
    first = t.next_pair(wants_prefill=True)
    t.failed(first, True, LegFailure("prefill", first.prefill.name, "connect", "refused"))
    other = "p1" if first.prefill.name == "p0" else "p0"
    assert names(t.next_pair(wants_prefill=True)) == (other, "d0", None)


def test_without_a_prefill_in_rotation_decode_computes_the_prompt_and_says_why():
    t = tries(2, 1)
    for inst in t.prefill.instances:
        t.prefill.eject(inst, "test")
    assert names(t.next_pair(wants_prefill=True)) == (None, "d0", NO_PREFILL)


def test_a_part_that_wants_no_prefill_goes_to_decode_alone_and_is_no_fallback():
    assert names(tries(1, 1).next_pair(wants_prefill=False)) == (None, "d0", None)


def test_nothing_is_left_once_no_decode_is_in_rotation():
    t = tries(1, 1)
    t.decode.eject(t.decode.instances[0], "test")
    assert t.next_pair(wants_prefill=True) is None


@pytest.mark.parametrize("n_prefill,n_decode", [(1, 1), (2, 2), (3, 2), (1, 3)])
def test_whatever_fails_no_pair_is_used_twice_and_the_attempts_end(n_prefill, n_decode):
    rng = random.Random(n_prefill * 10 + n_decode)
    for _ in range(50):
        t = tries(n_prefill, n_decode)
        used = []
        while (pair := t.next_pair(wants_prefill=True)) is not None:
            key = (pair.prefill.name if pair.prefill else None, pair.decode.name)
            assert key not in used
            used.append(key)
            if pair.prefill is None:
                exc = LegFailure("decode", pair.decode.name, "http_500", "boom")
            else:
                exc = rng.choice([kv_load_failed(pair), LegFailure("decode", pair.decode.name, "connect", "x"),
                                  LegFailure("prefill", pair.prefill.name, "http_500", "x")])
            t.failed(pair, pair.prefill is not None, exc)
        assert len(used) <= n_prefill * n_decode + n_decode
        assert {d for p, d in used if p is None} == {f"d{i}" for i in range(n_decode)}  # each decode alone, last


def test_instances_leaving_rotation_between_attempts_are_not_chosen():
    t = tries(2, 2)
    first = t.next_pair(wants_prefill=True)
    t.failed(first, True, LegFailure("prefill", first.prefill.name, "connect", "refused"))
    for inst in itertools.chain(t.prefill.instances, t.decode.instances[:1]):
        if inst.in_rotation:
            (t.prefill if inst.role == "prefill" else t.decode).eject(inst, "test")
    assert names(t.next_pair(wants_prefill=True)) == (None, "d1", NO_PREFILL)


# --- under the prefix-aware policy --------------------------------------------------------------

def prefix_tries(n_prefill: int, n_decode: int, body: dict) -> PartTries:
    metrics = RouterMetrics()
    prefill, decode = pool("prefill", n_prefill, metrics), pool("decode", n_decode, metrics)
    prefill.policy = decode.policy = "prefix-aware"
    from kvpush.router.prefix_policy import PrefixAware

    prefill.prefixes, decode.prefixes = PrefixAware(1.0, 0.25, 1000), PrefixAware(1.0, 0.25, 1000)
    return PartTries(prefill, decode, decode.prompt_of(body, False))


def test_a_retry_avoids_the_failed_pair_even_where_it_holds_the_prompt():
    body = {"model": "m", "prompt": list(range(256))}
    t = prefix_tries(2, 2, body)
    first = t.next_pair(wants_prefill=True)
    # the next part with this prompt would go back to the same pair: it holds the prompt
    again = PartTries(t.prefill, t.decode, t.prompt)
    assert names(again.next_pair(wants_prefill=True)) == names(first)
    t.failed(first, True, kv_load_failed(first))
    second = t.next_pair(wants_prefill=True)
    assert second.prefill.name != first.prefill.name and second.decode.name != first.decode.name


def test_a_retry_after_a_decode_fault_goes_to_the_other_decode_which_then_holds_the_prompt():
    body = {"model": "m", "prompt": list(range(256))}
    t = prefix_tries(1, 2, body)
    first = t.next_pair(wants_prefill=True)
    t.failed(first, True, LegFailure("decode", first.decode.name, "timeout", "slow"))
    second = t.next_pair(wants_prefill=True)
    assert second.decode.name != first.decode.name
    assert t.decode.prefixes.held(second.decode, t.prompt) == 256
    assert t.prefill.prefixes.held(second.prefill, t.prompt) == 256


def test_every_pair_is_tried_once_under_prefix_aware_too():
    body = {"model": "m", "prompt": list(range(256))}
    t = prefix_tries(2, 2, body)
    seen = []
    while (pair := t.next_pair(wants_prefill=True)) is not None:
        seen.append(names(pair))
        t.failed(pair, pair.prefill is not None,
                 kv_load_failed(pair) if pair.prefill else LegFailure("decode", pair.decode.name, "http_500", "x"))
    assert len(seen) == len(set(seen)) and t.attempts() == len(seen) >= 3
