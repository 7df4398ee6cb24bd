"""kv_digest: the digest both sides compute agrees however each cuts its memory, catches a wrong,
swapped, stale or shifted block, and is the same on numpy and torch; kv_digest_check compares
LANDED and DONE digests with what decode's blocks hold."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kvpush.connector import kv_digest as kd
from kvpush.connector.coalesce import pair_segments, slice_segments
from kvpush.connector.kv_digest_check import MISMATCH, MISSING, VERIFIED, KvCheck, slices_for_piece
from kvpush.connector.regions import HeadLayout, Region
from kvpush.connector.sharding import HeadSharding, pieces_for_decode

BLOCKS, LAYERS, HEADS, HEAD_BYTES = 32, 3, 2, 256  # a block: [K heads][V heads]


def cache(seed: int | None) -> np.ndarray:
    """Layer-major [layers, blocks, 2 chunks * heads * head bytes], random or zero."""
    shape = (LAYERS, BLOCKS, 2 * HEADS * HEAD_BYTES)
    if seed is None:
        return np.zeros(shape, dtype=np.uint8)
    return np.random.default_rng(seed).integers(0, 256, size=shape, dtype=np.uint8)


def regions_of(arr: np.ndarray) -> list[Region]:
    return [Region(arr[k].ctypes.data, arr.shape[2], arr.shape[2], BLOCKS) for k in range(arr.shape[0])]


MEM = kd.HostMemory()


def copy_blocks(src: np.ndarray, dst: np.ndarray, s: list[int], d: list[int]) -> None:
    dst[:, d] = src[:, s]  # what a correct WRITE does


def test_prefill_and_decode_agree_on_whole_blocks_and_each_fault_changes_the_digest():
    src, dst = cache(1), cache(None)
    s, d = [3, 4, 5, 9], [10, 11, 12, 20]
    copy_blocks(src, dst, s, d)
    local, remote = regions_of(src), regions_of(dst)
    sent = kd.digest(MEM, kd.producer_slices(pair_segments(local, remote), local, remote), s)
    layout = [HeadLayout(HEADS, HEAD_BYTES, (0, HEADS * HEAD_BYTES))] * LAYERS
    mine = kd.decode_slices(remote, layout, 0, HEADS, whole=True)
    assert kd.digest(MEM, mine, d) == sent
    assert kd.digest(MEM, mine, d, [0]) + kd.digest(MEM, mine, d, [1, 2]) & kd.MASK == sent  # layers add up
    for name in ("swapped", "stale", "one byte"):
        bad = dst.copy()
        if name == "swapped":
            bad[:, [10, 11]] = dst[:, [11, 10]]
        elif name == "stale":
            bad[1, 12] = 0  # what the block held before: nothing landed
        else:
            bad[2, 20, 7] ^= 1
        assert kd.digest(MEM, kd.decode_slices(regions_of(bad), layout, 0, HEADS, True), d) != sent, name
    # a block that landed in the wrong place: the same bytes, one block over
    assert kd.digest(MEM, mine, [10, 11, 12, 21]) != sent


def test_a_head_slice_from_a_prefill_of_another_tp_size_agrees():
    """P TP1 (2 heads) -> D TP2 (1 head per rank): prefill writes one head of each chunk."""
    src = cache(2)
    dst = np.zeros((LAYERS, BLOCKS, 2 * HEAD_BYTES), dtype=np.uint8)
    s, d = [1, 2], [5, 6]
    prefill, decode = HeadSharding(HEADS, 1), HeadSharding(HEADS, 2)
    local = regions_of(src)
    remote = [Region(dst[k].ctypes.data, dst.shape[2], dst.shape[2], BLOCKS) for k in range(LAYERS)]
    p_heads = [HeadLayout(HEADS, HEAD_BYTES, (0, HEADS * HEAD_BYTES))] * LAYERS
    d_heads = [HeadLayout(1, HEAD_BYTES, (0, HEAD_BYTES))] * LAYERS
    [piece] = pieces_for_decode(1, prefill, decode)  # rank 1 takes head 1
    segments = slice_segments(local, p_heads, piece.start, remote, d_heads, 0, piece.num_heads)
    for c in range(2):  # what the WRITE does: head 1 of each chunk
        dst[:, d, c * HEAD_BYTES:(c + 1) * HEAD_BYTES] = src[:, s, c * HEADS * HEAD_BYTES + HEAD_BYTES:
                                                             c * HEADS * HEAD_BYTES + 2 * HEAD_BYTES]
    sent = kd.digest(MEM, kd.producer_slices(segments, local, remote), s)
    mine = slices_for_piece(remote, d_heads, piece, prefill, decode)
    assert kd.digest(MEM, mine, d) == sent
    dst[0, 5, :HEAD_BYTES] = src[0, 1, :HEAD_BYTES]  # head 0 instead of head 1: the wrong head
    assert kd.digest(MEM, mine, d) != sent


def test_numpy_and_torch_compute_the_same_digest():
    arr = cache(3)
    slices = kd.decode_slices(regions_of(arr), [HeadLayout(HEADS, HEAD_BYTES, (0, 512))] * LAYERS, 1, 1, whole=False)
    on_torch = kd.TorchMemory([torch.from_numpy(arr)])
    assert kd.digest(MEM, slices, [0, 7, 31]) == kd.digest(on_torch, slices, [0, 7, 31])
    assert kd.digest(MEM, slices, []) == 0


def test_a_slice_not_made_of_whole_words_is_refused():
    with pytest.raises(kd.DigestError, match="verify_kv: false"):
        kd.Slice(0, 4, 8, 0, 8)
    assert kd.from_wire(kd.to_wire(2 ** 64 - 1)) == 2 ** 64 - 1 and len(kd.to_wire(5)) == 16


def test_the_check_takes_matching_layers_then_the_rest_on_done_and_names_a_mismatch():
    src, dst = cache(4), cache(None)
    s = d = [2, 3]
    local, remote = regions_of(src), regions_of(dst)
    sent_slices = kd.producer_slices(pair_segments(local, remote), local, remote)
    layout = [HeadLayout(HEADS, HEAD_BYTES, (0, HEADS * HEAD_BYTES))] * LAYERS
    check = KvCheck(MEM)
    check.expect("t#0", kd.decode_slices(remote, layout, 0, HEADS, True))
    dst[0, d] = src[0, s]
    assert check.landed("t#0", (0,), kd.to_wire(kd.digest(MEM, sent_slices, s, [0])), d) == ("", "")
    dst[1:, d] = src[1:, s]
    dst[0, d] = 0  # layer 0 checked already: DONE does not hash it again
    assert check.done("t#0", kd.to_wire(kd.digest(MEM, sent_slices, s)), d) == (VERIFIED, "")
    check.expect("t#1", kd.decode_slices(remote, layout, 0, HEADS, True))
    counter, why = check.landed("t#1", (2,), kd.to_wire(kd.digest(MEM, sent_slices, s, [1])), d)
    assert counter == MISMATCH and "KV digest mismatch in regions 2..2" in why
    assert check.done("t#1", "", d)[0] == MISSING
    assert check.done("unknown", "", d) == ("", "")  # not a part this check expects
