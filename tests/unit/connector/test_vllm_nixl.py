"""kvpush.connector.vllm_nixl: vLLM's NIXL connectors with a sleeping progress thread and the
compute thread left on its cores. The real-vLLM run is tests/e2e/test_router_real_vllm.py."""
from __future__ import annotations

import os

import pytest

from kvpush.connector.transfer import progress_thread_delay


@pytest.fixture(scope="module")
def vllm_nixl():
    """The module, imported when a test here first runs rather than when tests are collected: it
    imports vLLM (14 of the unit lane's 22 s of collection on a 2-core machine), which only these
    tests need, so a run that selects others (`-k`) does not wait for it. vLLM stays a hard
    dependency: a renamed class fails these tests, loudly."""
    from kvpush.connector import vllm_nixl

    return vllm_nixl


def test_agents_made_inside_get_the_delay_and_the_binding_is_restored_after():
    from nixl import _api

    stock = _api.nixlBind.nixlAgentConfig
    with progress_thread_delay(250):
        config = _api.nixlBind.nixlAgentConfig(True)
        config.pthrDelay = 0  # what nixl_agent() does
        assert config.pthrDelay == 250
    assert _api.nixlBind.nixlAgentConfig is stock


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to move a thread")
def test_a_thread_moved_inside_is_put_back(vllm_nixl):
    before = os.sched_getaffinity(0)
    with vllm_nixl._keep_thread_affinity():
        os.sched_setaffinity(0, {max(before)})  # what vLLM's NIXL worker does on CPU
    assert os.sched_getaffinity(0) == before


def test_the_stock_class_names_vllm_keys_behaviour_on(vllm_nixl):
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlPullConnector, NixlPushConnector

    assert vllm_nixl.NixlConnector.__name__ == "NixlConnector" and issubclass(vllm_nixl.NixlConnector, NixlPullConnector)
    assert vllm_nixl.NixlPushConnector.__name__ == "NixlPushConnector"
    assert issubclass(vllm_nixl.NixlPushConnector, NixlPushConnector)
