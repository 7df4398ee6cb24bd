"""What differs between the vLLM releases kvpush's connector runs on, kept in one place.

The connector supports vLLM 0.25 through 0.32 (`SUPPORTED`). Differences of the connector
interface (`KVConnectorBase_V1` and what the scheduler and model runner call on it) between those
releases, each with the release that brought it, and what the connector does before it:

- 0.27, the `requires_kv_delivery` property: it has it too; older releases never read it.
- 0.29, block-outermost KV cache layouts (`BLHNC`, ...) asked for by `get_required_kvcache_layout`;
  `prefer_cross_layer_blocks` / `register_cross_layers_kv_cache` gone: before, it asks for
  cross-layer blocks (`cross_layer_blocks`): one tensor whose blocks hold every layer (NHD inside),
  the same one descriptor per run of blocks; vLLM passes that tensor to
  `register_cross_layers_kv_cache`, which the connector turns back into per-layer views
  (`cross_layer_views`).
- (0.25) the V2 model runner (vLLM 0.25's default for Llama and others) allocates no cross-layer
  cache, whatever the connector prefers: it gets per-layer tensors, a descriptor per layer per run
  of blocks (32 for Llama-3.1-8B), logged; `VLLM_USE_V2_MODEL_RUNNER=0` selects the V1 runner,
  which allocates the cross-layer cache (not run on a GPU yet).
- 0.30, `bind_kv_cache_manager` (the scheduler's KVCacheManager): before, it gets only
  `bind_gpu_block_pool`: `ScheduledBlocks` answers a request's block ids from the scheduler's
  outputs and evicts through the block pool.
- 0.30, `get_transfer_results`, `finish_forward`: nothing; their defaults wrap `get_finished` / do
  nothing.
- 0.32, `CacheHitSource` (`vllm.v1.metrics.cache_hit_source`, the `prompt_tokens_by_source` label
  of external hits), `get_loaded_kv_cache_group_ids`: before, it labels no hit source; the method
  is never called.

Features are read off the interface itself (`Interface.of`), not off version strings, so patch
releases and backports follow what they ship. vLLM is imported only inside functions: `kvpush
doctor` reads `SUPPORTED` without it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SUPPORTED = ((0, 25), (0, 32))  # first and last (major, minor), both included
SUPPORTED_TEXT = "0.25 through 0.32"


class UnsupportedVllm(RuntimeError):
    """This vLLM release is outside the range the connector supports."""


def release(version: str) -> tuple[int, int] | None:
    """(major, minor) of a vLLM version string ("0.32.0", "0.25.1+cu130", "0.30.0rc1.dev5"), or None."""
    parts = version.split(".")
    try:
        return int(parts[0]), int("".join(ch for ch in parts[1] if ch.isdigit()) or "x")
    except (IndexError, ValueError):
        return None


def unsupported_reason(version: str) -> str | None:
    """Why kvpush's connector refuses this vLLM version (one line), or None if it supports it."""
    found = release(version)
    if found is None:
        return (
            f"kvpush: cannot tell which vLLM release {version!r} is; kvpush's connector supports vLLM {SUPPORTED_TEXT}"
        )
    if SUPPORTED[0] <= found <= SUPPORTED[1]:
        return None
    return (f"kvpush: vLLM {version} is not supported; kvpush's connector runs on vLLM {SUPPORTED_TEXT} "
            f"(install e.g. vllm=={SUPPORTED[1][0]}.{SUPPORTED[1][1]}.*)")


def check_installed() -> str:
    """The installed vLLM's version; raises UnsupportedVllm (one line) outside the supported range."""
    import vllm

    version = str(getattr(vllm, "__version__", "unknown"))
    reason = unsupported_reason(version)
    if reason is not None:
        raise UnsupportedVllm(reason)
    return version


