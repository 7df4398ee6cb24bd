"""kvpush.bench.scrape: histogram quantiles and before/after deltas of /metrics pages."""
from __future__ import annotations

import pytest

from kvpush.bench.scrape import histogram, instance_figures, router_figures


def _gap_page(counts: dict[str, int], total: float) -> str:
    """A router page whose handoff histogram has `counts` observations per bucket bound (cumulative built here)."""
    lines, running = ["# HELP kvpush_router_handoff_gap_seconds x", "# TYPE kvpush_router_handoff_gap_seconds histogram"], 0
    for le in ("0.01", "0.025", "0.05", "0.1", "+Inf"):
        running += counts.get(le, 0)
        lines.append(f'kvpush_router_handoff_gap_seconds_bucket{{le="{le}"}} {running}.0')
    lines += [f"kvpush_router_handoff_gap_seconds_count {running}.0", f"kvpush_router_handoff_gap_seconds_sum {total}"]
    return "\n".join(lines) + "\n"


def test_quantile_interpolates_inside_the_bucket():
    h = histogram(_gap_page({"0.01": 2, "0.025": 2}, 0.06), "kvpush_router_handoff_gap_seconds")
    assert h.count == 4
    assert h.quantile(0.5) == pytest.approx(0.01)  # 2nd of 4 observations: the top of the first bucket
    assert h.quantile(0.75) == pytest.approx(0.0175)  # halfway through the second bucket
    assert h.mean == pytest.approx(0.015)


def test_empty_histogram_has_no_quantile():
    assert histogram("", "kvpush_router_handoff_gap_seconds").quantile(0.5) is None


def test_router_figures_are_deltas_between_scrapes():
    before = _gap_page({"0.01": 10}, 0.05) + 'kvpush_router_retries_total{reason="connect"} 1.0\n' \
        'kvpush_router_requests_total{endpoint="/v1/completions",outcome="success"} 10.0\n'
    after = _gap_page({"0.01": 10, "0.05": 4, "0.1": 4}, 0.05 + 0.4) + \
        'kvpush_router_retries_total{reason="connect"} 3.0\n' \
        'kvpush_router_requests_total{endpoint="/v1/completions",outcome="success"} 17.0\n' \
        'kvpush_router_requests_total{endpoint="/v1/completions",outcome="failed"} 1.0\n'
    fig = router_figures(before, after)
    assert fig.handoff_observations == 8
    assert fig.handoff_gap_p50_ms == pytest.approx(50.0)  # 4 of 8 new observations are <= 50 ms
    assert 50.0 < fig.handoff_gap_p90_ms <= 100.0
    assert fig.handoff_gap_mean_ms == pytest.approx(50.0)
    assert fig.retries == 2
    assert fig.outcomes == {"success": 7.0, "failed": 1.0}


def test_instance_figures_split_tokens_by_source_and_find_byte_counters():
    before = ('vllm:prompt_tokens_by_source_total{engine="0",model_name="tiny",source="external_kv_transfer"} 100.0\n'
              'vllm:prompt_tokens_by_source_total{engine="0",model_name="tiny",source="local_compute"} 3.0\n'
              'vllm:nixl_bytes_transferred_sum{engine="0",model_name="tiny"} 1000.0\n')
    after = ('vllm:prompt_tokens_by_source_total{engine="0",model_name="tiny",source="external_kv_transfer"} 612.0\n'
             'vllm:prompt_tokens_by_source_total{engine="0",model_name="tiny",source="local_compute"} 5.0\n'
             'vllm:prompt_tokens_by_source_total{engine="0",model_name="tiny",source="local_cache_hit"} 0.0\n'
             'vllm:nixl_bytes_transferred_sum{engine="0",model_name="tiny"} 9000.0\n'
             'vllm:nixl_num_failed_transfers_total{engine="0",model_name="tiny"} 0.0\n')
    fig = instance_figures("decode-0", "decode", before, after)
    assert fig.prompt_tokens_external == 512
    assert fig.prompt_tokens_local == 2
    assert fig.prompt_tokens_cached == 0
    assert fig.kv_bytes == {"vllm:nixl_bytes_transferred": 8000.0}
    assert fig.failed_transfers == 0
