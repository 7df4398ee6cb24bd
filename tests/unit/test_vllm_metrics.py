"""Reading /metrics pages: what prometheus_client itself exposes (the router's and vLLM's pages are
made by it) reads back exactly, and a line the parser refuses costs only that line."""
from __future__ import annotations

import math

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvpush.common.vllm_metrics import metric_sum, samples
from kvpush.bench.scrape import histogram


def _page() -> str:
    registry = CollectorRegistry()
    tokens = Counter("vllm:prompt_tokens_by_source", "tokens", ["source", "note"], registry=registry)
    tokens.labels("external_kv_transfer", 'a "quoted" \\ path\nnext line').inc(384)
    tokens.labels("local_compute", "").inc(7)
    Gauge("vllm:kv_cache_usage_perc", "usage", registry=registry).set(0.25)
    gap = Histogram("kvpush_router_handoff_gap_seconds", "gap", buckets=(0.01, 0.1), registry=registry)
    for seconds in (0.005, 0.05, 0.05, 5.0):
        gap.observe(seconds)
    return generate_latest(registry).decode()


def test_a_page_prometheus_client_made_reads_back_with_its_label_values_unescaped():
    page = _page()
    by_source = {labels["source"]: (labels["note"], value) for name, labels, value in samples(page)
                 if name == "vllm:prompt_tokens_by_source_total"}
    assert by_source == {"external_kv_transfer": ('a "quoted" \\ path\nnext line', 384.0), "local_compute": ("", 7.0)}
    assert metric_sum(page, "vllm:kv_cache_usage_perc") == 0.25
    gap = histogram(page, "kvpush_router_handoff_gap_seconds")
    assert gap.buckets == ((0.01, 1.0), (0.1, 3.0), (math.inf, 4.0)) and gap.count == 4
    assert math.isclose(gap.total, 5.105)


def test_a_line_the_parser_refuses_leaves_the_rest_of_the_page():
    page = 'vllm:num_requests_running{engine="0"} 2\nbroken{ 1\nvllm:num_requests_waiting 1\na{b="c" d="e"} 3\n'
    assert samples(page) == [("vllm:num_requests_running", {"engine": "0"}, 2.0), ("vllm:num_requests_waiting", {}, 1.0)]


def test_special_values_and_timestamps():
    assert samples("a NaN\nb +Inf 1700000000000\n")[1] == ("b", {}, math.inf)
    assert math.isnan(samples("a NaN\n")[0][2])
    assert samples("") == []


def test_prefixes_pass_only_those_series_to_the_parser():
    page = _page()
    assert samples(page, ("vllm:kv_cache",)) == [("vllm:kv_cache_usage_perc", {}, 0.25)]
    names = {name for name, _, _ in samples(page, ("kvpush_router_handoff_gap_seconds",))}
    assert names == {"kvpush_router_handoff_gap_seconds_bucket", "kvpush_router_handoff_gap_seconds_count",
                     "kvpush_router_handoff_gap_seconds_sum", "kvpush_router_handoff_gap_seconds_created"}
