"""The compatibility layer against the connector interfaces of the vLLM releases it supports.

Each release's interface is stood in for by a base class with the methods that release's
`KVConnectorBase_V1` defines (recorded from the released wheels' base.py, the ones that differ
between 0.25.1 and 0.32.0), and by scheduler outputs and a cross-layer KV cache shaped like
that release's."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvpush.connector.cache_layout import descriptors_per_run
from kvpush.connector.layout import TensorView, kv_regions
from kvpush.connector.vllm_compat import (
    Interface,
    ScheduledBlocks,
    UnsupportedVllm,
    check_installed,
    cross_layer_views,
    release,
    unsupported_reason,
)

# Methods of KVConnectorBase_V1 that differ between the supported releases, per release
# (read from vllm/distributed/kv_transfer/kv_connector/v1/base.py of each wheel).
RELEASE_METHODS = {
    "0.25.1": ("prefer_cross_layer_blocks", "register_cross_layers_kv_cache", "bind_gpu_block_pool"),
    "0.27.0": ("prefer_cross_layer_blocks", "register_cross_layers_kv_cache", "bind_gpu_block_pool",
               "requires_kv_delivery"),
    "0.29.0": ("bind_gpu_block_pool", "requires_kv_delivery"),
    "0.30.0": ("bind_gpu_block_pool", "requires_kv_delivery", "bind_kv_cache_manager", "get_transfer_results",
               "finish_forward"),
    "0.32.0": ("bind_gpu_block_pool", "requires_kv_delivery", "bind_kv_cache_manager", "get_transfer_results",
               "finish_forward", "get_loaded_kv_cache_group_ids"),
}


def base_of(version: str) -> type:
    return type(f"KVConnectorBase_V1_{version}", (), {name: lambda self, *a: None for name in RELEASE_METHODS[version]})


@pytest.mark.parametrize("version, supported", [
    ("0.24.0", False), ("0.25.0", True), ("0.25.1", True), ("0.28.0", True), ("0.30.0rc1.dev5+g1234", True),
    ("0.32.0", True), ("0.32.3+cpu", True), ("0.33.0", False), ("1.0.0", False),
])
def test_supported_range(version, supported):
    reason = unsupported_reason(version)
    assert (reason is None) == supported
    if not supported:
        assert f"vLLM {version} is not supported" in reason and "0.25 through 0.32" in reason and "\n" not in reason


def test_an_unreadable_version_is_refused_naming_the_range():
    assert release("dev") is None
    assert "0.25 through 0.32" in unsupported_reason("dev")


def test_check_installed_refuses_at_start_up(monkeypatch):
    import vllm

    monkeypatch.setattr(vllm, "__version__", "0.24.0", raising=False)
    with pytest.raises(UnsupportedVllm, match=r"vLLM 0\.24\.0 is not supported; kvpush's connector runs on vLLM 0\.25 through 0\.32"):
        check_installed()
    monkeypatch.setattr(vllm, "__version__", "0.25.1", raising=False)
    assert check_installed() == "0.25.1"


@pytest.mark.parametrize("version, manager, block_outer, cross_layer", [
    ("0.25.1", False, False, True), ("0.27.0", False, False, True), ("0.29.0", False, True, False),
    ("0.30.0", True, True, False), ("0.32.0", True, True, False),
])
def test_interface_read_off_each_release(version, manager, block_outer, cross_layer):
    iface = Interface.of(base_of(version))
    assert (iface.binds_kv_cache_manager, iface.block_outer_layouts, iface.cross_layer_blocks) == (manager, block_outer, cross_layer)
    # the block-outermost placement: asked as a layout where vLLM has them, as cross-layer blocks before
    assert iface.layout_to_ask("BLHNC") == ("BLHNC" if block_outer else None)
    assert iface.wants_cross_layer_blocks("BLHNC") == cross_layer
    # CPU or MLA: nothing asked either way
    assert iface.layout_to_ask(None) is None and not iface.wants_cross_layer_blocks(None)


def test_the_installed_release_is_read_as_its_interface():
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    from kvpush.connector.connector import INTERFACE

    assert INTERFACE == Interface.of(KVConnectorBase_V1)


class FlashAttentionOf025:
    """vLLM 0.25's FlashAttention backend: per-layer [num_blocks, 2, block_size, heads, head_size];
    with a layers dimension and NHD, blocks outermost: [num_blocks, layers, 2, block_size, heads, head_size]."""

    @staticmethod
    def get_kv_cache_stride_order(include_num_layers_dimension: bool = False):
        return (1, 0, 2, 3, 4, 5) if include_num_layers_dimension else (0, 1, 2, 3, 4)


def cross_layer_cache_of_025(num_layers=4, num_blocks=6, block_size=16, heads=2, head_size=8):
    """A cross-layer cache as vLLM 0.25's allocate_uniform_kv_caches makes it: the logical shape
    with a leading layers dimension, permuted into the backend's stride order, one allocation."""
    logical = (num_layers, num_blocks, 2, block_size, heads, head_size)
    order = FlashAttentionOf025.get_kv_cache_stride_order(include_num_layers_dimension=True)
    physical = torch.arange(int(torch.tensor(logical).prod()), dtype=torch.float32).view(tuple(logical[i] for i in order))
    config = SimpleNamespace(kv_cache_tensors=[SimpleNamespace(shared_by=[f"model.layers.{i}.self_attn.attn"])
                                               for i in range(num_layers)])
    return physical, config


