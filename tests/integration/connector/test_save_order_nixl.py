"""A GPU's save path between two processes with real NIXL (UCX on CPU memory): the prefill side
hands each step to a SaveQueue whose forward pass is a gate the test opens. Nothing is written
while the forward runs; once it is done every request of the step lands byte-exact and only then
are P's blocks freed; a decode that goes away meanwhile is never written to and P frees the
request's blocks and goes on serving the others."""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from peer_proc import DecodeSide, PeerProcess, kv_buffer, wait_outcomes  # noqa: E402

NUM_BLOCKS, BLOCK_SHAPE, SEED = 64, (2, 16, 64), 11
os.environ.update({"UCX_MODULES": "^ib", "UCX_MEM_EVENTS": "no", "NIXL_LOG_LEVEL": "WARN"})


def decode_side(engine_id: str) -> DecodeSide:
    return DecodeSide(engine_id, "P.save", NUM_BLOCKS, BLOCK_SHAPE)


@pytest.fixture(scope="module")
def decode():
    side = decode_side("D.save")
    yield side
    side.close()


@pytest.fixture(scope="module")
def prefill():
    peer = PeerProcess("P.save", ["D.save", "D.gone"], num_blocks=NUM_BLOCKS, block_shape=BLOCK_SHAPE, seed=SEED,
                       save_queue=True)
    yield peer
    peer.kill()


def wait_freed(prefill: PeerProcess, n: int, timeout_s: float = 20.0) -> tuple[list, list]:
    freed, records, deadline = [], [], time.monotonic() + timeout_s
    while len(freed) < n and time.monotonic() < deadline:
        status = prefill.status()
        freed += status["freed"]
        records += status["records"]
        time.sleep(0.01)
    return freed, records


def test_a_step_is_written_only_after_its_forward_pass_and_every_request_lands_byte_exact(decode, prefill):
    expected = kv_buffer(NUM_BLOCKS, BLOCK_SHAPE, SEED)
    pushes = [("s1", "p1", [3, 4, 9], [10, 11, 12]), ("s2", "p2", [20], [30])]
    for tid, req, src, dst in pushes:
        decode.consumer.expect(f"d-{req}", tid, "P.save", "127.0.0.1", prefill.port, dst, 0, 16 * len(dst))
    for tid, *_ in pushes:  # D's registrations reach P first, as usual on a GPU: the WRITEs are made ahead
        prefill.wait_registered(tid)
    prefill.send(save=[[tid, req, src, "D.save"] for tid, req, src, _ in pushes])
    time.sleep(0.3)  # the forward pass is still running
    assert decode.consumer.take_outcomes() == []
    assert not decode.arr.any()  # not a byte written
    assert prefill.status()["freed"] == []
    prefill.send(forward_done=True)
    outcomes = wait_outcomes(decode.consumer, 2)
    assert sorted(o.pending.transfer_id for o in outcomes if o.ok) == ["s1", "s2"]
    for _, _, src, dst in pushes:
        assert np.array_equal(decode.arr[dst], expected[src])
    freed, records = wait_freed(prefill, 2)
    assert sorted(freed) == ["p1", "p2"]
    assert all(r["ok"] and r["prepared_ahead"] for r in records)
    assert all(r["offered"] <= r["posted"] <= r["finished"] for r in records)


def test_a_decode_gone_while_the_forward_runs_is_never_written_and_the_blocks_are_freed(decode, prefill):
    gone = decode_side("D.gone")
    try:
        gone.consumer.expect("d-p3", "s3", "P.save", "127.0.0.1", prefill.port, [5, 6], 0, 32)
        prefill.wait_registered("s3")
        prefill.send(save=[["s3", "p3", [1, 2], "D.gone"]])
    finally:
        gone.close()  # dies with P's forward pass still running
    time.sleep(0.2)  # P's side channel sees the connection close
    prefill.send(forward_done=True)
    freed, records = wait_freed(prefill, 1)
    assert freed == ["p3"] and not any(r["ok"] for r in records)
    # P goes on serving the decode that is still there
    decode.consumer.expect("d-p4", "s4", "P.save", "127.0.0.1", prefill.port, [40, 41], 0, 32)
    prefill.wait_registered("s4")
    prefill.send(save=[["s4", "p4", [7, 8], "D.save"]])
    prefill.send(forward_done=True)
    [outcome] = wait_outcomes(decode.consumer, 1)
    assert outcome.ok and np.array_equal(decode.arr[[40, 41]], kv_buffer(NUM_BLOCKS, BLOCK_SHAPE, SEED)[[7, 8]])
