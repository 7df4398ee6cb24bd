"""kvpush.router.metrics: the router's own histograms, read back the way the bench reads them."""
from __future__ import annotations

from kvpush.bench.scrape import router_figures
from kvpush.router.metrics import RouterMetrics


def test_handoff_gap_is_read_to_a_few_ms_around_its_20_ms_target():
    metrics = RouterMetrics()
    before = metrics.exposition()[0].decode()
    for gap_s in (0.011, 0.012, 0.013, 0.019, 0.021):
        metrics.handoff_gap.observe(gap_s)
    figures = router_figures(before, metrics.exposition()[0].decode())
    assert figures.handoff_observations == 5
    # true median 13 ms; with only 10 and 25 ms bucket bounds the estimate read 17.5 ms
    assert abs(figures.handoff_gap_p50_ms - 13.0) <= 2.5
    assert 19.0 <= figures.handoff_gap_p90_ms <= 22.5
