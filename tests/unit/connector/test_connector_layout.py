"""Block addresses from shapes/strides (CPU and CUDA layouts)."""
from __future__ import annotations

import numpy as np
import pytest

from kvpush.connector.layout import (
    LayoutError, TensorView, block_dim, descriptor_indices, descriptor_table, kv_regions, regions_of,
)


def contiguous(shape, itemsize=2, ptr=1 << 20):
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= n
    return TensorView(ptr, tuple(shape), tuple(reversed(strides)), itemsize)


def test_cpu_layout_one_region_per_layer():
    # vLLM CPU: [num_blocks, kv_heads, block_size, 2*head_dim]
    [r] = regions_of(contiguous((100, 2, 128, 128)), 100)
    assert r.block_len == 2 * 128 * 128 * 2 and r.stride == r.block_len and r.num_blocks == 100


def test_cuda_kv_first_layout_two_regions():
    # [2, num_blocks, block_size, kv_heads, head_dim] (NHD)
    k, v = regions_of(contiguous((2, 50, 16, 8, 128)), 50)
    assert k.block_len == 16 * 8 * 128 * 2
    assert v.base - k.base == 50 * k.block_len


def test_blocks_first_layout_with_kv_inside_block():
    # [num_blocks, 2, block_size, kv_heads, head_dim]
    [r] = regions_of(contiguous((50, 2, 16, 8, 128)), 50)
    assert r.block_len == 2 * 16 * 8 * 128 * 2


def test_block_dim_picks_outermost_when_sizes_collide():
    view = contiguous((16, 16, 4))
    assert block_dim(view, 16) == 0


def test_non_contiguous_block_is_refused():
    view = TensorView(4096, (10, 4, 8), (64, 16, 1), 2)  # rows of 8 elements, 16 apart: gaps
    with pytest.raises(LayoutError):
        regions_of(view, 10)


def test_permuted_dense_block_is_one_range():
    # an HND view of an NHD-ordered block: inner dims permuted, bytes still dense
    [r] = regions_of(TensorView(4096, (10, 4, 8), (32, 1, 4), 2), 10)
    assert r.block_len == 64


def test_missing_block_dimension_is_refused():
    with pytest.raises(LayoutError, match="num_blocks=7"):
        regions_of(contiguous((10, 4)), 7)


def test_shared_tensor_listed_once():
    view = contiguous((10, 64))
    assert len(kv_regions([view, view], 10)) == 1


def test_descriptor_table_and_indices_agree():
    views = [contiguous((4, 8), ptr=1000), contiguous((4, 8), ptr=5000)]
    regions = kv_regions(views, 4)
    table = descriptor_table(regions)
    idx = descriptor_indices(regions, [3, 1])
    assert table[idx][:, 0].tolist() == [1000 + 3 * 16, 1000 + 16, 5000 + 3 * 16, 5000 + 16]
    assert (table[:, 1] == 16).all() and idx.dtype == np.int32
