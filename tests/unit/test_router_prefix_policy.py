"""router/prefix_policy.py: the bounded record of what went where, and the choice it feeds."""
from __future__ import annotations

import random

from kvpush.router.config import Upstream
from kvpush.router.pool import Instance
from kvpush.router.prefix_policy import PrefixAware, PrefixRecord
from kvpush.router.prompt_blocks import prompt_blocks


def keys(*blocks: int) -> list[int]:
    return [hash(("chain",) + blocks[:i + 1]) for i in range(len(blocks))]


def instance(name: str, inflight: int = 0) -> Instance:
    inst = Instance(Upstream(name=name, url="http://h:1", engine_id=name, side_channel_host="h", side_channel_port=1),
                    "decode")
    inst.inflight = inflight
    return inst


def test_held_counts_the_leading_blocks_recorded_for_that_instance_only():
    record = PrefixRecord(100)
    record.add(1, keys(1, 2, 3))
    assert record.held(1, keys(1, 2, 3, 4, 5)) == 3
    assert record.held(1, keys(1, 2, 9)) == 2
    assert record.held(1, keys(9, 2, 3)) == 0
    assert record.held(2, keys(1, 2, 3)) == 0  # another instance's salt


def test_the_record_never_holds_more_than_its_capacity_and_evicts_the_least_recent_chains_from_their_end():
    record = PrefixRecord(10)
    old, new = keys(1, 2, 3, 4, 5, 6), keys(7, 8, 9, 10, 11, 12)
    record.add(1, old)
    record.add(1, new)
    assert len(record) == 10
    assert record.held(1, new) == 6
    assert record.held(1, old) == 4  # its last two blocks went first: still a prefix


def test_using_a_chain_again_keeps_it_over_newer_ones():
    record = PrefixRecord(8)
    a, b, c = keys(1, 2, 3), keys(4, 5, 6), keys(7, 8, 9)
    record.add(1, a)
    record.add(1, b)
    record.add(1, a)  # a is used again
    record.add(1, c)
    assert record.held(1, a) == 3 and record.held(1, c) == 3 and record.held(1, b) == 2


def test_under_random_use_what_is_held_is_always_a_prefix_and_the_bound_holds():
    rng = random.Random(7)
    record = PrefixRecord(50)
    chains = [keys(rng.randrange(3), *(rng.randrange(4) for _ in range(rng.randrange(1, 12)))) for _ in range(40)]
    for _ in range(300):
        record.add(rng.randrange(3), rng.choice(chains))
        assert len(record) <= 50
    for salt in range(3):
        for chain in chains:
            held = record.held(salt, chain)
            assert all(k ^ salt in record._entries for k in chain[:held])  # binary search agrees with a scan
            assert held == len(chain) or chain[held] ^ salt not in record._entries


def test_a_prompt_no_one_holds_goes_to_the_least_loaded_first_in_turn():
    policy = PrefixAware(1.0, 0.25, 100)
    a, b, c = instance("a", 2), instance("b", 1), instance("c", 1)
    prompt = prompt_blocks({"prompt": list(range(64))}, False, 16, 64)
    assert policy.choose([a, b, c], prompt) is b
    assert policy.choose([a, c, b], prompt) is c
    assert policy.choose([a, b], None) is b


def test_holding_the_prompt_outweighs_load_until_prefix_weight_over_load_weight_legs():
    policy = PrefixAware(1.0, 0.25, 100)
    holder, other = instance("holder"), instance("other")
    prompt = prompt_blocks({"prompt": list(range(64))}, False, 16, 64)
    policy.sent(holder, prompt)
    for extra in range(4):
        holder.inflight = extra
        assert policy.choose([other, holder], prompt) is holder
    holder.inflight = 5
    assert policy.choose([other, holder], prompt) is other


def test_a_zero_prefix_weight_is_least_loaded():
    policy = PrefixAware(0.0, 0.25, 100)
    holder, other = instance("holder", 1), instance("other")
    prompt = prompt_blocks({"prompt": list(range(64))}, False, 16, 64)
    policy.sent(holder, prompt)
    assert policy.choose([holder, other], prompt) is other
