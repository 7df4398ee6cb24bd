"""Coalescing a request's blocks into NIXL descriptors (connector/coalesce.py) and the layout
math it relies on (registration spans, block contiguity of permuted views)."""
from __future__ import annotations

import numpy as np
import pytest

from kvpush.connector.coalesce import CoalesceError, Plan, block_runs, pair_segments
from kvpush.connector.layout import TensorView, kv_regions, region_spans, regions_of
from kvpush.connector.regions import Region

pytestmark = pytest.mark.unit

KIB = 1024


def split_kv_layer_regions(base: int, layers: int, num_blocks: int, block_len: int) -> list[Region]:
    """Per-layer `[2, B, ...]` tensors laid out one after another: K region, V region, next layer."""
    regions = []
    for i in range(2 * layers):
        regions.append(Region(base + i * num_blocks * block_len, block_len, block_len, num_blocks))
    return regions


def block_major_regions(base: int, layers: int, num_blocks: int, page: int) -> list[Region]:
    """Per-layer views of one block-major buffer `[B, L, page]` (vLLM's BLNHC/BLHNC)."""
    return [Region(base + layer * page, page, layers * page, num_blocks) for layer in range(layers)]


def expand(local: np.ndarray) -> set[tuple[int, int]]:
    """Every byte range a descriptor list covers, cut into (address, length) of its rows."""
    return {(int(a), int(n)) for a, n, _ in local}


def reference_pairs(regions_here, regions_there, src, dst):
    """Block-by-block (local address, remote address, length) triples, the ground truth."""
    out = []
    for mine, theirs in zip(regions_here, regions_there):
        for s, d in zip(src, dst):
            out.append((mine.base + s * mine.stride, theirs.base + d * theirs.stride, mine.block_len))
    return out


def covered_bytes(local: np.ndarray, remote: np.ndarray) -> dict[int, int]:
    """Map each local byte offset (block granularity, 1 KiB steps) to its remote address."""
    mapping = {}
    for (la, n, _), (ra, rn, _) in zip(local.astype(np.int64), remote.astype(np.int64)):
        assert n == rn
        for off in range(0, int(n), KIB):
            mapping[int(la) + off] = int(ra) + off
    return mapping


def reference_bytes(pairs) -> dict[int, int]:
    mapping = {}
    for la, ra, n in pairs:
        for off in range(0, n, KIB):
            mapping[la + off] = ra + off
    return mapping


# ---- runs -----------------------------------------------------------------------------------------
def test_runs_break_where_either_side_jumps():
    runs = block_runs([3, 4, 5, 9, 10, 11, 12], [20, 21, 30, 31, 32, 40, 41])
    assert runs.src.tolist() == [3, 5, 9, 11]
    assert runs.dst.tolist() == [20, 30, 31, 40]
    assert runs.length.tolist() == [2, 1, 2, 2]


def test_runs_of_descending_or_repeated_ids_are_single_blocks():
    runs = block_runs([5, 4, 4], [1, 2, 3])
    assert runs.length.tolist() == [1, 1, 1]


def test_runs_reject_unequal_lengths():
    with pytest.raises(CoalesceError, match="3 source blocks vs 2"):
        block_runs([1, 2, 3], [1, 2])


# ---- segments -------------------------------------------------------------------------------------
def test_split_kv_regions_do_not_merge_and_stay_packed():
    here = split_kv_layer_regions(1 << 30, layers=3, num_blocks=64, block_len=4 * KIB)
    there = split_kv_layer_regions(1 << 40, layers=3, num_blocks=64, block_len=4 * KIB)
    segments = pair_segments(here, there)
    assert len(segments) == 6
    assert all(s.packed for s in segments)


def test_block_major_layers_merge_into_one_packed_segment():
    here = block_major_regions(1 << 30, layers=64, num_blocks=32, page=8 * KIB)
    there = block_major_regions(1 << 40, layers=64, num_blocks=32, page=8 * KIB)
    (segment,) = pair_segments(here, there)
    assert segment.block_len == 64 * 8 * KIB and segment.packed and segment.num_regions == 64


def test_layer_order_does_not_matter_for_merging():
    here = block_major_regions(1 << 30, layers=8, num_blocks=16, page=8 * KIB)
    there = block_major_regions(1 << 40, layers=8, num_blocks=16, page=8 * KIB)
    order = [3, 0, 7, 1, 6, 2, 5, 4]
    (segment,) = pair_segments([here[i] for i in order], [there[i] for i in order])
    assert segment.local_base == 1 << 30 and segment.remote_base == 1 << 40


