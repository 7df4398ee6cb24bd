"""`kvpush bench` for real: the local CPU deployment (real vLLM, router), few prompts.

Heavy (two ~3 GB vLLM servers per mode): run under `flock /tmp/kvpush-heavy.lock`.
The short bench runs kvpush beside the stock controls (vLLM's NIXL connectors exactly as vLLM ships
them), one mode at a time; KVPUSH_BENCH_E2E_MODES picks others (e.g. `kvpush,nixl-push,nixl-pull,colocated`).
The rounds test keeps two modes' deployments up and pools their rounds.
Servers run eager (no torch.compile warm-up): the bench, not the model's speed, is under test.
Every mode's instances send vLLM's per-request spans to the bench, which joins each request's two into
the engine handoff (asserted for every disaggregated mode).
"""
from __future__ import annotations

import json
import os

import pytest

from kvpush.bench.engine_timings import read_kept
from kvpush.bench.modes import bench_topology
from kvpush.bench.options import BenchOptions
from kvpush.bench.recompute import recompute
from kvpush.bench.runner import run_bench
from kvpush.deploy.lifecycle.lifecycle import LifecycleOptions
from kvpush.deploy.lifecycle.state import load_state
from kvpush.deploy.topology.topology import parse_topology
from kvpush.templates import DEFAULT_TEMPLATE, template_text
from e2e_instances import KV_CACHE_GIB
from fault_helpers import port_free

PORT_BASE = 15100  # this test's range: 15100-15104
# kvpush beside vLLM's own connectors as vLLM ships them (the stock controls); KVPUSH_BENCH_E2E_MODES picks others
MODES = os.environ.get("KVPUSH_BENCH_E2E_MODES", "kvpush,nixl-pull-stock,nixl-push-stock").split(",")
STOCK_CONNECTORS = {"nixl-pull-stock": "NixlPullConnector", "nixl-push-stock": "NixlPushConnector"}



def local_template():
    """The shipped local topology, eager, with the e2e instances' small KV cache."""
    topo = parse_topology(template_text(DEFAULT_TEMPLATE))
    small = {role: [spec.model_copy(update={"kv_cache_gib": KV_CACHE_GIB}) for spec in getattr(topo, role)] for role in ("prefill", "decode")}
    return topo.model_copy(update={"model": topo.model.model_copy(update={"enforce_eager": True}), **small})


def test_short_real_bench_measures_every_mode_and_tears_down(tmp_path, state_dir):
    topo = local_template()
    options = BenchOptions(modes=MODES, rates=[1.0, 2.0], input_len=256, output_len=8, num_prompts=4,
                           out_dir=tmp_path / "bench", port_base=PORT_BASE, client_timeout_s=300,
                           baseline=next((m for m in ("nixl-pull", "nixl-pull-stock") if m in MODES), MODES[0]),
                           lifecycle=LifecycleOptions(ready_timeout_s=400, stop_timeout_s=15))
    report = run_bench(topo, options)

    # Torn down: no state left, every port free again.
    assert load_state(bench_topology(topo, MODES[0]).name) is None  # one mode at a time: one deployment name
    assert all(port_free(PORT_BASE + i) for i in range(5))

    assert [r.mode for r in report.runs] == MODES
    for run in report.runs:
        assert run.error is None, f"{run.mode}: {run.error}"
        assert [p.rate for p in run.points] == [1.0, 2.0]
        for p in run.points:
            assert p.client.completed == 4 and p.client.failed == 0
            assert p.client.total_output_tokens == 4 * 8
            assert 0 < p.client.latency["ttft"].p50 <= p.client.latency["ttft"].p90 <= p.client.latency["e2el"].p99
            assert p.client.latency["tpot"].p50 > 0
            assert p.router.outcomes.get("success") == 4
            assert sum(i.prompt_tokens_cached for i in p.instances) == 0  # fresh prompts: no prefix-cache hits
            if run.mode == "colocated":
                assert p.prompt_tokens_external == 0
                assert p.router.handoff_observations == 0
            else:
                # Decode received the prompts by KV transfer and computed (almost) none of them itself.
                assert p.prompt_tokens_external >= 4 * 200
                assert p.decode_prompt_tokens_local <= 4 * 2
                assert p.router.handoff_observations == 4 and p.router.handoff_gap_p50_ms is not None
                assert p.failed_transfers == 0
            assert_engine_handoff(run.mode, p, tmp_path / "bench", 4)
        if run.mode in STOCK_CONNECTORS:
            assert_stock_connector(run.mode, tmp_path / "bench")

    document = json.loads((tmp_path / "bench" / "bench.json").read_text())
    assert document["configuration"]["versions"]["vllm"].startswith("vllm")
    assert document["configuration"]["machine"]["cores"] >= 1
    assert set(document["configuration"]["topology_hashes"]) == set(MODES)
    assert document["ratios_vs_baseline"][options.baseline]["1"]["ttft_p50"] == pytest.approx(1.0)
    assert document["configuration"]["engine_timings"]["taken"] is True
    recomputed = recompute(tmp_path / "bench").handoff or {}
    assert {m: recomputed[m] for m in recomputed} == {r.mode: {p.rate: p.engine_handoff for p in r.points}
                                                      for r in report.runs if r.mode != "colocated"}
    for name in ("ttft.png", "tpot.png"):
        assert (tmp_path / "bench" / name).stat().st_size > 10_000


