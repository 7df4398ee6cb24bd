"""kvpush.bench.client: the exact `vllm bench serve` command, and how the warm client process
runs load levels, fails and ends. The worker here is a small stand-in speaking the same line protocol;
tests/integration/test_bench_warm_client.py runs the real one with vLLM's client."""
from __future__ import annotations

import json
import os
import shutil
import sys

import pytest

from kvpush.bench.client import BenchClient, LoadSpec, bench_serve_argv
from kvpush.common.errors import KvpushError


def _load(tmp_path, **changes) -> LoadSpec:
    values = dict(base_url="http://127.0.0.1:15000", served_model="tiny", tokenizer="/models/tiny", rate=2.0,
                  num_prompts=8, input_len=1024, output_len=32, seed=2000, result_dir=str(tmp_path),
                  result_filename="kvpush-rate2.json")
    values.update(changes)
    return LoadSpec(**values)


def _option(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_argv_drives_the_router_with_fresh_random_prompts(tmp_path):
    argv = bench_serve_argv(_load(tmp_path))
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


def test_a_shared_prefix_and_mixed_lengths_shape_only_the_prompts(tmp_path):
    argv = bench_serve_argv(_load(tmp_path, prefix_len=2048, input_len_spread=0.5))
    assert _option(argv, "--random-prefix-len") == "2048"
    assert json.loads(_option(argv, "--random-range-ratio")) == {"input": 0.5, "output": 0.0}  # outputs stay output_len
    assert _option(bench_serve_argv(_load(tmp_path)), "--random-range-ratio") == "0.0"


# A stand-in worker: ready line, then per job writes the result file named by the argv (or not),
# prints into the job's log and answers the exit status the job's seed asks for.
FAKE_WORKER = r'''
import json, os, sys
print(json.dumps({"ready": True, "pid": os.getpid()}), flush=True)
for line in sys.stdin:
    job = json.loads(line)
    argv = job["argv"]
    opt = lambda name: argv[argv.index(name) + 1]
    seed = int(opt("--seed"))
    if seed == 666:
        import time; time.sleep(60)
    if seed == 13:
        os._exit(9)
    with open(job["log"], "w") as log:
        log.write("connection refused by router\n" if seed == 3 else "ok\n")
    if seed != 3:
        with open(os.path.join(opt("--result-dir"), opt("--result-filename")), "w") as f:
            json.dump({"completed": 1, "pid": os.getpid(), "rate": opt("--request-rate"), "env": job.get("env")}, f)
    print(json.dumps({"rc": 3 if seed == 3 else 0}), flush=True)
'''


def _client(tmp_path) -> BenchClient:
    return BenchClient(tmp_path / "worker.log", command=[sys.executable, "-c", FAKE_WORKER])


def test_one_worker_process_serves_every_load_level(tmp_path):
    with _client(tmp_path) as client:
        first = client.run(_load(tmp_path, rate=1.0, result_filename="a.json"), tmp_path / "a.log", timeout_s=30)
        second = client.run(_load(tmp_path, rate=4.0, result_filename="b.json"), tmp_path / "b.log", timeout_s=30)
        a, b = json.loads(first.read_text()), json.loads(second.read_text())
    assert a["pid"] == b["pid"]  # the same warm process
    assert (a["rate"], b["rate"]) == ("1", "4")
    assert (tmp_path / "b.log").read_text() == "ok\n"


def test_a_failing_level_is_a_one_line_error_naming_its_log_and_the_worker_goes_on(tmp_path):
    with _client(tmp_path) as client:
        with pytest.raises(KvpushError, match=r"at 2 req/s failed \(exit 3\): connection refused by router; full output in"):
            client.run(_load(tmp_path, seed=3), tmp_path / "client.log", timeout_s=30)
        assert client.run(_load(tmp_path), tmp_path / "next.log", timeout_s=30).is_file()


def test_a_level_past_its_timeout_kills_the_worker_and_the_next_level_gets_a_fresh_one(tmp_path):
    with _client(tmp_path) as client:
        client.start()
        first_pid = client._proc.pid
        with pytest.raises(KvpushError, match="did not finish within 1 s"):  # the level sleeps 60 s
            client.run(_load(tmp_path, seed=666), tmp_path / "client.log", timeout_s=1)
        with pytest.raises(ProcessLookupError):
            os.kill(first_pid, 0)
        result = client.run(_load(tmp_path), tmp_path / "next.log", timeout_s=30)
        assert json.loads(result.read_text())["pid"] != first_pid


def test_a_worker_that_dies_is_an_error_not_a_hang(tmp_path):
    with _client(tmp_path) as client:
        with pytest.raises(KvpushError, match=r"process exited \(status 9\) at 2 req/s"):
            client.run(_load(tmp_path, seed=13), tmp_path / "client.log", timeout_s=30)


def test_a_worker_that_cannot_import_vllm_says_so(tmp_path):
    broken = [sys.executable, "-c", "import json; print(json.dumps({'error': 'cannot import vLLM: No module named vllm'}))"]
    with BenchClient(tmp_path / "worker.log", command=broken) as client:
        with pytest.raises(KvpushError, match="could not start: cannot import vLLM: No module named vllm"):
            client.run(_load(tmp_path), tmp_path / "client.log", timeout_s=30)


def test_close_stops_the_worker(tmp_path):
    client = _client(tmp_path)
    client.start()
    pid = client._proc.pid
    client.close()
    client.close()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_a_pinned_client_runs_on_the_given_cores(tmp_path):
    if shutil.which("taskset") is None:
        pytest.skip("taskset (util-linux) not installed")
    client = BenchClient(tmp_path / "worker.log", command=[sys.executable, "-c", FAKE_WORKER], cpu_cores="0")
    assert client.command[:3] == ["taskset", "--cpu-list", "0"]
    with client:
        result = client.run(_load(tmp_path, rate=1.0, result_filename="a.json"), tmp_path / "a.log", timeout_s=30)
        pid = json.loads(result.read_text())["pid"]
        assert os.sched_getaffinity(pid) == {0}



def test_the_routers_key_reaches_the_client_in_its_job_and_no_key_unsets_the_variable(tmp_path):
    with _client(tmp_path) as client:
        keyed = client.run(_load(tmp_path, result_filename="a.json"), tmp_path / "a.log", timeout_s=30, api_key="router-key")
        open_router = client.run(_load(tmp_path, result_filename="b.json"), tmp_path / "b.log", timeout_s=30)
    assert json.loads(keyed.read_text())["env"] == {"OPENAI_API_KEY": "router-key"}
    assert json.loads(open_router.read_text())["env"] == {"OPENAI_API_KEY": None}