def test_cross_layer_views_are_the_layers_views_and_one_range_per_block():
    physical, config = cross_layer_cache_of_025()
    views = cross_layer_views(physical, FlashAttentionOf025, config)
    assert list(views) == [f"model.layers.{i}.self_attn.attn" for i in range(4)]
    # layer i of block b is physical[b, i]: the view addresses exactly those bytes
    for i, view in enumerate(views.values()):
        assert view.shape == (6, 2, 16, 2, 8)
        assert torch.equal(view[3], physical[3, i])
    regions = kv_regions((TensorView.of(v) for v in views.values()), num_blocks=6)
    assert len(regions) == 4  # one per layer, interleaved block by block
    assert descriptors_per_run(regions) == 1  # a run of blocks is one descriptor, as with BLHNC


def test_cross_layer_views_without_a_stride_order_keep_the_tensor_order():
    physical, config = cross_layer_cache_of_025()

    class NoOrder:
        pass

    views = cross_layer_views(physical, NoOrder, config)
    assert torch.equal(views["model.layers.2.self_attn.attn"], physical[2])


def output_of(new=(), cached=(), resumed=(), finished=()):
    """A SchedulerOutput shaped like 0.25-0.32's: NewRequestData(req_id, block_ids) and
    CachedRequestData(req_ids, new_block_ids, resumed_req_ids)."""
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r, block_ids=(list(b),)) for r, b in new],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[r for r, _ in cached],
                                              new_block_ids=[None if b is None else (list(b),) for _, b in cached],
                                              resumed_req_ids=set(resumed)),
        finished_req_ids=set(finished))


def test_scheduled_blocks_follow_the_scheduler_outputs():
    pool = SimpleNamespace(evicted=[], evict_blocks=lambda ids: pool.evicted.append(ids))
    blocks = ScheduledBlocks(pool)
    blocks.observe(output_of(new=[("a", [4, 5]), ("b", [9])]))
    blocks.observe(output_of(cached=[("a", [6]), ("b", None)]))  # a's next chunk got a block; b none
    assert blocks.get_block_ids("a") == ([4, 5, 6],) and blocks.get_block_ids("b") == ([9],)
    blocks.observe(output_of(cached=[("b", [1, 2])], resumed={"b"}))  # resumed after a preemption: all of them
    assert blocks.get_block_ids("b") == ([1, 2],)
    blocks.observe(output_of(finished={"a"}))
    assert blocks.get_block_ids("a") == ([],)
    blocks.evict_blocks({7, 8})
    assert pool.evicted == [{7, 8}]


def test_scheduled_blocks_without_tracking_only_evict():
    pool = SimpleNamespace(evict_blocks=lambda ids: None)
    blocks = ScheduledBlocks(pool, track=False)
    blocks.observe(output_of(new=[("a", [4])]))
    assert blocks.get_block_ids("a") == ([],)
