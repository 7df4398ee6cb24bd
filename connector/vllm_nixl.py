"""vLLM's own NIXL connectors (pull and push), made fit to share a few CPU cores.

Loaded with `"kv_connector_module_path": "kvpush.connector.vllm_nixl"` and the stock class names
(`NixlConnector`, `NixlPushConnector`: vLLM enables connector-specific behaviour by those names).
The protocol, wire format and handshake are vLLM's own, untouched. Two things change, both only
while vLLM's connector worker is constructed:

- NIXL's progress thread sleeps up to `progress_delay_us` (extra config; default by platform,
  transfer.PROGRESS_DELAY_US) between rounds instead of busy-polling a whole core;
- on a CPU platform, vLLM moves the compute thread to the last core of each NUMA node for its
  transfer work, which stacks prefill and decode on one core despite `VLLM_CPU_OMP_THREADS_BIND`;
  the thread's CPU affinity is put back to what it was.

kvpush's bench and tests compare these against kvpush's connector, which does both by design.
"""
from __future__ import annotations

import logging
import os
from contextlib import contextmanager
from typing import Any, Iterator

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlPullConnector
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlPushConnector as _StockPush

from .engine_wakeups import tune_step_queues
from .settings import kv_on_cpu
from .transfer import PROGRESS_DELAY_US, progress_thread_delay

__all__ = ["NixlConnector", "NixlPushConnector"]

log = logging.getLogger(__name__)


@contextmanager
def _keep_thread_affinity() -> Iterator[None]:
    if not hasattr(os, "sched_getaffinity"):
        yield
        return
    before = os.sched_getaffinity(0)
    try:
        yield
    finally:
        after = os.sched_getaffinity(0)
        if after != before:
            os.sched_setaffinity(0, before)
            log.info("kvpush: kept the compute thread on cores %s (vLLM's NIXL worker moved it to %s)",
                     sorted(before), sorted(after))


@contextmanager
def _quiet_worker(vllm_config: Any, role: KVConnectorRole) -> Iterator[None]:
    # both roles: the engine reads its workers' answers from such a queue too
    tune_step_queues(on_cpu=kv_on_cpu(vllm_config.kv_transfer_config))
    if role != KVConnectorRole.WORKER:
        yield
        return
    kv = vllm_config.kv_transfer_config
    default = PROGRESS_DELAY_US["DRAM" if kv_on_cpu(kv) else "VRAM"]
    delay_us = int(kv.get_from_extra_config("progress_delay_us", default))
    with progress_thread_delay(delay_us), _keep_thread_affinity():
        yield


class NixlConnector(NixlPullConnector):
    """vLLM's pull connector (NIXL READ by decode), with a sleeping progress thread."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None):
        with _quiet_worker(vllm_config, role):
            super().__init__(vllm_config, role, kv_cache_config)


class NixlPushConnector(_StockPush):
    """vLLM's push connector (NIXL WRITE by prefill), with a sleeping progress thread."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None):
        with _quiet_worker(vllm_config, role):
            super().__init__(vllm_config, role, kv_cache_config)
