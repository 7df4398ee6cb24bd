"""Which KV cache layout the connector asks vLLM for, and the log line for a layout that costs
more than one descriptor per run of blocks."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvpush.connector.cache_layout import (
    PREFERRED_GPU_LAYOUT,
    descriptors_per_run,
    layout_cost_note,
    required_layout,
)
from kvpush.connector.regions import Region

pytestmark = pytest.mark.unit

LAYERS, BLOCKS, PAGE = 4, 32, 8192


def block_outermost() -> list[Region]:
    """vLLM's BLHNC: per-layer views of one `[B, L, page]` buffer."""
    return [Region((1 << 30) + layer * PAGE, PAGE, LAYERS * PAGE, BLOCKS) for layer in range(LAYERS)]


def layer_outermost() -> list[Region]:
    """vLLM's LBHNC (CPU) / LBNHC: each layer's blocks one after another, layer after layer."""
    return [Region((1 << 30) + layer * BLOCKS * PAGE, PAGE, PAGE, BLOCKS) for layer in range(LAYERS)]


def split_kv() -> list[Region]:
    """Per-layer `[2, B, ...]` tensors: a K and a V region per layer."""
    return [Region((1 << 30) + i * BLOCKS * PAGE, PAGE, PAGE, BLOCKS) for i in range(2 * LAYERS)]


def test_gpu_asks_for_the_block_outermost_layout_and_cpu_or_mla_for_none():
    assert required_layout("cuda", use_mla=False) == PREFERRED_GPU_LAYOUT == "BLHNC"
    assert required_layout("cpu", use_mla=False) is None  # vLLM's CPU attention takes LBHNC only
    assert required_layout("cuda", use_mla=True) is None
    assert required_layout("", use_mla=False) is None


def test_the_preferred_layout_is_one_vllm_knows():
    from vllm.v1.kv_cache_layout import KVCacheLayout

    layout = KVCacheLayout[PREFERRED_GPU_LAYOUT]
    assert layout.is_block_outermost and layout.is_block_contiguous


def test_connector_answers_vllm_per_device():
    from kvpush.connector.connector import KVPushConnector

    def config(device_type, use_mla=False):
        return SimpleNamespace(device_config=SimpleNamespace(device_type=device_type),
                               model_config=SimpleNamespace(use_mla=use_mla))

    assert KVPushConnector.get_required_kvcache_layout(config("cuda")) == "BLHNC"
    assert KVPushConnector.get_required_kvcache_layout(config("cpu")) is None
    assert KVPushConnector.get_required_kvcache_layout(config("cuda", use_mla=True)) is None
    assert KVPushConnector.get_required_kvcache_layout(SimpleNamespace()) is None


@pytest.mark.parametrize("regions, per_run", [(block_outermost, 1), (layer_outermost, LAYERS), (split_kv, 2 * LAYERS)])
def test_descriptors_per_run_of_blocks(regions, per_run):
    assert descriptors_per_run(regions()) == per_run


def test_block_outermost_cache_needs_no_note():
    assert layout_cost_note("BLHNC", block_outermost(), on_gpu=True) is None


def test_gpu_fallback_note_names_layout_cost_and_fix():
    note = layout_cost_note("LBNHC", layer_outermost(), on_gpu=True)
    assert "LBNHC" in note and f"{LAYERS} NIXL descriptors per run" in note
    assert "VLLM_KV_CACHE_LAYOUT=BLHNC" in note and "\n" not in note


def test_cpu_note_states_the_cost_without_a_gpu_fix():
    note = layout_cost_note(None, layer_outermost(), on_gpu=False)
    assert "vLLM's default" in note and "VLLM_KV_CACHE_LAYOUT" not in note
