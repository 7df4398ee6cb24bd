"""Real vLLM 1P1D on CPU over two SSH hosts with the router's API key set: `up` and its proof carry
the keys, clients without the router's key and everyone without the instances' key are refused on
every path but /health and /metrics (/invocations included, which vLLM's own check leaves open),
counted and logged, while the router's traffic goes on, and the bench's client (vLLM's `vllm bench
serve`) sends the key. One deployment.

Heavy (two vLLM servers): run under `flock /tmp/kvpush-heavy.lock`.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import psutil
import pytest

from kvpush.common import deployment_secret as ds
from kvpush.common.vllm_metrics import metric_sum
from kvpush.bench.client import BenchClient, LoadSpec
from kvpush.bench.results import parse_client_result
from kvpush.deploy.lifecycle.hosts import connected
from kvpush.deploy.lifecycle.lifecycle import down, up
from kvpush.deploy.lifecycle.observe import deployment_status, require_state
from kvpush.deploy.lifecycle.secrets import AccessKeys, local_secret_path
from kvpush.deploy.lifecycle.state import load_state
from kvpush.deploy.lifecycle.tiny_model import make_tiny_model
from kvpush.deploy.topology.topology import TinyModelSpec
from e2e_instances import KV_CACHE_GIB
from lifecycle_helpers import RecordingEvents, kill_leftovers, options, processes_under
from sshd_hosts import topology_for

PORT_BASE = 20200
CLIENT_KEY = "e2e-router-key-7f3a9c"
KEY_VARIABLE = "KVPUSH_E2E_ROUTER_KEY"


def _argvs_holding(needles: list[str]) -> list[str]:
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            text = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if any(n in text for n in needles):
            found.append(text[:200])
    return found


# vLLM's own --api-key check leaves all but /invocations of these unguarded (it checks /v1, /v2,
# /inference, /cohere only); /invocations generates (upstream issue #58144).
UNGUARDED_BY_VLLM = [("POST", "/invocations"), ("POST", "/tokenize"), ("POST", "/detokenize"), ("POST", "/pooling"),
                     ("POST", "/classify"), ("POST", "/score"), ("POST", "/rerank"), ("GET", "/version"), ("GET", "/ping"),
                     ("GET", "/load"), ("GET", "/docs"), ("GET", "/openapi.json"), ("GET", "/server_info"),
                     ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models"),
                     ("GET", "/metrics/anything"), ("GET", "//health")]
REFUSED = "vllm:kvpush_refused_requests_total"


def _refused_count(runner, base_url: str) -> float:
    page = runner.http("GET", base_url + "/metrics", timeout=60)  # open: no key needed
    assert page.status == 200
    return metric_sum(page.body.decode(errors="replace"), REFUSED) or 0.0


def _every_path_needs_the_instance_key(runner, base_url: str, keys: AccessKeys, body: bytes) -> None:
    """Each path refused without the key (401, counted), /health and /metrics open, and with the key
    /invocations generates and /tokenize answers."""
    before = _refused_count(runner, base_url)
    statuses = {path: runner.http(method, base_url + path, body if method == "POST" else None, timeout=120).status
                for method, path in UNGUARDED_BY_VLLM}
    assert set(statuses.values()) == {401}, statuses
    wrong = runner.http("POST", base_url + "/invocations", body, timeout=120, headers={"Authorization": f"Bearer {CLIENT_KEY}"})
    assert wrong.status == 401
    assert _refused_count(runner, base_url) == before + len(UNGUARDED_BY_VLLM) + 1
    assert runner.http("GET", base_url + "/health", timeout=60).status == 200
    invoked = runner.http("POST", base_url + "/invocations", body, timeout=120, headers=keys.headers("decode"))
    assert invoked.status == 200 and json.loads(invoked.body)["choices"][0]["text"], invoked.body[:300]
    tokenized = runner.http("POST", base_url + "/tokenize", json.dumps({"model": "tiny", "prompt": "one two"}).encode(),
                            timeout=120, headers=keys.headers("decode"))
    assert tokenized.status == 200 and json.loads(tokenized.body)["tokens"]


def _listening(marker: str) -> list[tuple[str, str, str, int]]:
    """(process name, its first arguments, address, port) of every listening TCP socket of the
    deployment's processes (those started from, or running in, the test's directory)."""
    found = set()
    for proc in processes_under(marker):
        try:
            words = " ".join(a for a in proc.cmdline()[1:6] if not a.startswith("/"))[:60]
            found |= {(proc.name(), words, c.laddr.ip, c.laddr.port) for c in proc.net_connections(kind="tcp")
                      if c.status == psutil.CONN_LISTEN}
        except psutil.Error:
            continue
    return sorted(found)


def test_keys_guard_a_real_deployment_end_to_end(e2e_hosts, tmp_path, state_dir, monkeypatch):
    monkeypatch.setenv(KEY_VARIABLE, CLIENT_KEY)
    model = tmp_path / "tiny-model"
    make_tiny_model(model, TinyModelSpec(seed=0))
    topo = topology_for(
        e2e_hosts, "secured", sys.executable, tmp_path, prefill=[0], decode=[1], router=0, port_base=PORT_BASE,
        connector="kvpush", model_path=str(model),
        instance_env={"prefill-0": {"VLLM_CPU_OMP_THREADS_BIND": "0"}, "decode-0": {"VLLM_CPU_OMP_THREADS_BIND": "1"}},
        instance_extra={"prefill-0": {"kv_cache_gib": KV_CACHE_GIB}, "decode-0": {"kv_cache_gib": KV_CACHE_GIB}},
        extra={"model": {"max_model_len": 2048, "enforce_eager": True, "tiny": {"seed": 0}},
               "env": {"UCX_MODULES": "^ib", "UCX_MEM_EVENTS": "no"},
               "router": {"api_key_env": KEY_VARIABLE}},
    )
    opts = options(e2e_hosts, ready_timeout_s=400, stop_timeout_s=15)
    events = RecordingEvents()
    try:
        try:
            result = up(topo, opts, events)
        except Exception as exc:
            pytest.fail(f"up failed: {exc}\nnotes: {events.notes}\nlog tails: {events.tails}")
        assert result.proof is not None and result.proof.external_kv_tokens > 0  # the proof went through the keyed router

        secret = ds.read_secret(local_secret_path("secured"))
        keys = AccessKeys.of(secret, CLIENT_KEY)
        assert _argvs_holding([secret.hex(), keys.instance, CLIENT_KEY]) == []
        rows = deployment_status(require_state("secured"), opts.ssh, keys)
        assert all(r.healthy for r in rows) and {r.kv_usage is not None for r in rows if r.role != "router"} == {True}, rows

        state = load_state("secured")
        router, decode = state.processes["router"], state.processes["decode-0"]
        router_url = router.base_url
        decode_url = decode.base_url
        body = json.dumps({"model": "tiny", "prompt": "one two three four five", "max_tokens": 4, "temperature": 0}).encode()
        with connected(state.hosts, opts.ssh) as (runners, _):
            h0, h1 = runners["h0"], runners["h1"]
            assert h0.http("POST", router_url + "/v1/completions", body, timeout=120).status == 401
            assert h0.http("POST", router_url + "/v1/completions", body, timeout=120,
                           headers={"Authorization": "Bearer not-the-key"}).status == 401
            answered = h0.http("POST", router_url + "/v1/completions", body, timeout=120, headers=keys.headers("router"))
            assert answered.status == 200 and json.loads(answered.body)["choices"][0]["text"]
            # Only the router and kvpush reach the instances: not a client, not even with the router's key.
            assert h1.http("POST", decode_url + "/v1/completions", body, timeout=120).status == 401
            assert h1.http("POST", decode_url + "/v1/completions", body, timeout=120,
                           headers={"Authorization": f"Bearer {CLIENT_KEY}"}).status == 401
            assert h1.http("POST", decode_url + "/v1/completions", body, timeout=120,
                           headers=keys.headers("decode")).status == 200
            _every_path_needs_the_instance_key(h0, state.processes["prefill-0"].base_url, keys, body)
            _every_path_needs_the_instance_key(h1, decode_url, keys, body)
            # ... and the router's own traffic is unharmed by all of it
            answered = h0.http("POST", router_url + "/v1/completions", body, timeout=120, headers=keys.headers("router"))
            assert answered.status == 200 and json.loads(answered.body)["choices"][0]["text"]
        decode_log = Path(decode.log_path.replace("~", str(Path.home()), 1))
        # one line per 10 s at most: the first refusal (this test's first request without the key) is logged
        logged = [ln for ln in decode_log.read_text(errors="replace").splitlines() if "kvpush: refused" in ln]
        assert logged and "request(s) without the instance key in the last 10 s; latest: POST '/v1/completions'" in logged[0]
        print(f"listening sockets of the deployment's processes: {_listening(str(tmp_path))}")

        load = LoadSpec(base_url=router_url, served_model="tiny", tokenizer=str(model), rate=8.0, num_prompts=3,
                        input_len=64, output_len=4, seed=11, result_dir=str(tmp_path / "raw"), result_filename="keyed.json")
        with BenchClient(tmp_path / "logs" / "client.log") as client:
            path = client.run(load, tmp_path / "logs" / "keyed.log", timeout_s=400, api_key=CLIENT_KEY)
        bench = parse_client_result(path.read_text(), str(path))
        assert (bench.completed, bench.failed) == (3, 0), (tmp_path / "logs" / "keyed.log").read_text()[-2000:]

        for log in tmp_path.glob("h*/secured/logs/*.log"):
            text = log.read_text(errors="replace")
            assert not [n for n in (secret.hex(), keys.instance, CLIENT_KEY) if n in text], log
    finally:
        stopped = down("secured", opts)
        left = processes_under(str(model))
        kill_leftovers(str(model))
    assert stopped.complete and sorted(stopped.stopped) == ["decode-0", "prefill-0", "router"]
    assert left == [], "vLLM processes left behind after down"
