"""The warm `vllm bench serve` process with vLLM's real client: two load levels against an
imitation vLLM server in ONE client process, each leaving vLLM's own result file."""
from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path

import pytest

from kvpush.bench.client import BenchClient, LoadSpec
from kvpush.deploy.topology.topology import TinyModelSpec
from fake_upstream import FakeVllm


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    from kvpush.deploy.lifecycle.tiny_model import make_tiny_model

    path = tmp_path_factory.mktemp("tiny") / "model"
    make_tiny_model(path, TinyModelSpec())
    return path


@pytest.fixture
def fake_server():
    loop = asyncio.new_event_loop()
    server = FakeVllm(model="tiny")
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    url = asyncio.run_coroutine_threadsafe(server.start(), loop).result(30)
    try:
        yield server, url
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def test_two_levels_in_one_warm_vllm_client(tmp_path, tokenizer_dir, fake_server):
    server, url = fake_server
    with BenchClient(tmp_path / "logs" / "client.log") as client:
        results = []
        for rate in (4.0, 8.0):
            load = LoadSpec(base_url=url, served_model="tiny", tokenizer=str(tokenizer_dir), rate=rate, num_prompts=3,
                            input_len=16, output_len=4, seed=7, result_dir=str(tmp_path / "raw"),
                            result_filename=f"rate{rate:g}.json")
            path = client.run(load, tmp_path / "logs" / f"rate{rate:g}.log", timeout_s=300)
            results.append(json.loads(path.read_text()))
        worker_pid = client._proc.pid
    assert [r["completed"] for r in results] == [3, 3]
    assert [r["request_rate"] for r in results] == [4.0, 8.0]
    assert all(r["median_ttft_ms"] is not None for r in results)
    assert len([r for r in server.received if r.path == "/v1/completions"]) == 6
    assert worker_pid > 0 and "request_rate" in (tmp_path / "logs" / "rate8.log").read_text().lower()
