"""`kvpush bench` for real: the local CPU deployment (real vLLM, router), two modes, two rates, few prompts.

Heavy (two ~3 GB vLLM servers per mode, started twice): run under `flock /tmp/kvpush-heavy.lock`.
Push against pull by default; KVPUSH_BENCH_E2E_MODES picks others (e.g. `kvpush,nixl-push,nixl-pull,colocated`).
Servers run eager (no torch.compile warm-up): the bench, not the model's speed, is under test.
Every mode's instances send vLLM's per-request spans to the bench, which joins each request's two into
the engine handoff (asserted for kvpush, nixl-pull and both stock modes).
"""
from __future__ import annotations

import json
import os

import pytest

from kvpush.deploy.bench.engine_timings import read_kept
from kvpush.deploy.bench.modes import bench_topology
from kvpush.deploy.bench.options import BenchOptions
from kvpush.deploy.bench.recompute import recompute
from kvpush.deploy.bench.runner import run_bench
from kvpush.deploy.lifecycle import LifecycleOptions
from kvpush.deploy.state import load_state
from kvpush.deploy.topology import parse_topology
from kvpush.templates import DEFAULT_TEMPLATE, template_text
from fault_helpers import port_free

PORT_BASE = 15100  # this test's range: 15100-15104
MODES = os.environ.get("KVPUSH_BENCH_E2E_MODES", "kvpush,nixl-pull").split(",")



def test_short_real_bench_measures_every_mode_and_tears_down(tmp_path, state_dir):
    topo = parse_topology(template_text(DEFAULT_TEMPLATE))
    topo = topo.model_copy(update={"model": topo.model.model_copy(update={"enforce_eager": True})})
    options = BenchOptions(modes=MODES, rates=[1.0, 2.0], input_len=256, output_len=8, num_prompts=4,
                           out_dir=tmp_path / "bench", port_base=PORT_BASE, client_timeout_s=300,
                           baseline="nixl-pull" if "nixl-pull" in MODES else MODES[0],
                           lifecycle=LifecycleOptions(ready_timeout_s=400, stop_timeout_s=15))
    report = run_bench(topo, options)

    # Torn down: no state left, every port free again.
    assert load_state(bench_topology(topo, MODES[0]).name) is None
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
        assert 0 < sample.prefill_ms < sample.compute_to_first_ms < 60_000
    assert 0 <= h.answer_to_first["p50"] <= h.compute_to_first["p50"]


ROUNDS_PORT_BASE = 15600  # this test's ranges: 15600-15604 (kvpush), 15700-15701 (colocated)


def test_rounds_keep_both_deployments_up_and_pool_their_requests(tmp_path, state_dir):
    topo = parse_topology(template_text(DEFAULT_TEMPLATE))
    topo = topo.model_copy(update={"model": topo.model.model_copy(update={"enforce_eager": True})})
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


STOCK_PORT_BASE = 15800  # this test's ranges: 15800-15804 (nixl-pull-stock), 15900-15904 (nixl-push-stock)


def test_stock_nixl_modes_serve_with_vllms_own_connectors(tmp_path, state_dir):
    """The controls run vLLM's connector classes as vLLM ships them (no kvpush module in their config)
    and move the prompts' KV for real."""
    topo = parse_topology(template_text(DEFAULT_TEMPLATE))
    topo = topo.model_copy(update={"model": topo.model.model_copy(update={"enforce_eager": True})})
    modes = ["nixl-pull-stock", "nixl-push-stock"]
    options = BenchOptions(modes=modes, rates=[2.0], input_len=256, output_len=4, num_prompts=3, rounds=2,
                           out_dir=tmp_path / "bench", port_base=STOCK_PORT_BASE, client_timeout_s=300,
                           baseline="nixl-pull-stock", lifecycle=LifecycleOptions(ready_timeout_s=400, stop_timeout_s=15))
    report = run_bench(topo, options)
    for index, run in enumerate(report.runs):
        assert run.error is None, f"{run.mode}: {run.error}"
        assert load_state(bench_topology(topo, run.mode, port_base=STOCK_PORT_BASE, mode_index=index).name) is None
        [pooled] = run.points
        assert pooled.client.completed == 6 and pooled.client.failed == 0
        assert pooled.prompt_tokens_external >= 6 * 200 and pooled.failed_transfers == 0
        for point in run.round_points:  # stock vLLM too: both legs of each request named alike, both spans joined
            assert_engine_handoff(run.mode, point, tmp_path / "bench", 3)
        log = (tmp_path / "bench" / "logs" / f"{run.mode}-decode-0.log").read_text(errors="replace")
        # vLLM's own classes from its registry (pull's registered name resolves to NixlPullConnector), no module path
        expected = "NixlPushConnector" if run.mode == "nixl-push-stock" else "NixlPullConnector"
        assert f"Creating v1 connector with name: {expected} " in log
        assert "kv_connector_module_path=None" in log and "kvpush.connector.vllm_nixl" not in log
    assert all(port_free(STOCK_PORT_BASE + i) for i in range(5)) and all(port_free(STOCK_PORT_BASE + 100 + i) for i in range(5))
