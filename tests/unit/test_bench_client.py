"""kvpush.deploy.bench.client: the exact `vllm bench serve` command, and how a client run ends."""
from __future__ import annotations

import sys
import time

import pytest

from kvpush.deploy.bench.client import LoadSpec, bench_serve_argv, run_bench_serve
from kvpush.deploy.errors import KvpushError


def _load(tmp_path, **changes) -> LoadSpec:
    values = dict(base_url="http://127.0.0.1:15000", served_model="tiny", tokenizer="/models/tiny", rate=2.0,
                  num_prompts=8, input_len=1024, output_len=32, seed=2000, result_dir=str(tmp_path),
                  result_filename="kvpush-rate2.json")
    values.update(changes)
    return LoadSpec(**values)


def _option(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_argv_drives_the_router_with_fresh_random_prompts(tmp_path):
    argv = bench_serve_argv(_load(tmp_path), command=["vllm"])
    assert argv[:3] == ["vllm", "bench", "serve"]
    assert _option(argv, "--base-url") == "http://127.0.0.1:15000"
    assert _option(argv, "--dataset-name") == "random"
    assert (_option(argv, "--random-input-len"), _option(argv, "--random-output-len")) == ("1024", "32")
    assert _option(argv, "--random-prefix-len") == "0"
    assert _option(argv, "--seed") == "2000" and _option(argv, "--request-rate") == "2"
    assert _option(argv, "--percentile-metrics") == "ttft,tpot,itl,e2el"
    assert _option(argv, "--metric-percentiles") == "50,90,99"
    assert "--ignore-eos" in argv and "--save-result" in argv
    assert _option(argv, "--result-filename") == "kvpush-rate2.json"
    # No endpoint ready check: its test request would reuse the first prompt and warm decode's cache.
    assert "--ready-check-timeout-sec" not in argv


def test_a_failing_client_is_a_one_line_error_naming_its_log(tmp_path):
    fail = [sys.executable, "-c", "print('connection refused by router'); raise SystemExit(3)"]
    with pytest.raises(KvpushError, match=r"at 2 req/s failed \(exit 3\): connection refused by router; full output in"):
        run_bench_serve(_load(tmp_path), tmp_path / "client.log", timeout_s=60, command=fail)


def test_a_client_past_its_timeout_is_killed(tmp_path):
    hang = [sys.executable, "-c", "import time; time.sleep(60)"]
    started = time.monotonic()
    with pytest.raises(KvpushError, match="did not finish within 1 s"):
        run_bench_serve(_load(tmp_path), tmp_path / "client.log", timeout_s=1, command=hang)
    assert time.monotonic() - started < 15
