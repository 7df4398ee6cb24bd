"""TP re-sharding, checked byte for byte: the descriptors kvpush's prefill ranks would WRITE are
copied with memmove between numpy caches shaped as vLLM lays them out, and every decode rank
must end up with exactly a reference re-sharding of the model's KV (its heads, in its blocks)."""
from __future__ import annotations

import ctypes
import itertools

import numpy as np
import pytest

from kvpush.connector.coalesce import CoalesceError, Plan, slice_segments
from kvpush.connector.layout import TensorView, head_layout, kv_regions, regions_of
from kvpush.connector.sharding import (HeadSharding, ShardingError, pieces_for_decode, pieces_for_prefill, sources_of,
                                       targets_of, tp_problem)

LAYERS, NUM_BLOCKS, TOKENS, CONTENT = 2, 7, 4, 6  # CONTENT: K and V of one token and head
SRC_BLOCKS = [5, 1, 2, 6]  # the prompt's blocks on prefill
DST_BLOCKS = [0, 3, 4, 2]  # and on decode


def reference_kv(total_heads: int, seed: int = 0) -> np.ndarray:
    """The prompt's KV as the unsplit model holds it: [layer, prompt block, head, token, content]."""
    return np.random.default_rng(seed).standard_normal((LAYERS, len(SRC_BLOCKS), total_heads, TOKENS, CONTENT)).astype(np.float32)


# Each layout allocates one layer's cache for `heads` heads and says how to read and write block b,
# local head h as [token, content]
def cpu_layout(heads):
    """vLLM's CPU cache: [blocks, heads, block_size, 2 * head_size]."""
    cache = np.zeros((NUM_BLOCKS, heads, TOKENS, CONTENT), np.float32)

    def put(b, h, value):
        cache[b, h] = value
    return [cache], lambda b, h: cache[b, h], put


