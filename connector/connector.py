"""KVPushConnector: vLLM's KVConnectorBase_V1 interface mapped onto PushScheduler / PushWorker."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from . import vllm_compat
from .cache_layout import required_layout
from .engine_wakeups import tune_step_queues
from .metadata import Evictions, PushMetadata
from .prom import PushPromMetrics
from .scheduler import PushScheduler
from .settings import Settings, transfer_params_key
from .stats import PushStats
from .worker import PushWorker

if TYPE_CHECKING:
    from vllm.v1.outputs import KVConnectorOutput

log = logging.getLogger(__name__)

# what this vLLM release's connector interface offers (vllm_compat.py lists the differences)
INTERFACE = vllm_compat.Interface.of(KVConnectorBase_V1)
_P2P_HIT_SOURCE = vllm_compat.cache_hit_source_p2p()


@dataclass
class KVPushMetadata(PushMetadata, KVConnectorMetadata):
    """PushMetadata as the type vLLM carries from scheduler to worker."""


@dataclass(frozen=True)
class KVPushWorkerMetadata(Evictions, KVConnectorWorkerMetadata):
    """Evictions as the type vLLM carries from worker to scheduler."""

    def aggregate(self, other: Evictions | KVConnectorWorkerMetadata) -> KVPushWorkerMetadata:
        assert isinstance(other, Evictions), "vLLM aggregates the metadata of this connector's workers only"
        return KVPushWorkerMetadata(self.blocks | other.blocks)


@dataclass
class KVPushStats(PushStats, KVConnectorStats):
    """PushStats as the type vLLM's stats logger aggregates and reduces."""

    def aggregate(self, other: PushStats | KVConnectorStats) -> KVPushStats:
        assert isinstance(other, PushStats), "vLLM aggregates the stats of this connector's workers only"
        PushStats.aggregate(self, other)
        return self


