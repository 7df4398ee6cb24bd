"""Killing one TP rank of prefill mid-push (vLLM on CPU, prefill TP 2 -> decode TP 2): every affected
request ends on decode, answered or with a clear error, within 2 s of the kill; a request after it
is served (by kvpush's router); and decode gets every block of every rank back.

The requests under way at the kill are sent as the router would, both legs at once, but by the
test itself: what ends within 2 s is decode's side of each transfer, without the router's retries."""
from __future__ import annotations

import json
import os
import signal
import sys
import time
import urllib.error
import uuid
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvpush.common.kv_params import PushParams
from kvpush.common.vllm_metrics import metric_sum
from kvpush.deploy.plan.plan import build_plan, router_config
from kvpush.deploy.lifecycle.tiny_model import make_tiny_model
from kvpush.deploy.topology.topology import TinyModelSpec, parse_topology
from plan_secrets import keyless, write_secret_files
from e2e_instances import KV_CACHE_GIB
from random_prompts import full_length_prompts
from server_process import ServerProcess

TOPOLOGY = """
name: tp-kill-e2e
platform: cpu
model: {{path: {model}, served_name: tiny, max_model_len: 2048, enforce_eager: true, dtype: float32}}
connector: {{type: kvpush, backend: UCX, transfer_timeout_s: 20, extra_config: {{late_write_hold_s: 3}}}}
hosts:
  local: {{address: 127.0.0.1, workdir: {workdir}}}
prefill: [{{tensor_parallel_size: 2, cpu_cores: "0|1", share_cores: true, kv_cache_gib: {kv_cache_gib}, http_port: 19300,
           side_channel_port: 19310}}]
decode: [{{tensor_parallel_size: 2, cpu_cores: "0|1", share_cores: true, kv_cache_gib: {kv_cache_gib}, http_port: 19301,
          side_channel_port: 19320, extra_args: ["--no-enable-prefix-caching"]}}]
router: {{port: 19309}}
env: {{UCX_MODULES: "^ib", UCX_MEM_EVENTS: "no"}}
"""


def post(url: str, prompt: list[int], timeout_s: float = 120, **extra) -> tuple[int, str]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0.0, "ignore_eos": True, **extra}
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")
    except (urllib.error.URLError, ConnectionError, TimeoutError) as exc:
        return 0, repr(exc)


def rank_worker(server: ServerProcess, rank: int) -> int:
    """The PID of the server's TP worker of this rank: vLLM titles them VLLM::Worker_TP<rank>, which
    the kernel's 15-character comm cuts before the rank, so the title is read from the command line."""
    for pid in os.listdir("/proc"):
        try:
            if pid.isdigit() and os.getpgid(int(pid)) == server.proc.pid and \
                    open(f"/proc/{pid}/cmdline").read().split("\0")[0].strip() == f"VLLM::Worker_TP{rank}":
                return int(pid)
        except OSError:
            continue
    raise AssertionError(f"no TP{rank} worker under {server.name}")


@pytest.mark.timeout(900)
def test_killing_one_prefill_rank_mid_push_ends_every_request_and_frees_every_block(tmp_path):
    make_tiny_model(tmp_path / "tiny", TinyModelSpec(seed=0))
    topo = parse_topology(TOPOLOGY.format(model=tmp_path / "tiny", workdir=tmp_path, kv_cache_gib=KV_CACHE_GIB))
    plan = build_plan(topo)
    write_secret_files(plan)
    servers: dict[str, ServerProcess] = {}
    try:
        for name in ("prefill-0", "decode-0"):
            proc = plan.process(name)
            servers[name] = ServerProcess(name, keyless(proc.argv), proc.env, proc.health_url.rsplit("/", 1)[0], tmp_path)
        config = router_config(topo).model_copy(update={"instance_api_key_file": None})
        (tmp_path / "router.json").write_text(config.model_dump_json())
        router = servers["router"] = ServerProcess("router", [sys.executable, "-m", "kvpush.router", "--config",
                                                              str(tmp_path / "router.json")], {}, plan.router_url, tmp_path)
        for server in servers.values():
            server.wait_healthy(timeout_s=600)
        prefill, decode = servers["prefill-0"], servers["decode-0"]
        deadline = time.monotonic() + 60
        while metric_sum(router.metrics(), "kvpush_router_instance_in_rotation") != 2:
            assert time.monotonic() < deadline, router.tail(20)
            time.sleep(0.2)
        status, raw = post(router.url, full_length_prompts(1, 300, seed=1)[0])
        assert status == 200, raw  # warm: both ranks connected and a transfer went through

        prompts = full_length_prompts(16, 1500, seed=2)
        p_port, d_port = plan.process("prefill-0").side_channel_ports[0], topo.decode[0].side_channel_port

        def both_legs(prompt: list[int]) -> tuple[int, str, float]:
            tid = uuid.uuid4().hex
            producer = PushParams("producer", tid, "tp-kill-e2e.decode-0", "127.0.0.1", d_port, 2).to_dict()
            consumer = PushParams("consumer", tid, "tp-kill-e2e.prefill-0", "127.0.0.1", p_port, 2).to_dict()
            pool.submit(post, prefill.url, prompt, 60, max_tokens=1, kv_transfer_params=producer)
            status, raw = post(decode.url, prompt, 60, kv_transfer_params=consumer)
            return status, raw, time.monotonic()

        with ThreadPoolExecutor(2 * len(prompts)) as pool:
            futures = [pool.submit(both_legs, p) for p in prompts]
            # until prefill has requests queued and decode holds blocks for them: the kill then hits
            # transfers registered on both decode ranks that prefill has not yet (fully) written
            deadline = time.monotonic() + 60
            while prefill.metric("vllm:num_requests_waiting") < 1 or decode.metric("vllm:kv_cache_usage_perc") <= 0:
                assert time.monotonic() < deadline, "prefill never had requests queued behind registered transfers"
                time.sleep(0.02)
            victim = rank_worker(prefill, 1)
            killed = time.monotonic()
            os.kill(victim, signal.SIGKILL)
            results = [f.result() for f in futures]
        last = max(ended for _, _, ended in results) - killed
        outcomes = [status for status, _, _ in results]
        print(f"\nkilled prefill's TP1 worker with {len(prompts)} requests under way: statuses {outcomes}; "
              f"the last ended {last:.2f} s after the kill")
        assert last < 5.0, f"a request ended {last:.1f} s after the kill"  # not at a transfer timeout
        for status, raw, _ in results:
            assert status == 200 or (status >= 500 and "error" in raw), (status, raw[:300])

        status, raw = post(router.url, full_length_prompts(1, 200, seed=3)[0])
        assert status == 200, raw  # served after the kill (by decode alone: the prefill instance is gone)

        deadline = time.monotonic() + 30  # the blocks of transfers given up on come back after the hold
        while (usage := decode.metric("vllm:kv_cache_usage_perc")) > 0 and time.monotonic() < deadline:
            time.sleep(0.2)
        failed = decode.metric("vllm:kvpush_failed_transfers_total")
        print(f"decode after the kill: KV cache usage {usage}, failed transfers {failed:.0f}")
        assert usage == 0, f"decode still holds KV blocks of {usage:.1%} of its cache"
    finally:
        for server in servers.values():
            server.kill()
