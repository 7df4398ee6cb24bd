"""kvpush.bench.tails: percentiles with distribution-free intervals, goodput with a Wilson interval."""
from __future__ import annotations

import random

import pytest

from kvpush.bench.tails import (
    Slo, order_statistic_ranks, percentile, percentile_estimate, summarize, wilson_interval,
)


def test_percentile_interpolates_like_numpy():
    assert percentile([1.0, 2.0, 3.0, 4.0], 0.5) == pytest.approx(2.5)
    assert percentile([10.0], 0.99) == 10.0
    assert percentile([0.0, 100.0], 0.9) == pytest.approx(90.0)


def test_median_interval_ranks_match_the_textbook_table():
    assert order_statistic_ranks(100, 0.5) == (40, 61)  # the classic n = 100 table
    assert order_statistic_ranks(5, 0.5) == (None, None)  # 2 x 0.5^5 > 5%: five samples bound nothing


def test_a_tail_percentile_is_open_above_until_there_are_enough_requests():
    assert order_statistic_ranks(367, 0.99)[1] is None
    assert order_statistic_ranks(368, 0.99)[1] == 368
    assert order_statistic_ranks(35, 0.9)[1] is None and order_statistic_ranks(36, 0.9)[1] == 36
    e = percentile_estimate([float(v) for v in range(1, 65)], 0.99)
    assert e.value == pytest.approx(63.37) and e.high is None and e.low is not None


def test_interval_holds_the_estimate_and_covers_the_true_quantile_about_95_percent_of_the_time():
    rng = random.Random(7)
    covered = 0
    trials = 400
    for _ in range(trials):
        values = [rng.expovariate(1.0) for _ in range(128)]
        e = percentile_estimate(values, 0.9)
        assert e.low <= e.value <= e.high
        covered += e.low <= 2.302585 <= e.high  # the exponential's true p90: ln 10
    assert 0.92 <= covered / trials <= 0.995  # at least 95% by construction, up to sampling noise


def test_wilson_interval_is_inside_0_1_and_narrows_with_more_trials():
    low, high = wilson_interval(0, 10)
    assert low == pytest.approx(0.0, abs=1e-12) and 0.25 < high < 0.35
    assert wilson_interval(10, 10)[1] == pytest.approx(1.0)
    wide, narrow = wilson_interval(50, 100), wilson_interval(500, 1000)
    assert wide[0] < narrow[0] < 0.5 < narrow[1] < wide[1]
    assert wilson_interval(0, 0) == (0.0, 1.0)


def test_wilson_interval_always_holds_the_observed_fraction():
    outside = [(good, trials) for trials in range(1, 400) for good in (0, trials // 3, trials)
               if not wilson_interval(good, trials)[0] <= good / trials <= wilson_interval(good, trials)[1]]
    assert outside == []


def test_goodput_counts_requests_meeting_both_slos_per_second_of_bench_time():
    ttft = [100.0, 200.0, 900.0, 50.0]
    tpot = [10.0, 150.0, 10.0, None]  # the last is a one-token answer: no TPOT, meets that SLO
    t = summarize(ttft, tpot, [500.0] * 4, sent=5, duration_s=2.0, slo=Slo(ttft_ms=500.0, tpot_ms=100.0))
    assert (t.sent, t.completed, t.good) == (5, 4, 2)  # 200 ms misses TPOT, 900 ms misses TTFT; one failed
    assert t.goodput.value == pytest.approx(1.0)
    assert t.throughput == pytest.approx(2.0)
    assert t.good_fraction.value == pytest.approx(0.4)
    low, high = wilson_interval(2, 5)
    assert (t.goodput.low, t.goodput.high) == pytest.approx((low * 2.5, high * 2.5))
    assert t.latency["tpot"]["p50"].value == pytest.approx(10.0)  # the one-token answer has no TPOT sample
    assert summarize(ttft, tpot, [500.0] * 4, 4, 2.0, Slo(1000.0, 200.0)).good == 4


def test_nothing_measured_gives_empty_figures_not_errors():
    t = summarize([], [], [], sent=0, duration_s=0.0, slo=Slo())
    assert t.goodput.value is None and t.good_fraction.value is None
    assert t.latency["ttft"]["p99"].value is None