@dataclass(frozen=True)
class Interface:
    """What this vLLM's connector interface offers, read off its KVConnectorBase_V1."""

    binds_kv_cache_manager: bool  # 0.30+: bind_kv_cache_manager, else bind_gpu_block_pool only
    block_outer_layouts: bool  # 0.29+: get_required_kvcache_layout may answer BLHNC
    cross_layer_blocks: bool  # 0.25-0.28: prefer_cross_layer_blocks / register_cross_layers_kv_cache

    @classmethod
    def of(cls, base: type) -> Interface:
        cross = hasattr(base, "register_cross_layers_kv_cache")
        return cls(binds_kv_cache_manager=hasattr(base, "bind_kv_cache_manager"),
                   block_outer_layouts=not cross, cross_layer_blocks=cross)

    def layout_to_ask(self, wanted: str | None) -> str | None:
        """The layout for get_required_kvcache_layout: a block-outermost one where vLLM knows them;
        before 0.29 nothing (vLLM's NHD), the block-outermost placement coming from cross-layer blocks."""
        return wanted if self.block_outer_layouts else None

    def wants_cross_layer_blocks(self, wanted: str | None) -> bool:
        """prefer_cross_layer_blocks: where a block-outermost layout is wanted and only cross-layer
        blocks give it (vLLM still falls back to per-layer tensors where the backend cannot)."""
        return self.cross_layer_blocks and wanted is not None


def cache_hit_source_p2p() -> Any:
    """vLLM's label for KV hits that came from another instance (0.32+), or None."""
    try:
        from vllm.v1.metrics.cache_hit_source import CacheHitSource
    except ImportError:
        return None
    return CacheHitSource.P2P


def cross_layer_views(kv_cache: Any, attn_backend: Any, kv_cache_config: Any) -> dict[str, Any]:
    """Per-layer views of a cross-layer KV cache (vLLM 0.25-0.28), as vLLM's model runner hands them
    to the attention layers: the tensor is laid out in the backend's stride order with a leading
    layers dimension; undo that order and index the layers in kv_cache_config's order."""
    try:
        order = tuple(attn_backend.get_kv_cache_stride_order(include_num_layers_dimension=True))
    except (AttributeError, NotImplementedError):
        order = tuple(range(kv_cache.dim()))
    logical = kv_cache.permute(*[order.index(i) for i in range(len(order))])
    return {name: logical[i] for i, tensor in enumerate(kv_cache_config.kv_cache_tensors) for name in tensor.shared_by}


class ScheduledBlocks:
    """The part of vLLM's KVCacheManager the scheduler half uses (`get_block_ids`, `evict_blocks`),
    for releases that bind only the block pool (before 0.30). A request's block ids are the ones
    the scheduler's outputs announced: all of them when it is scheduled new or resumed after a
    preemption, the new ones appended in every other step. Requests are forgotten once finished."""

    def __init__(self, block_pool: Any, track: bool = True):
        self._pool = block_pool
        self._track = track
        self._blocks: dict[str, list[int]] = {}

    def observe(self, scheduler_output: Any) -> None:
        """Before the connector builds a step's metadata: this step's allocations."""
        for req_id in getattr(scheduler_output, "finished_req_ids", ()) or ():
            self._blocks.pop(req_id, None)
        if not self._track:
            return
        for new in scheduler_output.scheduled_new_reqs:
            self._blocks[new.req_id] = list(new.block_ids[0])
        cached = scheduler_output.scheduled_cached_reqs
        resumed = set(getattr(cached, "resumed_req_ids", ()) or ())
        for req_id, new_ids in zip(cached.req_ids, cached.new_block_ids):
            if new_ids is None:
                continue
            if req_id in resumed:
                self._blocks[req_id] = list(new_ids[0])
            else:
                self._blocks.setdefault(req_id, []).extend(new_ids[0])

    def get_block_ids(self, req_id: str) -> tuple[list[int], ...]:
        return (list(self._blocks.get(req_id, ())),)

    def evict_blocks(self, block_ids: set[int]) -> None:
        self._pool.evict_blocks(set(block_ids))