def test_merge_needs_adjacency_on_both_sides():
    here = block_major_regions(1 << 30, layers=4, num_blocks=16, page=8 * KIB)
    there = split_kv_layer_regions(1 << 40, layers=2, num_blocks=16, block_len=8 * KIB)
    segments = pair_segments(here, there)
    assert len(segments) == 4
    assert not any(s.packed for s in segments)  # here blocks are 32 KiB apart


def test_single_block_regions_never_merge():
    # touching one-block regions may be two allocations; a descriptor must not span them
    here = [Region(1000, 100, 100, 1), Region(1100, 100, 100, 1)]
    there = [Region(5000, 100, 100, 1), Region(5100, 100, 100, 1)]
    assert len(pair_segments(here, there)) == 2


def test_regions_that_alias_the_next_block_never_merge():
    # region 1's block b is region 0's block b+1: merging would make blocks overlap
    here = [Region(0, 100, 100, 8), Region(100, 100, 100, 8)]
    assert len(pair_segments(here, here)) == 2


def test_pairing_rejects_mismatched_regions():
    with pytest.raises(CoalesceError, match="2 KV regions here vs 1"):
        pair_segments([Region(0, 8, 8, 4)] * 2, [Region(0, 8, 8, 4)])
    with pytest.raises(CoalesceError, match="8-byte blocks here vs 16"):
        pair_segments([Region(0, 8, 8, 4)], [Region(0, 16, 16, 4)])


# ---- descriptors ----------------------------------------------------------------------------------
def test_contiguous_request_is_one_descriptor_per_region():
    here = split_kv_layer_regions(1 << 30, layers=4, num_blocks=256, block_len=4 * KIB)
    there = split_kv_layer_regions(1 << 40, layers=4, num_blocks=256, block_len=4 * KIB)
    local, remote = Plan.pair(here, there, local_device=2, remote_device=5).descriptors(range(10, 74), range(100, 164))
    assert local.dtype == np.uint64 and local.shape == (8, 3)
    assert set(local[:, 1].tolist()) == {64 * 4 * KIB}
    assert set(local[:, 2].tolist()) == {2} and set(remote[:, 2].tolist()) == {5}
    assert sorted(int(a) for a in local[:, 0]) == sorted(r.base + 10 * r.stride for r in here)


def test_contiguous_block_major_request_is_one_descriptor():
    here = block_major_regions(1 << 30, layers=64, num_blocks=128, page=8 * KIB)
    there = block_major_regions(1 << 40, layers=64, num_blocks=128, page=8 * KIB)
    local, remote = Plan.pair(here, there).descriptors(range(5, 69), range(60, 124))
    assert local.tolist() == [[(1 << 30) + 5 * 512 * KIB, 64 * 512 * KIB, 0]]
    assert remote.tolist() == [[(1 << 40) + 60 * 512 * KIB, 64 * 512 * KIB, 0]]


@pytest.mark.parametrize("layout", ["split", "block-major", "mixed"])
def test_fragmented_request_moves_exactly_the_reference_bytes(layout):
    rng = np.random.default_rng(7)
    nb, page = 96, 2 * KIB
    if layout == "split":
        here = split_kv_layer_regions(1 << 30, 3, nb, page)
        there = split_kv_layer_regions(1 << 40, 3, nb, page)
    elif layout == "block-major":
        here = block_major_regions(1 << 30, 6, nb, page)
        there = block_major_regions(1 << 40, 6, nb, page)
    else:  # same sizes, different memory orders: nothing merges, nothing is packed here
        here = block_major_regions(1 << 30, 6, nb, page)
        there = split_kv_layer_regions(1 << 40, 3, nb, page)
    src = np.concatenate([np.arange(3, 9), [40, 41, 42], [17], np.arange(60, 70)])
    dst = np.concatenate([np.arange(50, 56), [10, 11, 90], [91], rng.permutation(20)[:10]])
    plan = Plan.pair(here, there)
    local, remote = plan.descriptors(src, dst)
    assert covered_bytes(local, remote) == reference_bytes(reference_pairs(here, there, src, dst))
    runs = len(block_runs(src, dst))
    packed = [s for s in plan.segments if s.packed]
    loose = [s for s in plan.segments if not s.packed]
    assert len(local) == runs * len(packed) + len(src) * len(loose)


