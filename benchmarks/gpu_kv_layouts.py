"""KV caches allocated the way vLLM's attention backends lay them out, and a byte pattern to prove
a transfer moved every byte to the right place. Used by the GPU transfer benchmarks; no vLLM needed.

Layouts (B blocks, L layers, N tokens per block, H KV heads, D head_dim, C = 2*D: K then V):
- nhd:   per layer `[2, B, N, H, D]` (FlashAttention before vLLM's layout descriptor), own tensor
- hnd:   per layer physical `[2, B, H, N, D]`, handed over as the permuted `[2, B, N, H, D]` view
- lbnhc: vLLM 0.32 `KVCacheLayout.LBNHC` (its "NHD"): one buffer `[L, B, N, H, C]`, per-layer views
         `[B, H, N, C]`
- lbhnc: vLLM 0.32 `LBHNC` ("HND"): one buffer `[L, B, H, N, C]`
- blnhc: vLLM 0.32 `BLNHC`, block-outermost (cross-layer): one buffer `[B, L, N, H, C]`, so one
         block of every layer is one contiguous range
- blhnc: vLLM 0.32 `BLHNC`, block-outermost: `[B, L, H, N, C]`
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

LAYOUTS = ("nhd", "hnd", "lbnhc", "lbhnc", "blnhc", "blhnc")
POISON = -23131  # 0xA5A5 as int16: what every destination byte holds before a transfer


@dataclass(frozen=True)
class Shape:
    num_layers: int
    num_blocks: int
    block_size: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.bfloat16

    @property
    def bytes_per_block(self) -> int:
        """All layers, K and V."""
        return self.num_layers * 2 * self.block_size * self.kv_heads * self.head_dim * self.dtype.itemsize


@dataclass
class KVCache:
    layout: str
    layers: list[torch.Tensor]  # what vLLM hands the connector, one view per layer
    block_dim: int  # the block dimension of each layer view
    buffers: list[torch.Tensor]  # the allocations behind the views

    def block_major(self, layer: int) -> torch.Tensor:
        """Layer view as int16 (bit patterns of bf16) with the block dimension first."""
        return self.layers[layer].view(torch.int16).movedim(self.block_dim, 0)


def allocate(layout: str, shape: Shape, device: str) -> KVCache:
    L, B, N, H, D = shape.num_layers, shape.num_blocks, shape.block_size, shape.kv_heads, shape.head_dim
    kw = dict(dtype=shape.dtype, device=device)
    if layout == "nhd":
        tensors = [torch.empty((2, B, N, H, D), **kw) for _ in range(L)]
        return KVCache(layout, tensors, 1, tensors)
    if layout == "hnd":
        physical = [torch.empty((2, B, H, N, D), **kw) for _ in range(L)]
        return KVCache(layout, [t.permute(0, 1, 3, 2, 4) for t in physical], 1, physical)
    C = 2 * D
    page = N * H * C
    raw = torch.empty(L * B * page, **kw)
    inner = {"lbnhc": (C, H * C), "blnhc": (C, H * C), "lbhnc": (N * C, C), "blhnc": (N * C, C)}
    if layout not in inner:
        raise ValueError(f"unknown layout {layout!r}; one of {', '.join(LAYOUTS)}")
    head_stride, token_stride = inner[layout]
    block_outer = layout.startswith("b")
    block_stride = L * page if block_outer else page
    layer_offset = page if block_outer else B * page
    views = [torch.as_strided(raw, (B, H, N, C), (block_stride, head_stride, token_stride, 1), layer * layer_offset)
             for layer in range(L)]
    return KVCache(layout, views, 0, [raw])


def pattern(layer: int, blocks: torch.Tensor, block_shape: tuple[int, ...], salt: int = 0) -> torch.Tensor:
    """int16 contents of `blocks` of `layer`: a function of (layer, block, logical offset) that
    differs by a non-zero constant between any two blocks of a layer, so a block landing in the
    wrong place cannot match. `salt` (0..65535) tells caches apart (e.g. tensor-parallel ranks:
    a shard landing on the wrong rank cannot match either)."""
    width = 1
    for n in block_shape:
        width *= n
    offsets = torch.arange(width, dtype=torch.int64, device=blocks.device)
    value = (layer * 1_000_003 + blocks.to(torch.int64)[:, None] * 7919 + offsets[None, :] * 31 + 12345
             + salt * 104_729) & 0xFFFF  # an odd multiplier: salts below 2**16 differ
    value = value - ((value >> 15) << 16)  # as signed 16-bit
    return value.to(torch.int16).reshape(len(blocks), *block_shape)


def fill(cache: KVCache, salt: int = 0) -> None:
    """Every block of every layer gets its pattern."""
    for layer in range(len(cache.layers)):
        view = cache.block_major(layer)
        blocks = torch.arange(view.shape[0], device=view.device)
        view[blocks] = pattern(layer, blocks, tuple(view.shape[1:]), salt)


def poison(cache: KVCache) -> None:
    for buf in cache.buffers:
        buf.view(torch.int16).fill_(POISON)


@dataclass(frozen=True)
class Verdict:
    wrong_elements: int  # destination elements that differ from the source block's pattern
    stray_elements: int  # elements outside the destination blocks that are no longer poison
    checked_bytes: int

    @property
    def ok(self) -> bool:
        return self.wrong_elements == 0 and self.stray_elements == 0


def verify(cache: KVCache, src_blocks: torch.Tensor, dst_blocks: torch.Tensor, salt: int = 0) -> Verdict:
    """Destination block dst[i] of every layer must hold source block src[i]'s pattern (filled
    with `salt`); every other block must still hold poison."""
    wrong = stray = checked = 0
    for layer in range(len(cache.layers)):
        view = cache.block_major(layer)
        got = view[dst_blocks]
        wrong += int((got != pattern(layer, src_blocks, tuple(view.shape[1:]), salt)).sum())
        checked += got.numel() * got.element_size()
        others = torch.ones(view.shape[0], dtype=torch.bool, device=view.device)
        others[dst_blocks] = False
        stray += int((view[others] != POISON).sum())
    return Verdict(wrong, stray, checked)