# kvpush's decode may start as soon as prefill's step (which WRITEs the KV) ends; prefill's API server notes
# its first token when it handles that step's output, which a busy server may do a little late
FIRST_TOKEN_SKEW_MS = 2.0


def assert_engine_handoff(mode: str, point, bench_dir, requests: int) -> None:
    """Both engines' spans of every request arrived and joined, and their intervals are plausible: decode's
    first token after prefill's (the KV it needs comes from there), and after prefill began computing by
    prefill's own time in prefill."""
    h = point.engine_handoff
    if mode == "colocated":
        assert h is None and point.spans_file is None
        return
    assert (h.requests, h.joined) == (requests, requests), f"{mode}: {h.joined} of {h.requests} requests joined"
    for sample in read_kept(bench_dir / point.spans_file).samples:
        assert sample.answer_to_first_ms >= -FIRST_TOKEN_SKEW_MS, f"{mode}: decode's first token before prefill's: {sample}"
        assert sample.compute_to_first_ms == pytest.approx(sample.answer_to_first_ms + sample.prefill_ms, abs=1e-3)
        # compute_to_first may then fall short of prefill_ms by that skew too (the two lines above bound it)
        assert 0 < sample.prefill_ms and sample.compute_to_first_ms < 60_000
    assert 0 <= h.answer_to_first["p50"] <= h.compute_to_first["p50"]


ROUNDS_PORT_BASE = 15600  # this test's ranges: 15600-15604 (kvpush), 15700-15701 (colocated)


def test_rounds_keep_both_deployments_up_and_pool_their_requests(tmp_path, state_dir):
    topo = local_template()
    modes = ["kvpush", "colocated"]
    options = BenchOptions(modes=modes, rates=[2.0], input_len=128, output_len=4, num_prompts=3, rounds=2,
                           out_dir=tmp_path / "bench", port_base=ROUNDS_PORT_BASE, client_timeout_s=300, baseline="colocated",
                           lifecycle=LifecycleOptions(ready_timeout_s=400, stop_timeout_s=15))
    report = run_bench(topo, options)

    for index, run in enumerate(report.runs):
        assert run.error is None, f"{run.mode}: {run.error}"
        assert load_state(bench_topology(topo, run.mode, port_base=ROUNDS_PORT_BASE, mode_index=index).name) is None
        assert [p.round for p in run.round_points] == [0, 1]
        [pooled] = run.points
        assert pooled.client.completed == 2 * 3 and pooled.client.failed == 0
        assert pooled.client.latency["ttft"].p50 > 0
        assert sum(i.prompt_tokens_cached for i in pooled.instances) == 0  # each round's prompts are new
        if run.mode == "kvpush":
            assert pooled.prompt_tokens_external >= 2 * 3 * 100
            assert (pooled.engine_handoff.requests, pooled.engine_handoff.joined) == (6, 6)  # both rounds' requests
        else:
            assert pooled.engine_handoff is None
    assert all(port_free(ROUNDS_PORT_BASE + i) for i in range(5)) and port_free(ROUNDS_PORT_BASE + 100)
    document = json.loads((tmp_path / "bench" / "bench.json").read_text())
    assert len(document["paired_ratios_vs_baseline"]["kvpush"]["2"]["ttft_p50"]) == 2
    assert sorted(p.name for p in (tmp_path / "bench" / "raw").glob("*-round2.json")) == ["colocated-rate2-round2.json",
                                                                                         "kvpush-rate2-round2.json"]
    # Goodput and tails from the pooled per-request results, and the same figures recomputed from the raw files alone.
    for run in report.runs:
        [pooled] = run.points
        tails = pooled.tails
        assert tails.sent == 6 and tails.completed == 6 and tails.good <= 6
        assert tails.latency["ttft"]["p50"].value == pytest.approx(pooled.client.latency["ttft"].p50)
        assert [p.raw_file for p in run.round_points] == [f"raw/{run.mode}-rate2-round{k}.json" for k in (1, 2)]
        assert recompute(tmp_path / "bench").tails[run.mode][2.0] == tails
    assert "goodput" in document["ratios_vs_baseline"]["kvpush"]["2"]
    assert (tmp_path / "bench" / "goodput.png").stat().st_size > 10_000


def assert_stock_connector(mode: str, bench_dir) -> None:
    """A control ran vLLM's connector class as vLLM ships it: from vLLM's registry (pull's registered name
    resolves to NixlPullConnector), no module path, nothing of kvpush's in its configuration."""
    log = (bench_dir / "logs" / f"{mode}-decode-0.log").read_text(errors="replace")
    assert f"Creating v1 connector with name: {STOCK_CONNECTORS[mode]} " in log
    assert "kv_connector_module_path=None" in log and "kvpush.connector.vllm_nixl" not in log