class KVPushPromMetrics(KVConnectorPromMetrics):
    """vLLM's per-connector Prometheus hook, backed by PushPromMetrics."""

    def __init__(self, vllm_config: Any, metric_types: dict[type, type], labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._push = PushPromMetrics(self._counter_cls, self._histogram_cls, labelnames, per_engine_labelvalues)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        self._push.observe(transfer_stats_data, engine_idx)


def _log_through_vllm() -> None:
    """The connector's modules log under `kvpush.connector`; inside vLLM, route them to vLLM's
    handlers and level (VLLM_LOGGING_LEVEL) so they land in the server log with its format."""
    ours, vllm_logger = logging.getLogger("kvpush.connector"), logging.getLogger("vllm")
    if not ours.handlers and vllm_logger.handlers:
        for handler in vllm_logger.handlers:
            ours.addHandler(handler)
        ours.setLevel(vllm_logger.level)
        ours.propagate = False


def _wanted_layout(vllm_config: Any) -> str | None:
    """The KV cache layout kvpush wants for this deployment (cache_layout.py), whatever the release."""
    model_config = getattr(vllm_config, "model_config", None)
    device_type = str(getattr(getattr(vllm_config, "device_config", None), "device_type", "") or "")
    return required_layout(device_type, bool(getattr(model_config, "use_mla", False)))


class KVPushConnector(KVConnectorBase_V1):
    if _P2P_HIT_SOURCE is not None:
        _cache_hit_source = _P2P_HIT_SOURCE

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None):
        vllm_compat.check_installed()
        super().__init__(vllm_config, role, kv_cache_config)
        _log_through_vllm()
        self.settings = Settings.from_vllm(vllm_config, kv_cache_config)
        self._cross_layer_blocks = INTERFACE.wants_cross_layer_blocks(_wanted_layout(vllm_config))
        self._scheduled_blocks: vllm_compat.ScheduledBlocks | None = None  # before vLLM 0.30
        tune_step_queues(on_cpu=self.settings.buffer_device == "cpu")
        self._scheduler: PushScheduler | None = None
        self._worker: PushWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = PushScheduler(
                self.settings.block_size,
                self.settings.is_producer,
                self.settings.engine_id,
                KVPushMetadata,
                transfer_params_key(self.settings),
            )
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            self._worker = PushWorker(self.settings, kv_cache_config.num_blocks, get_tensor_model_parallel_rank())

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        """On CUDA, a block-outermost layout: one block of every layer is one range, so a run of
        blocks is one descriptor (cache_layout.py). vLLM falls back, with a warning, when the
        attention backend cannot use it; the worker then logs what that costs."""
        layout = INTERFACE.layout_to_ask(_wanted_layout(vllm_config))
        if layout is not None:
            log.info("kvpush: asking vLLM for the %s KV cache layout (one descriptor per run of blocks)", layout)
        return layout

    @property
    def prefer_cross_layer_blocks(self) -> bool:
        """vLLM before 0.29: one KV tensor whose blocks hold every layer (the block-outermost
        placement later releases give through get_required_kvcache_layout)."""
        return getattr(self, "_cross_layer_blocks", False)  # read by vLLM, maybe before __init__ ends

    @property
    def requires_kv_delivery(self) -> bool:
        return self.settings.is_producer

    # ---- worker side ---------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        assert self._worker is not None
        if self._cross_layer_blocks:  # asked for cross-layer blocks (before vLLM 0.29) and got per-layer tensors
            log.warning(
                "kvpush: vLLM allocated one KV tensor per layer, not the cross-layer cache asked for (vLLM's V2 model "
                "runner, its default for many models, has none; VLLM_USE_V2_MODEL_RUNNER=0 selects the V1 runner, "
                "which has it): a push takes a descriptor per layer per run of blocks"
            )
        self._worker.register_kv_caches(kv_caches)

    def register_cross_layers_kv_cache(self, kv_cache: Any, attn_backend: Any) -> None:
        """vLLM before 0.29, where prefer_cross_layer_blocks made it allocate one tensor for all layers."""
        log.info("kvpush: vLLM allocated a cross-layer KV cache of shape %s", tuple(kv_cache.shape))
        assert self._worker is not None
        self._worker.register_kv_caches(vllm_compat.cross_layer_views(kv_cache, attn_backend, self._kv_cache_config))

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        # before the forward pass, not after it (where start_load_kv runs): D registers its blocks,
        # P on a GPU marks the steps it saved whose marks its recorder thread has not recorded yet
        if self._worker is not None and isinstance(connector_metadata, PushMetadata):
            self._worker.bind(connector_metadata)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._worker is not None:
            self._worker.wait_for_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return

    def wait_for_save(self) -> None:
        if self._worker is not None and self.has_connector_metadata():
            meta = self._get_connector_metadata()
            if isinstance(meta, PushMetadata):
                self._worker.save(meta)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        assert self._worker is not None
        return self._worker.get_finished(finished_req_ids)

    def build_connector_worker_meta(self) -> KVPushWorkerMetadata | None:
        blocks = self._worker.take_evictions() if self._worker is not None else set()
        return KVPushWorkerMetadata(frozenset(blocks)) if blocks else None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.load_errors() if self._worker is not None else set()

    def get_kv_connector_stats(self) -> KVPushStats | None:
        if self._scheduler is not None:  # what the scheduler refused; vLLM adds it to the workers' stats
            refused = self._scheduler.take_refused()
            if not refused:
                return None
            stats = PushStats()
            stats.record_refused_params(refused)
            return KVPushStats(data=stats.data)
        taken = self._worker.take_stats() if self._worker is not None else None
        return KVPushStats(data=taken.data) if taken is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVPushStats | None:
        return KVPushStats(data=data) if data is not None else KVPushStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: dict[type, type], labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KVPushPromMetrics:
        return KVPushPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()

    # ---- scheduler side ------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def get_loaded_kv_cache_group_ids(self, request: Any) -> tuple[int, ...]:
        return tuple(range(len(self._kv_cache_config.kv_cache_groups)))

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        assert self._scheduler is not None
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        assert self._scheduler is not None
        if self._scheduled_blocks is not None:
            self._scheduled_blocks.observe(scheduler_output)
        meta = self._scheduler.build_connector_meta(scheduler_output)
        assert isinstance(meta, KVPushMetadata), "the scheduler is made with metadata_cls=KVPushMetadata"
        return meta

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        super().bind_gpu_block_pool(gpu_block_pool)
        if self._scheduler is not None and not INTERFACE.binds_kv_cache_manager:
            # vLLM before 0.30 binds no KVCacheManager: block ids come from the scheduler's outputs
            self._scheduled_blocks = vllm_compat.ScheduledBlocks(gpu_block_pool, track=self.settings.is_producer)
            self._scheduler.kv_cache_manager = self._scheduled_blocks

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        assert self._scheduler is not None
        self._scheduler.kv_cache_manager = kv_cache_manager

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        assert self._scheduler is not None
        self._scheduler.update_connector_output(connector_output.finished_sending, connector_output.finished_recving)
        worker_meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(worker_meta, Evictions) and worker_meta.blocks:
            self._scheduler.evict(worker_meta.blocks)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return self._scheduler.request_finished(request, block_ids)

    def on_new_request(self, request: Any) -> None:
        assert self._scheduler is not None
        self._scheduler.on_new_request(request)

    def has_pending_push_work(self) -> bool:
        return self._scheduler is not None and self._scheduler.has_pending_push_work()
