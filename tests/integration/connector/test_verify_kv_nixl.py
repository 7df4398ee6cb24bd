"""verify_kv with real NIXL between processes: prefill sends a digest of each push's KV, decode
checks its blocks against it before the load counts as done. A correct push passes, whole or
streamed layer by layer; a push whose WRITEs put a block where another belongs (a block-mapping
bug in prefill) fails its load and is counted; a prefill that sends no digest fails it too."""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from peer_proc import PeerProcess, identity, kv_buffer, layer_major_buffer, view_of, wait_outcomes  # noqa: E402

from kvpush.connector.consumer import Consumer, ConsumerConfig
from kvpush.connector.kv_digest import HostMemory
from kvpush.connector.layout import kv_regions
from kvpush.connector.transfer import NixlEngine

NUM_BLOCKS, BLOCK_SHAPE, SEED, LAYERS = 64, (2, 16, 64), 11, 4  # 4 KiB blocks
os.environ.update({"UCX_MODULES": "^ib", "UCX_MEM_EVENTS": "no", "NIXL_LOG_LEVEL": "WARN"})


class Decode:
    """Decode in this process, checking digests: a zeroed buffer, layer-major when `layers`."""

    def __init__(self, engine_id: str, prefill: str, layers: int = 0):
        if layers:
            self.arr = layer_major_buffer(NUM_BLOCKS, layers, BLOCK_SHAPE, None)
            regions = kv_regions([view_of(layer) for layer in self.arr], NUM_BLOCKS)
        else:
            self.arr = kv_buffer(NUM_BLOCKS, BLOCK_SHAPE, None)
            regions = kv_regions([view_of(self.arr)], NUM_BLOCKS)
        self.engine = NixlEngine(engine_id, regions)
        self.consumer = Consumer(ConsumerConfig(engine_id, 0, identity(self.arr, layers=layers), frozenset({prefill}),
                                                timeout_s=20.0, verify_kv=HostMemory()),
                                 self.engine.name, self.engine.metadata, tuple(regions))

    def blocks(self, ids: list[int]) -> np.ndarray:
        return self.arr[:, ids] if self.arr.ndim == 5 else self.arr[ids]

    def close(self) -> None:
        self.consumer.close()
        self.engine.close()


def push(decode: Decode, peer: PeerProcess, tid: str, src: list[int], dst: list[int], prefill: str):
    decode.consumer.expect("rq-" + tid, tid, prefill, "127.0.0.1", peer.port, dst, 0, 16 * len(dst))
    peer.wait_registered(tid)
    peer.send(offer=[tid, "pr-" + tid, src, decode.engine.name])
    [outcome] = wait_outcomes(decode.consumer, 1, timeout_s=30.0)
    return outcome


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
def test_a_correct_push_passes_the_check_and_a_swapped_block_fails_the_load(streamed):
    layers = LAYERS if streamed else 0
    source = layer_major_buffer(NUM_BLOCKS, layers, BLOCK_SHAPE, SEED) if streamed else kv_buffer(NUM_BLOCKS, BLOCK_SHAPE, SEED)
    shape = {"stream_writes": True, "layer_major": True, "layers": layers} if streamed else {}
    src, dst = [3, 4, 5, 6], [40, 41, 42, 43]
    for swap in (False, True):
        prefill = f"P.v{int(streamed)}{int(swap)}"
        decode = Decode(f"D.v{int(streamed)}{int(swap)}", prefill, layers)
        peer = PeerProcess(prefill, [decode.engine.name], num_blocks=NUM_BLOCKS, block_shape=BLOCK_SHAPE, seed=SEED,
                           verify_kv=True, swap_dst_blocks=swap, **shape)
        try:
            outcome = push(decode, peer, "t-v", src, dst, prefill)
            expected = source[:, src] if streamed else source[src]
            if not swap:
                assert outcome.ok, outcome.reason
                assert np.array_equal(decode.blocks(dst), expected)
                counts = decode.consumer.take_counts()
                assert counts["kv_digest_mismatch"] == 0 and counts["kv_digest_verified"] == 1
            else:
                assert not outcome.ok and "KV digest mismatch" in outcome.reason, outcome.reason
                counts = decode.consumer.take_counts()
                assert counts["kv_digest_mismatch"] == 1 and counts["kv_digest_verified"] == 0
                landed = decode.blocks(dst)
                assert not np.array_equal(landed, expected)  # what the check caught: blocks 40 and 41 swapped
        finally:
            peer.kill()
            decode.close()


def test_a_prefill_that_sends_no_digest_fails_the_load_of_a_decode_that_checks():
    decode = Decode("D.v-off", "P.v-off")
    peer = PeerProcess("P.v-off", ["D.v-off"], num_blocks=NUM_BLOCKS, block_shape=BLOCK_SHAPE, seed=SEED)
    try:
        outcome = push(decode, peer, "t-off", [1, 2], [20, 21], "P.v-off")
        assert not outcome.ok and "no KV digest" in outcome.reason
        assert decode.consumer.take_counts()["kv_digest_missing"] == 1
        time.sleep(0.1)
    finally:
        peer.kill()
        decode.close()
