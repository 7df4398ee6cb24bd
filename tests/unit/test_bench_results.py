"""Parsing and aggregation on output recorded from a real run (tests/fixtures/bench/README.md)."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from kvpush.bench.results import (
    ModeRun, RatePoint, RequestSamples, figure, paired_ratios, parse_client_result, parse_request_samples, point_to_dict,
    pool_points, ratios_vs_baseline,
)
from kvpush.bench.scrape import instance_figures, router_figures
from kvpush.bench.tails import Slo
from kvpush.common.errors import KvpushError

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


def test_prefill_engine_time_from_recorded_scrapes(recorded_point):
    prefill, decode = recorded_point.instances
    # 6 new requests: (266.21 - 3.39) s of prefill and (57.21 - 0.0002) s queued at the engine
    assert prefill.engine_requests == 6
    assert prefill.prefill_ms_per_request == pytest.approx((266.20652564 - 3.38884554) / 6 * 1000)
    assert prefill.queue_ms_per_request == pytest.approx((57.20895940 - 0.00023930) / 6 * 1000)
    assert recorded_point.prefill_engine_ms == pytest.approx(prefill.prefill_ms_per_request)


def test_point_serializes_with_its_derived_figures(recorded_point):
    d = json.loads(json.dumps(point_to_dict(recorded_point)))
    assert d["client"]["latency"]["ttft"]["p50"] == pytest.approx(86158.80, abs=0.01)
    assert d["kv_bytes"] == 3072 * 1024 and d["prompt_tokens_external"] == 3072
    assert d["prefill_engine_ms"] == pytest.approx(recorded_point.prefill_engine_ms)
    assert d["instances"][0]["prefill_ms_per_request"] == pytest.approx(recorded_point.prefill_engine_ms)


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


def _detailed(ttfts, latencies, output_lens, errors=None) -> str:
    return json.dumps({"completed": len(ttfts), "ttfts": ttfts, "latencies": latencies, "output_lens": output_lens,
                       "itls": [[0.01] * max(n - 1, 0) for n in output_lens], "errors": errors or [""] * len(ttfts)})


def test_request_samples_skip_failed_requests_and_derive_tpot():
    text = _detailed([0.5, 0.0, 0.2], [0.8, 0.0, 0.2], [4, 0, 1], ["", "HTTP 500", ""])
    samples = parse_request_samples(text, "r.json")
    assert samples.ttft == pytest.approx([500, 200])
    assert samples.e2el == pytest.approx([800, 200])
    assert samples.tpot == pytest.approx([100])  # (0.8 - 0.5) / 3 tokens; one-token answers have none
    assert samples.itl == pytest.approx([10, 10, 10])
    assert samples.request_tpot == pytest.approx([100, None])  # aligned with ttft: goodput judges each request
    assert samples.sent == 3
    with pytest.raises(KvpushError, match="r.json: has no per-request figures; it was not written with --save-detailed"):
        parse_request_samples(_text("vllm_bench_serve_nixl_pull_rate1.json"), "r.json")


def test_pooled_point_takes_percentiles_over_every_rounds_requests(recorded_point):
    rounds = [dataclasses.replace(recorded_point, round=0),
              dataclasses.replace(recorded_point, round=1, router=dataclasses.replace(recorded_point.router, handoff_gap_p50_ms=10.0))]
    samples = [RequestSamples([100.0, 200.0], [300.0, 300.0], [5.0, None], [1.0], sent=2, duration_s=2.0),
               RequestSamples([300.0, 400.0, 500.0], [600.0, 600.0, 600.0], [7.0, None, None], [2.0], sent=4, duration_s=2.0)]
    pooled = pool_points(rounds, samples, Slo(ttft_ms=350.0, tpot_ms=6.0))
    assert pooled.round == -1
    assert pooled.client.latency["ttft"].p50 == pytest.approx(300.0)
    assert pooled.client.latency["ttft"].p90 == pytest.approx(460.0)  # linear between ranks, as vllm bench serve
    assert pooled.client.latency["ttft"].mean == pytest.approx(300.0)
    assert pooled.client.latency["tpot"].p50 == pytest.approx(6.0)
    assert pooled.client.completed == 2 * recorded_point.client.completed
    assert pooled.client.request_throughput == pytest.approx(recorded_point.client.request_throughput, rel=1e-6)
    assert pooled.router.handoff_gap_p50_ms == pytest.approx((10.0 + recorded_point.router.handoff_gap_p50_ms) / 2)
    assert pooled.router.handoff_observations == 2 * recorded_point.router.handoff_observations
    assert pooled.prompt_tokens_external == 2 * recorded_point.prompt_tokens_external
    assert pooled.kv_bytes == 2 * recorded_point.kv_bytes
    assert pooled.instances[0].engine_requests == 2 * recorded_point.instances[0].engine_requests
    assert pooled.prefill_engine_ms == pytest.approx(recorded_point.prefill_engine_ms)  # a mean of means, weighted
    # goodput over every round's requests: 100 ms (TPOT 5) and 200 ms (one token) meet both SLOs, 300 ms misses
    # the TPOT SLO and the others the TTFT SLO; 6 sent (one failed) in 4 s of bench time
    assert (pooled.tails.sent, pooled.tails.completed, pooled.tails.good) == (6, 5, 2)
    assert pooled.tails.goodput.value == pytest.approx(0.5)
    assert figure(pooled, "goodput") == pytest.approx(0.5)


def test_paired_ratios_compare_within_each_round(recorded_point):
    base = ModeRun("nixl-pull", "a", round_points=[dataclasses.replace(recorded_point, round=0),
                                                    dataclasses.replace(_scaled(recorded_point, "nixl-pull", 2.0), round=1)])
    push = ModeRun("kvpush", "b", round_points=[dataclasses.replace(_scaled(recorded_point, "kvpush", 0.9), round=0),
                                                 dataclasses.replace(_scaled(recorded_point, "kvpush", 2.2), round=1)])
    ratios = paired_ratios([base, push], "nixl-pull")
    # Round 1 ran slower for both modes: compared within the round, kvpush is 1.1x there, not 2.2x.
    assert ratios["kvpush"][1.0]["ttft_p50"] == pytest.approx([0.9, 1.1])
    assert ratios["nixl-pull"][1.0]["tpot_p50"] == pytest.approx([1.0, 1.0])
    assert paired_ratios([push], "nixl-pull") == {"kvpush": {}}


def test_damaged_per_request_figures_are_one_line_errors():
    good = json.loads(_detailed([0.5, 0.4], [0.8, 0.9], [4, 4]))
    for broken in ({**good, "latencies": [0.8]}, {k: v for k, v in good.items() if k != "errors"}):
        with pytest.raises(KvpushError, match=r"r.json: per-request figures of unequal length \((latencies|errors) vs 2 ttfts\)"):
            parse_request_samples(json.dumps(broken), "r.json")
