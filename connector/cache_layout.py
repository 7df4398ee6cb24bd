"""Which KV cache layout the connector asks vLLM for, and what the layout it got costs a push.

A push moves each run of blocks as one descriptor per segment (coalesce.py): regions adjacent on
both sides merge into one segment. In vLLM's block-outermost layouts (`BLHNC`, `BLNHC`) one
block of every layer is one contiguous range, so a run of blocks is one descriptor; in the
layer-outermost ones (`LBHNC`, vLLM's CPU layout, or `LBNHC`, its CUDA default) it is one per
layer (and per K/V where they are separate tensors). NIXL's CUDA IPC post costs ~10 us per
descriptor, so on a GPU the layout decides the push time (benchmarks/notes/gpu-transfer-path.md,
"Descriptors decide everything").
"""
from __future__ import annotations

from typing import Sequence

from .coalesce import pair_segments
from .regions import Region

# Head-major inside the block: every CUDA attention backend of vLLM 0.32 that declares its
# layouts accepts it (FlashInfer on Blackwell: LBHNC or BLHNC), and FlashAttention and Triton
# declare none (any layout). BLNHC would do as well for a push but FlashInfer-on-Blackwell refuses it.
PREFERRED_GPU_LAYOUT = "BLHNC"


def required_layout(device_type: str, use_mla: bool) -> str | None:
    """The layout to ask vLLM for, or None to leave vLLM's choice (CPU: its attention backend
    supports LBHNC only; MLA: one latent tensor per layer, no K/V split to merge)."""
    if device_type != "cuda" or use_mla:
        return None
    return PREFERRED_GPU_LAYOUT


def descriptors_per_run(regions: Sequence[Region]) -> int:
    """Descriptors one run of adjacent blocks takes in a push between two caches of this layout."""
    return len(pair_segments(regions, regions))


def layout_cost_note(layout: str | None, regions: Sequence[Region], on_gpu: bool) -> str | None:
    """A log line for a KV cache that cannot push a run of blocks as one descriptor, or None."""
    per_run = descriptors_per_run(regions)
    if per_run == 1:
        return None
    name = layout or "vLLM's default"
    note = (f"kvpush: KV cache layout {name} puts a block's layers in {per_run} separate ranges, so a push takes "
            f"{per_run} NIXL descriptors per run of adjacent blocks instead of 1")
    if on_gpu:
        note += (
            f"; on an H200 that made a 16k-token push 2-5x slower when contiguous and ~100x slower when "
            f"fragmented (benchmarks/notes/gpu-transfer-path.md). vLLM did not give {PREFERRED_GPU_LAYOUT} (the "
            "attention backend "
            f"or VLLM_KV_CACHE_LAYOUT ruled it out); set VLLM_KV_CACHE_LAYOUT={PREFERRED_GPU_LAYOUT} on both "
            f"instances if the backend supports it"
        )
    return note