def kv_split_outside_blocks(heads):
    """K and V as two regions ([2, blocks, heads, tokens, half]), heads outermost in each block."""
    cache = np.zeros((2, NUM_BLOCKS, heads, TOKENS, CONTENT // 2), np.float32)

    def put(b, h, value):
        cache[0, b, h], cache[1, b, h] = np.split(value, 2, axis=1)
    return [cache], lambda b, h: np.concatenate([cache[0, b, h], cache[1, b, h]], axis=1), put


def kv_split_inside_blocks(heads):
    """[blocks, 2, heads, tokens, half]: a head slice of a block is two ranges (K, V)."""
    cache = np.zeros((NUM_BLOCKS, 2, heads, TOKENS, CONTENT // 2), np.float32)

    def put(b, h, value):
        cache[b, 0, h], cache[b, 1, h] = np.split(value, 2, axis=1)
    return [cache], lambda b, h: np.concatenate([cache[b, 0, h], cache[b, 1, h]], axis=1), put


def token_major(heads):
    """NHD: [blocks, tokens, heads, content]; a head slice is one range per token."""
    cache = np.zeros((NUM_BLOCKS, TOKENS, heads, CONTENT), np.float32)

    def put(b, h, value):
        cache[b, :, h] = value
    return [cache], lambda b, h: cache[b, :, h], put


LAYOUTS = {"cpu": cpu_layout, "kv_outside": kv_split_outside_blocks, "kv_inside": kv_split_inside_blocks}


class Rank:
    """One TP rank's KV cache: LAYERS tensors in a layout, with their regions and head layouts."""

    def __init__(self, layout, heads: int):
        self.layers = [layout(heads) for _ in range(LAYERS)]
        self.tensors = [t for tensors, _, _ in self.layers for t in tensors]
        views = [TensorView(t.ctypes.data, t.shape, tuple(s // t.itemsize for s in t.strides), t.itemsize) for t in self.tensors]
        self.regions = kv_regions(views, NUM_BLOCKS)
        layouts = {r.base: head_layout(v, NUM_BLOCKS, heads) for v in views for r in regions_of(v, NUM_BLOCKS)}
        self.head_layouts = tuple(layouts[r.base] for r in self.regions)

    def block_head(self, layer: int, block: int, head: int) -> np.ndarray:
        return self.layers[layer][1](block, head)

    def put(self, layer: int, block: int, head: int, value: np.ndarray) -> None:
        self.layers[layer][2](block, head, value)


def write_into(layout_p, layout_d, total: int, p: int, d: int) -> tuple[list[Rank], np.ndarray, HeadSharding, HeadSharding]:
    """Run every prefill rank's pushes as memmoves; return the decode ranks and the reference."""
    prefill, decode = HeadSharding(total, p), HeadSharding(total, d)
    kv = reference_kv(total)
    p_ranks = [Rank(layout_p, prefill.heads_per_rank) for _ in range(p)]
    for i, rank in enumerate(p_ranks):
        for layer, b_i, (local, head) in itertools.product(range(LAYERS), range(len(SRC_BLOCKS)), enumerate(prefill.heads_of(i))):
            rank.put(layer, SRC_BLOCKS[b_i], local, kv[layer, b_i, head])
    d_ranks = [Rank(layout_d, decode.heads_per_rank) for _ in range(d)]
    for i in range(p):
        for piece in pieces_for_prefill(i, prefill, decode):
            src, dst = p_ranks[i], d_ranks[piece.d_rank]
            segments = slice_segments(src.regions, src.head_layouts, piece.start - prefill.heads_of(i).start,
                                      dst.regions, dst.head_layouts, piece.start - decode.heads_of(piece.d_rank).start,
                                      piece.num_heads)
            local, remote = Plan(segments).descriptors(SRC_BLOCKS, DST_BLOCKS)
            assert (local[:, 1] == remote[:, 1]).all()
            for (src_addr, length, _), (dst_addr, _, _) in zip(local.tolist(), remote.tolist()):
                ctypes.memmove(dst_addr, src_addr, length)
    return d_ranks, kv, prefill, decode


def assert_resharded(d_ranks: list[Rank], kv: np.ndarray, decode: HeadSharding) -> None:
    for j, rank in enumerate(d_ranks):
        for layer, (b_i, block), (local, head) in itertools.product(range(LAYERS), enumerate(DST_BLOCKS),
                                                                      enumerate(decode.heads_of(j))):
            np.testing.assert_array_equal(rank.block_head(layer, block, local), kv[layer, b_i, head],
                                          err_msg=f"decode rank {j} layer {layer} block {block} head {head}")
        untouched = [b for b in range(NUM_BLOCKS) if b not in DST_BLOCKS]
        for t in rank.tensors:
            blocks = t[:, untouched] if t.shape[0] == 2 and t.ndim == 5 else t[untouched]
            assert not blocks.any(), f"decode rank {j}: bytes written outside the registered blocks"


SIZES = [1, 2, 4, 8]


@pytest.mark.parametrize("total", [2, 4, 8, 32])
@pytest.mark.parametrize("p,d", list(itertools.product(SIZES, SIZES)))
def test_gqa_resharding_is_byte_exact(total, p, d):
    d_ranks, kv, _, decode = write_into(cpu_layout, cpu_layout, total, p, d)
    assert_resharded(d_ranks, kv, decode)


@pytest.mark.parametrize("p,d", list(itertools.product(SIZES, SIZES)))
def test_latent_cache_every_decode_rank_gets_the_whole_of_it(p, d):
    """MLA: one latent 'head' that every rank holds; each decode rank takes it from one prefill rank."""
    d_ranks, kv, prefill, decode = write_into(cpu_layout, cpu_layout, 1, p, d)
    assert_resharded(d_ranks, kv, decode)
    assert all(len(pieces_for_decode(j, prefill, decode)) == 1 for j in range(d))


@pytest.mark.parametrize("layout_p,layout_d", [("kv_outside", "kv_outside"), ("kv_inside", "kv_inside"),
                                               ("cpu", "cpu")])
@pytest.mark.parametrize("p,d", [(2, 1), (1, 2), (2, 4), (4, 2), (2, 2)])
def test_other_head_major_layouts_reshard_byte_exact(layout_p, layout_d, p, d):
    d_ranks, kv, _, decode = write_into(LAYOUTS[layout_p], LAYOUTS[layout_d], 8, p, d)
    assert_resharded(d_ranks, kv, decode)


def test_equal_tp_moves_whole_blocks_and_merges_runs_as_before():
    prefill = decode = HeadSharding(8, 2)
    src, dst = Rank(cpu_layout, 4), Rank(cpu_layout, 4)
    [piece] = pieces_for_prefill(1, prefill, decode)
    segments = slice_segments(src.regions, src.head_layouts, 0, dst.regions, dst.head_layouts, 0, piece.num_heads)
    assert all(s.packed for s in segments)  # whole blocks: a run of adjacent blocks is one descriptor
    local, _ = Plan(segments).descriptors([1, 2, 3], [4, 5, 6])
    assert len(local) == LAYERS


def test_token_major_layout_is_refused_naming_the_layouts_that_work():
    src, dst = Rank(token_major, 2), Rank(token_major, 1)
    with pytest.raises(CoalesceError, match="head-major layout .*BLHNC.* VLLM_KV_CACHE_LAYOUT=BLHNC"):
        slice_segments(src.regions, src.head_layouts, 1, dst.regions, dst.head_layouts, 0, 1)


def test_mapping_each_decode_head_once_from_a_prefill_rank_that_holds_it():
    for total, p, d in itertools.product([1, 2, 4, 8, 32], SIZES, SIZES):
        prefill, decode = HeadSharding(total, p), HeadSharding(total, d)
        for j in range(d):
            got = [h for piece in pieces_for_decode(j, prefill, decode) for h in range(piece.start, piece.stop)]
            assert got == list(decode.heads_of(j))
            for piece in pieces_for_decode(j, prefill, decode):
                assert set(range(piece.start, piece.stop)) <= set(prefill.heads_of(piece.p_rank))
        for i in range(p):
            assert targets_of(i, prefill, decode) == sorted({x.d_rank for x in pieces_for_prefill(i, prefill, decode)})
        assert sorted(j for i in range(p) for j in targets_of(i, prefill, decode)) == \
            sorted(j for j in range(d) for _ in sources_of(j, prefill, decode))


def test_replicated_heads_spread_decode_ranks_over_the_replicas():
    prefill, decode = HeadSharding(2, 8), HeadSharding(2, 2)  # each head on 4 prefill ranks
    assert sources_of(0, prefill, decode) == [0] and sources_of(1, prefill, decode) == [5]
    assert [targets_of(i, prefill, decode) for i in range(8)] == [[0], [], [], [], [], [1], [], []]


def test_tp_sizes_that_do_not_split_the_heads_are_refused_with_both_numbers():
    assert tp_problem(8, 3) == ("TP size 3 does not divide the model's 8 KV heads, nor do they divide it; "
                                "use a TP size that divides 8 or a multiple of it")
    assert tp_problem(4, 8) == "" and tp_problem(8, 4) == ""
    with pytest.raises(ShardingError, match="TP size 6"):
        HeadSharding(4, 6)
    with pytest.raises(ShardingError, match="not the same model"):
        pieces_for_decode(0, HeadSharding(4, 2), HeadSharding(8, 2))
