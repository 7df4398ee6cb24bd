"""Parsing and aggregation on output recorded from a real run (tests/fixtures/bench/README.md)."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from kvpush.deploy.bench.results import (
    ModeRun, RatePoint, figure, parse_client_result, point_to_dict, ratios_vs_baseline,
)
from kvpush.deploy.bench.scrape import instance_figures, router_figures
from kvpush.deploy.errors import KvpushError

FIXTURES = Path(__file__).parents[1] / "fixtures" / "bench"
TINY_KV_BYTES_PER_TOKEN = 1024  # default tiny model: 2 layers x 2 KV heads x 64 x K,V x bf16


def _text(name: str) -> str:
    return (FIXTURES / name).read_text()


@pytest.fixture
def recorded_point() -> RatePoint:
    client = parse_client_result(_text("vllm_bench_serve_nixl_pull_rate1.json"))
    return RatePoint(
        mode="nixl-pull", rate=1.0, seed=1000, client=client,
        router=router_figures(_text("router_metrics_before.txt"), _text("router_metrics_after.txt")),
        instances=[instance_figures("prefill-0", "prefill", _text("prefill_metrics_before.txt"), _text("prefill_metrics_after.txt")),
                   instance_figures("decode-0", "decode", _text("decode_metrics_before.txt"), _text("decode_metrics_after.txt"))],
    )


def test_client_result_has_every_latency_statistic(recorded_point):
    c = recorded_point.client
    assert (c.rate, c.completed, c.failed) == (1.0, 6, 0)
    assert (c.total_input_tokens, c.total_output_tokens) == (6 * 512, 6 * 16)
    assert c.latency["ttft"].p50 == pytest.approx(86158.80, abs=0.01)
    assert c.latency["ttft"].p90 == pytest.approx(87823.33, abs=0.01)
    assert c.latency["tpot"].p50 == pytest.approx(33.846, abs=0.001)
    assert c.latency["itl"].p99 == pytest.approx(334.65, abs=0.01)
    assert c.latency["e2el"].mean == pytest.approx(78046.23, abs=0.01)
    for metric, stats in c.latency.items():
        assert None not in dataclasses.astuple(stats), metric
    assert c.request_throughput == pytest.approx(0.06446, abs=1e-5)


def test_router_figures_from_recorded_scrapes(recorded_point):
    r = recorded_point.router
    assert r.handoff_observations == 6 and r.outcomes == {"success": 6.0}
    assert 500 <= r.handoff_gap_p50_ms <= 750  # 4 of the 6 new gaps fell in the 0.5-0.75 s bucket
    assert r.handoff_gap_p50_ms <= r.handoff_gap_p90_ms <= 2500
    assert r.retries == 0 and r.leg_failures == 0


def test_kv_transfer_evidence_from_recorded_scrapes(recorded_point):
    prefill, decode = recorded_point.instances
    assert (prefill.prompt_tokens_local, prefill.prompt_tokens_external) == (3072, 0)
    assert (decode.prompt_tokens_external, decode.prompt_tokens_local, decode.prompt_tokens_cached) == (3072, 0, 0)
    assert recorded_point.prompt_tokens_external == 3072
    # Every prompt token's KV moved exactly once: bytes == tokens x bytes per token of the tiny model.
    assert recorded_point.kv_bytes == 3072 * TINY_KV_BYTES_PER_TOKEN
    assert recorded_point.failed_transfers == 0


def test_point_serializes_with_its_derived_figures(recorded_point):
    d = json.loads(json.dumps(point_to_dict(recorded_point)))
    assert d["client"]["latency"]["ttft"]["p50"] == pytest.approx(86158.80, abs=0.01)
    assert d["kv_bytes"] == 3072 * 1024 and d["prompt_tokens_external"] == 3072


def _scaled(point: RatePoint, mode: str, factor: float) -> RatePoint:
    latency = {m: dataclasses.replace(s, **{k: v * factor for k, v in dataclasses.asdict(s).items()})
               for m, s in point.client.latency.items()}
    return dataclasses.replace(point, mode=mode, client=dataclasses.replace(point.client, latency=latency))


def test_ratios_against_the_baseline_at_the_same_rate(recorded_point):
    runs = [ModeRun("nixl-pull", "h1", [recorded_point]), ModeRun("kvpush", "h2", [_scaled(recorded_point, "kvpush", 0.5)]),
            ModeRun("nixl-push", "h3", [dataclasses.replace(recorded_point, mode="nixl-push", rate=2.0)])]
    ratios = ratios_vs_baseline(runs, "nixl-pull")
    assert ratios["nixl-pull"][1.0]["ttft_p50"] == pytest.approx(1.0)
    assert ratios["kvpush"][1.0]["ttft_p50"] == pytest.approx(0.5)
    assert ratios["kvpush"][1.0]["tpot_p50"] == pytest.approx(0.5)
    assert ratios["kvpush"][1.0]["handoff_p50"] == pytest.approx(1.0)  # same router scrape in both
    assert ratios["nixl-push"][2.0]["ttft_p50"] is None  # the baseline has no point at 2 req/s


def test_a_missing_baseline_gives_no_ratios(recorded_point):
    ratios = ratios_vs_baseline([ModeRun("kvpush", "h", [recorded_point])], "nixl-pull")
    assert all(v is None for v in ratios["kvpush"][1.0].values())


def test_figure_names(recorded_point):
    assert figure(recorded_point, "ttft_p99") == recorded_point.client.latency["ttft"].p99
    assert figure(recorded_point, "handoff_p90") == recorded_point.router.handoff_gap_p90_ms
    assert figure(recorded_point, "failed") == 0.0


def test_not_a_result_file_is_one_line_error():
    with pytest.raises(KvpushError, match="x.json: not a `vllm bench serve` result file"):
        parse_client_result("{}", "x.json")
    with pytest.raises(KvpushError, match="not a `vllm bench serve` result file"):
        parse_client_result("not json", "x.json")
