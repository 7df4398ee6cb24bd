"""Prefill and decode agree on the prompt before a byte moves, between two processes with real NIXL
(UCX on CPU memory): a decode registration for one prompt never receives the KV of another prompt
of the same length; prefill refuses the match (FAIL to decode, its own blocks freed, counted
`prompt_mismatch`) and decode's blocks keep what they held. The same prompt moves byte-exact."""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from peer_proc import PeerProcess, identity, kv_buffer, view_of, wait_outcomes  # noqa: E402

from kvpush.common.kv_params import PromptIdentity
from kvpush.connector.consumer import Consumer, ConsumerConfig
from kvpush.connector.layout import kv_regions
from kvpush.connector.transfer import NixlEngine

NUM_BLOCKS, BLOCK_SHAPE, SEED = 32, (2, 16, 64), 11
os.environ.update({"UCX_MODULES": "^ib", "UCX_MEM_EVENTS": "no", "NIXL_LOG_LEVEL": "WARN"})
KEY = os.urandom(32)
VICTIM = PromptIdentity.of(range(1000, 1064))  # the prompt decode loads (its prefix hashes)
OTHER = PromptIdentity.of(range(5000, 5064))  # another text of the same length, at prefill


@pytest.fixture(scope="module")
def decode_side():
    arr = kv_buffer(NUM_BLOCKS, BLOCK_SHAPE, None)
    regions = kv_regions([view_of(arr)], NUM_BLOCKS)
    engine = NixlEngine("D.agree", regions)
    consumer = Consumer(ConsumerConfig("D.agree", 0, identity(arr), frozenset({"P.agree"}), timeout_s=5.0,
                                       side_channel_key=KEY), engine.name, engine.metadata, tuple(regions))
    yield arr, consumer
    consumer.close()
    engine.close()


@pytest.fixture
def prefill():
    peer = PeerProcess("P.agree", ["D.agree"], num_blocks=NUM_BLOCKS, block_shape=BLOCK_SHAPE, seed=SEED,
                       side_channel_key=KEY.hex())
    yield peer
    peer.kill()


def accept(prompt: PromptIdentity, tid: str) -> list:
    return [tid, prompt.tokens, prompt.digest]


@pytest.mark.parametrize("register_first", [True, False])
def test_another_prompt_of_the_same_length_is_refused_before_a_byte_moves(decode_side, prefill, register_first):
    arr, consumer = decode_side
    tid, dst, src = f"swap-{register_first}", [3, 4, 5, 6], [10, 11, 12, 13]
    arr[dst] = 7  # what decode's blocks hold before: must still be there after
    prefill.send(accept=[accept(OTHER, tid)])
    if register_first:
        consumer.expect("rq", tid, "P.agree", "127.0.0.1", prefill.port, dst, 0, 64, prompt=VICTIM)
        prefill.wait_registered(tid)
        prefill.send(offer=[tid, "pr", src, "D.agree"])
    else:
        prefill.send(offer=[tid, "pr", src, "D.agree"])
        time.sleep(0.1)
        consumer.expect("rq", tid, "P.agree", "127.0.0.1", prefill.port, dst, 0, 64, prompt=VICTIM)
    [outcome] = wait_outcomes(consumer, 1)
    assert not outcome.ok and "is not prefill's" in outcome.reason, outcome.reason
    assert not outcome.may_still_land
    assert (arr[dst] == 7).all()  # nothing was written
    status = prefill.status()
    assert status["freed"] == ["pr"] and status["records"] == []  # no WRITE was posted
    assert status["counters"]["prompt_mismatch"] == 1


def test_the_same_prompt_moves_byte_exact(decode_side, prefill):
    arr, consumer = decode_side
    expected = kv_buffer(NUM_BLOCKS, BLOCK_SHAPE, SEED)
    tid, dst, src = "same", [20, 21, 22], [1, 2, 3]
    arr[dst] = 0
    prefill.send(accept=[accept(VICTIM, tid)])
    consumer.expect("rq", tid, "P.agree", "127.0.0.1", prefill.port, dst, 0, 48, prompt=VICTIM)
    prefill.wait_registered(tid)
    prefill.send(offer=[tid, "pr2", src, "D.agree"])
    [outcome] = wait_outcomes(consumer, 1)
    assert outcome.ok, outcome.reason
    assert np.array_equal(arr[dst], expected[src])
    status = prefill.status()
    assert status["freed"] == ["pr2"] and [r["ok"] for r in status["records"]] == [True]


def test_a_registration_without_a_prompt_is_refused_by_a_prefill_that_knows_its_own(decode_side, prefill):
    """Fail closed: a decode that names no prompt gets nothing."""
    arr, consumer = decode_side
    tid, dst = "no-prompt", [25, 26]
    arr[dst] = 9
    prefill.send(accept=[accept(VICTIM, tid)])
    consumer.expect("rq", tid, "P.agree", "127.0.0.1", prefill.port, dst, 0, 32)
    prefill.wait_registered(tid)
    prefill.send(offer=[tid, "pr3", [4, 5], "D.agree"])
    [outcome] = wait_outcomes(consumer, 1)
    assert not outcome.ok and "unknown" in outcome.reason and (arr[dst] == 9).all()


def test_refused_params_fail_decodes_load_without_contacting_prefill(decode_side, prefill):
    _, consumer = decode_side
    consumer.expect("rq", "refused", "P.agree", "127.0.0.1", prefill.port, [28], 0, 16, prompt=VICTIM,
                    refused="the request's kv_transfer_params are refused (bad_signature)")
    [outcome] = wait_outcomes(consumer, 1, timeout_s=2.0)
    assert not outcome.ok and "bad_signature" in outcome.reason
    time.sleep(0.2)
    prefill.send(registered="refused")
    assert json.loads(prefill.proc.stdout.readline()) == {"registered": False}
