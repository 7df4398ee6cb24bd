"""Real vLLM 1P1D on CPU across two SSH hosts, through the kvpush router, with the nixl-pull connector.

Heavy (two vLLM servers, and the session's reference server): run under `flock /tmp/kvpush-heavy.lock`.
"""
from __future__ import annotations

import json
import sys

import psutil
import pytest

from kvpush.deploy.lifecycle.lifecycle import down, up
from kvpush.deploy.plan.plan import build_plan
from kvpush.deploy.lifecycle.observe import deployment_status, require_state
from kvpush.deploy.runners import LocalRunner
from kvpush.deploy.lifecycle.state import load_state
from kvpush.deploy.lifecycle.tiny_model import make_tiny_model
from kvpush.deploy.topology.topology import TinyModelSpec
from kvpush.common.vllm_metrics import external_kv_tokens
from e2e_instances import KV_CACHE_GIB
from lifecycle_helpers import RecordingEvents, kill_leftovers, options, processes_under
from sshd_hosts import topology_for

PROMPTS = [
    "the cache block layer token prompt decode prefill transfer memory remote local agent request " * 12,
    "one two three four five six seven eight nine ten",
    "python function return class import yield async await raise error retry timeout host port " * 10,
]
MAX_TOKENS = 12
# As the session's reference server (tests/reference_server.py) serves: in float32 greedy answers can be compared exactly.
SERVER_SETTINGS = {"max_model_len": 2048, "enforce_eager": True, "dtype": "float32"}


def _complete(runner, base_url: str, prompt: str) -> str:
    body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}).encode()
    response = runner.http("POST", base_url + "/v1/completions", body, timeout=120)
    assert response.status == 200, response.text()[:300]
    return json.loads(response.body)["choices"][0]["text"]


def test_1p1d_over_ssh_matches_a_single_server_and_moves_kv(e2e_hosts, reference_server, tmp_path, state_dir):
    sshd_cluster = e2e_hosts
    model = tmp_path / "tiny-model"
    make_tiny_model(model, TinyModelSpec(seed=0))  # both "hosts" share this filesystem: make it once
    topo = topology_for(
        sshd_cluster, "e2e", sys.executable, tmp_path, prefill=[0], decode=[1], router=0, port_base=19100,
        model_path=str(model),
        instance_env={"prefill-0": {"VLLM_CPU_OMP_THREADS_BIND": "0"}, "decode-0": {"VLLM_CPU_OMP_THREADS_BIND": "1"}},
        instance_extra={"prefill-0": {"kv_cache_gib": KV_CACHE_GIB}, "decode-0": {"kv_cache_gib": KV_CACHE_GIB}},
        extra={"model": {**SERVER_SETTINGS, "tiny": {"seed": 0}},
               "env": {"UCX_MODULES": "^ib", "UCX_MEM_EVENTS": "no"},
               "router": {"workers": 2}},  # a supervisor and two router processes on one port
    )
    opts = options(sshd_cluster, ready_timeout_s=400, stop_timeout_s=15)
    events = RecordingEvents()
    try:
        try:
            result = up(topo, opts, events)
        except Exception as exc:
            pytest.fail(f"up failed: {exc}\nnotes: {events.notes}\nlog tails: {events.tails}")
        print(f"\nready after (s): {result.ready_s}; slowest {max(result.ready_s.values()):.1f}, "
              f"sum {sum(result.ready_s.values()):.1f}; whole up {result.total_s:.1f} s", file=sys.stderr)
        assert result.proof is not None and result.proof.external_kv_tokens > 0  # up proved KV moved

        rows = deployment_status(require_state("e2e"), opts.ssh)
        assert all(r.healthy for r in rows), rows
        state = load_state("e2e")
        assert {(r.name, r.host) for r in state.processes.values()} == {("prefill-0", "h0"), ("decode-0", "h1"), ("router", "h0")}
        router = next(r for r in rows if r.name == "router")  # the router's own supervisor, under kvpush's
        assert router.supervisor_pid == state.processes["router"].pid != router.pid
        router_workers = psutil.Process(router.pid).children()
        assert len(router_workers) == 2

        from kvpush.deploy.lifecycle.hosts import connected

        with connected(state.hosts, opts.ssh) as (runners, _):
            decode = state.processes["decode-0"]
            metrics_url = decode.base_url + "/metrics"
            before = external_kv_tokens(runners["h1"].http("GET", metrics_url).text())
            router = state.processes["router"]
            pd_answers = [_complete(runners["h0"], router.base_url, p) for p in PROMPTS]
            moved = external_kv_tokens(runners["h1"].http("GET", metrics_url).text()) - before
        assert moved >= 128, f"decode received only {moved} prompt tokens by KV transfer"
    finally:
        stopped = down("e2e", opts)
    assert stopped.complete and sorted(stopped.stopped) == ["decode-0", "prefill-0", "router"]
    left = processes_under(str(model))
    kill_leftovers(str(model))
    assert left == [], "vLLM processes left behind after down"
    assert not [w for w in router_workers if w.is_running() and w.status() != psutil.STATUS_ZOMBIE], "router workers left behind"

    reference = reference_server.url_for(build_plan(topo).process("decode-0"))
    assert pd_answers == [_complete(LocalRunner(), reference, p) for p in PROMPTS]