@pytest.mark.parametrize("layout", ["split", "block-major", "mixed"])
def test_parts_move_the_same_bytes_one_segment_each_in_address_order(layout):
    nb, page = 64, 2 * KIB
    if layout == "split":
        here, there = split_kv_layer_regions(1 << 30, 3, nb, page), split_kv_layer_regions(1 << 40, 3, nb, page)
    elif layout == "block-major":
        here, there = block_major_regions(1 << 30, 6, nb, page), block_major_regions(1 << 40, 6, nb, page)
    else:
        here, there = block_major_regions(1 << 30, 6, nb, page), split_kv_layer_regions(1 << 40, 3, nb, page)
    src = np.concatenate([np.arange(3, 9), [40, 41, 42], [17]])
    dst = np.concatenate([np.arange(50, 56), [10, 11, 60], [61]])
    plan = Plan.pair(here, there)
    parts = plan.parts(src, dst)
    assert len(parts) == len(plan.segments)
    assert sorted(i for _, _, regions in parts for i in regions) == list(range(len(here)))
    merged = {}
    for local, remote, regions in parts:
        part_bytes = covered_bytes(local, remote)
        expected = reference_bytes(reference_pairs([here[i] for i in regions], [there[i] for i in regions], src, dst))
        assert part_bytes == expected  # a part fills exactly its own regions' blocks
        merged.update(part_bytes)
    assert merged == covered_bytes(*plan.descriptors(src, dst))
    firsts = [min(here[i].base for i in regions) for _, _, regions in parts]
    assert firsts == sorted(firsts)


def test_descriptor_count_equals_runs_times_segments():
    here = block_major_regions(1 << 30, 64, 512, 8 * KIB)
    there = block_major_regions(1 << 40, 64, 512, 8 * KIB)
    rng = np.random.default_rng(0)
    src, dst = rng.permutation(512)[:200], rng.permutation(512)[:200]
    local, _ = Plan.pair(here, there).descriptors(src, dst)
    assert len(local) == len(block_runs(src, dst))


def test_empty_request_has_no_descriptors():
    here = split_kv_layer_regions(0, 1, 8, 64)
    local, remote = Plan.pair(here, here).descriptors([], [])
    assert local.shape == (0, 3) and remote.shape == (0, 3)


# ---- registration spans and contiguity --------------------------------------------------------------
def test_interleaved_layers_register_as_one_span():
    regions = block_major_regions(1 << 30, layers=4, num_blocks=10, page=100)
    assert region_spans(regions) == [(1 << 30, 10 * 400)]


def test_touching_regions_register_apart():
    # K and V (or two allocations that happen to touch) stay separate registrations
    regions = split_kv_layer_regions(1 << 30, layers=1, num_blocks=10, block_len=100)
    assert region_spans(regions) == [(1 << 30, 1000), ((1 << 30) + 1000, 1000)]


def test_a_coalesced_descriptor_lies_inside_one_registration():
    here = block_major_regions(1 << 30, 8, 32, 4 * KIB)
    spans = region_spans(here)
    local, _ = Plan.pair(here, here).descriptors(range(0, 32), range(0, 32))
    for addr, length, _ in local.astype(np.int64):
        assert any(start <= addr and addr + length <= start + size for start, size in spans)


def test_permuted_block_interior_is_still_one_block():
    # vLLM's NHD view of an HND-ordered block: [2, B, N, H, D] with H and N strides swapped
    B, N, H, D = 10, 16, 8, 128
    strides = (B * H * N * D, H * N * D, D, N * D, 1)
    (k, v) = regions_of(TensorView(4096, (2, B, N, H, D), strides, 2), B)
    assert k.block_len == H * N * D * 2 and k.stride == k.block_len
    assert v.base == 4096 + B * H * N * D * 2


def test_block_major_views_give_one_region_per_layer():
    L, B, N, H, C = 4, 12, 16, 2, 256
    page = N * H * C
    views = [TensorView((1 << 20) + layer * page * 2, (B, H, N, C), (L * page, C, H * C, 1), 2) for layer in range(L)]
    regions = kv_regions(views, B)
    assert len(regions) == L and {r.stride for r in regions} == {L * page * 2}
    (segment,) = pair_segments(regions, regions)
    assert segment.packed and segment.block_len == L * page * 2


def test_descriptors_name_each_side_its_own_device():
    """P on GPU 0 writing into D on GPU 3 of the same host: remote rows must name device 3."""
    here = block_major_regions(1 << 30, 4, 16, 8 * KIB)
    there = block_major_regions(1 << 34, 4, 16, 8 * KIB)
    local, remote = Plan.pair(here, there, local_device=0, remote_device=3).descriptors([1, 2, 7], [4, 5, 9])
    assert set(local[:, 2].tolist()) == {0} and set(remote[:, 2].tolist()) == {3}
