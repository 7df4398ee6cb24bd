"""Block address math from KV tensors' shapes and strides (coalescing lives in coalesce.py).

A KV tensor holds `num_blocks` blocks along one dimension (the block dimension). Every index of
the dimensions before it is one region (e.g. K and V of a `[2, num_blocks, ...]` CUDA layout);
everything after it is one contiguous block of bytes. vLLM's CPU layout
`[num_blocks, kv_heads, block_size, 2*head_dim]` has a single region per layer.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

from .regions import HeadLayout, Region


class LayoutError(ValueError):
    """A KV tensor whose blocks are not addressable as equal contiguous byte ranges."""


@dataclass(frozen=True)
class TensorView:
    """What layout math needs of a tensor (torch-free, so it is testable with plain numbers)."""

    data_ptr: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]  # in elements
    itemsize: int

    @classmethod
    def of(cls, tensor) -> TensorView:
        return cls(tensor.data_ptr(), tuple(tensor.shape), tuple(tensor.stride()), tensor.element_size())


def block_dim(view: TensorView, num_blocks: int) -> int:
    """The dimension that indexes blocks: of size num_blocks, the outermost one by stride."""
    candidates = [d for d, n in enumerate(view.shape) if n == num_blocks]
    if not candidates:
        raise LayoutError(f"no dimension of size num_blocks={num_blocks} in KV tensor of shape {view.shape}")
    return max(candidates, key=lambda d: view.strides[d])


def regions_of(view: TensorView, num_blocks: int) -> list[Region]:
    dim = block_dim(view, num_blocks)
    inner_shape, inner_strides = view.shape[dim + 1:], view.strides[dim + 1:]
    expected = 1
    # by stride, not by position: vLLM's NHD views of an HND-ordered block (and vice versa) permute
    # the inner dimensions, yet the block's bytes are still one dense range
    for stride, size in sorted(zip(inner_strides, inner_shape)):
        if size > 1 and stride != expected:
            raise LayoutError(f"KV tensor of shape {view.shape}, strides {view.strides}: a block is not contiguous")
        expected *= size
    block_len = expected * view.itemsize
    stride = view.strides[dim] * view.itemsize
    if stride < block_len:
        raise LayoutError(f"KV tensor of shape {view.shape}: blocks overlap (stride {stride} < {block_len} bytes)")
    regions = []
    for outer in itertools.product(*(range(n) for n in view.shape[:dim])):
        offset = sum(i * s for i, s in zip(outer, view.strides[:dim])) * view.itemsize
        regions.append(Region(base=view.data_ptr + offset, block_len=block_len, stride=stride, num_blocks=num_blocks))
    return regions


def head_layout(view: TensorView, num_blocks: int, heads: int) -> HeadLayout:
    """Where this rank's `heads` KV heads lie inside each block of the tensor's regions.

    The head dimension is the first one after the block dimension whose size is `heads`, or the
    second when the first is a K/V split of size 2 (vLLM's per-layer views: [blocks, heads,
    tokens, content], its CPU cache [blocks, heads, block_size, 2 * head_size], FlashInfer's
    [blocks, 2, heads, tokens, head_size]). Dimensions whose stride is larger lie outside the
    heads: a head slice of a block is one range per index of those. A cache without a head
    dimension (a latent cache) holds one head filling the block.
    """
    block_len = regions_of(view, num_blocks)[0].block_len
    dim = block_dim(view, num_blocks)
    inner = list(zip(view.shape[dim + 1:], view.strides[dim + 1:]))
    sizes = [n for n, _ in inner]
    at = 1 if len(sizes) > 1 and sizes[0] == 2 and sizes[1] == heads else next(
        (i for i, n in enumerate(sizes) if n == heads), None)
    if at is None:
        if heads == 1:
            return HeadLayout.whole(block_len)
        raise LayoutError(f"KV tensor of shape {view.shape}: no dimension of {heads} heads after the block dimension")
    head_stride = inner[at][1]
    outside, inside = [], 1
    for i, (n, stride) in enumerate(inner):
        if i == at or n == 1:
            continue
        if stride > head_stride or (stride == head_stride and i < at):
            outside.append((n, stride))
        else:
            inside *= n
    if inside != head_stride:
        if heads == 1:  # a size-1 head dimension may carry any stride: the block is the head
            return HeadLayout.whole(block_len)
        raise LayoutError(f"KV tensor of shape {view.shape}, strides {view.strides}: a head is not one dense range")
    offsets = sorted(sum(i * s for i, (_, s) in zip(index, outside))
                     for index in itertools.product(*(range(n) for n, _ in outside)))
    return HeadLayout(heads, head_stride * view.itemsize, tuple(o * view.itemsize for o in offsets))


def kv_regions(views: Iterable[TensorView], num_blocks: int) -> list[Region]:
    """Regions of all layers; layers that share one tensor are listed once."""
    seen: set[int] = set()
    out: list[Region] = []
    for view in views:
        for region in regions_of(view, num_blocks):
            if region.base not in seen:
                seen.add(region.base)
                out.append(region)
    return out


def region_spans(regions: Sequence[Region]) -> list[tuple[int, int]]:
    """(start address, byte length) of the memory the regions cover, for registration.

    Overlapping regions (the layers of a block-major cache interleave) become one span, because a
    coalesced descriptor may cross from one into the next and NIXL needs each descriptor inside one
    registration. Regions that merely touch stay apart: they may be separate allocations, and one
    registration across two CUDA allocations breaks CUDA IPC ("invalid argument" on the copy).
    """
    spans: list[list[int]] = []
    for start, end in sorted((r.base, r.base + (r.num_blocks - 1) * r.stride + r.block_len) for r in regions):
        if spans and start < spans[-1][1]:
            spans[-1][1] = max(spans[-1][1], end)
        else:
            spans.append([start, end])
    return [(start, end - start) for start, end in spans]


def descriptor_table(regions: Sequence[Region], device_id: int = 0) -> np.ndarray:
    """Nx3 (address, length, device) rows, one per block of each region, region-major."""
    rows = []
    for r in regions:
        addrs = r.base + np.arange(r.num_blocks, dtype=np.int64) * r.stride
        rows.append(np.stack([addrs, np.full_like(addrs, r.block_len), np.full_like(addrs, device_id)], axis=1))
    return np.concatenate(rows)


def descriptor_indices(regions: Sequence[Region], block_ids: Sequence[int]) -> np.ndarray:
    """Rows of descriptor_table for the given blocks in every region, region-major."""
    blocks = np.asarray(block_ids, dtype=np.int64)
    offsets = np.cumsum([0] + [r.num_blocks for r in regions[:-1]])
    return (offsets[:, None] + blocks[None, :]).reshape(-1).astype(np.int32)
