"""PushWorker.register_kv_caches with real NIXL on CPU tensors: the KV layout's cost is logged
when a run of blocks needs more than one descriptor, and not when it needs one; a CPU cache is
collapsed into huge pages and the log says how much."""
from __future__ import annotations

import logging
import os
import re

import pytest
import torch

from kvpush.connector.settings import Settings
from kvpush.connector.worker import PushWorker

os.environ.update({"UCX_MODULES": "^ib", "UCX_MEM_EVENTS": "no", "NIXL_LOG_LEVEL": "WARN"})
LAYERS, BLOCKS, PAGE_ELEMS = 3, 16, 1024


def settings(layout: str) -> Settings:
    return Settings(engine_id="D.w", is_producer=False, backend="UCX", side_channel_host="127.0.0.1",
                    side_channel_port=0, allowed_engines=frozenset({"P.w"}), transfer_timeout_s=1.0, peer_silence_s=1.0,
                    buffer_device="cpu", model="m", tp_size=1, kv_heads=1, block_size=16, progress_delay_us=100,
                    kv_cache_layout=layout, huge_pages=True, accepted_timeout_s=300.0, late_write_hold_s=30.0)


def caches(block_outermost: bool) -> dict[str, torch.Tensor]:
    if block_outermost:  # one [B, L, page] buffer, a strided view per layer
        raw = torch.zeros(BLOCKS, LAYERS, PAGE_ELEMS, dtype=torch.bfloat16)
        return {f"layer{i}": raw[:, i] for i in range(LAYERS)}
    return {f"layer{i}": torch.zeros(BLOCKS, PAGE_ELEMS, dtype=torch.bfloat16) for i in range(LAYERS)}


@pytest.mark.parametrize("block_outermost, layout", [(False, "LBHNC"), (True, "BLHNC")])
def test_layout_cost_is_logged_only_when_a_run_needs_several_descriptors(caplog, block_outermost, layout):
    worker = PushWorker(settings(layout), num_blocks=BLOCKS, tp_rank=0)
    with caplog.at_level(logging.INFO, logger="kvpush.connector"):
        worker.register_kv_caches(caches(block_outermost))
    try:
        notes = [r.getMessage() for r in caplog.records if "descriptors per run" in r.getMessage()]
        if block_outermost:
            assert notes == []
        else:
            assert len(notes) == 1 and f"{layout}" in notes[0] and f"{LAYERS} NIXL descriptors per run" in notes[0]
        assert worker.consumer._layout.device_id == 0 and worker._step_marks is None  # CPU tensors
    finally:
        worker.shutdown()


def test_a_cpu_cache_is_put_on_huge_pages_where_the_kernel_allows_and_keeps_its_bytes(caplog):
    kv = {f"layer{i}": torch.arange(4 * 1024 * 1024, dtype=torch.int32).view(BLOCKS, -1) for i in range(LAYERS)}
    expected = {name: t.clone() for name, t in kv.items()}
    worker = PushWorker(settings("LBHNC"), num_blocks=BLOCKS, tp_rank=0)
    with caplog.at_level(logging.INFO, logger="kvpush.connector"):
        worker.register_kv_caches(kv)
    try:
        [note] = [r.getMessage() for r in caplog.records if "of the KV cache on" in r.getMessage()]
        collapsed, requested = map(int, re.search(r"(\d+) of (\d+) MiB", note).groups())
        assert LAYERS * 14 <= requested <= LAYERS * 16  # whole 2 MiB pages inside 16 MiB each
        if "stays on base pages" not in note:  # the kernel agreed: all of it
            assert collapsed == requested
        assert all(torch.equal(kv[name], expected[name]) for name in kv)
    finally:
        worker.shutdown()
