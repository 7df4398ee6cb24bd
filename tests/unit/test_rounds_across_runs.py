"""benchmarks/rounds_across_runs.py: per-round pairs from bench reports and what they add up to."""
from __future__ import annotations

import json
import math

import pytest
from benchmark_scripts import load_benchmark

from kvpush.bench.raw import pack

pytestmark = pytest.mark.unit

rar = load_benchmark("rounds_across_runs")


def point(rate: float, rnd: int, ttft: float, prefill: float | None) -> dict:
    return {"rate": rate, "round": rnd, "client": {"latency": {"ttft": {"p50": ttft}}}, "prefill_engine_ms": prefill}


def report(kvpush: list[tuple], pull: list[tuple]) -> dict:
    return {"runs": [{"mode": "kvpush", "round_points": [point(*p) for p in kvpush]},
                     {"mode": "nixl-pull", "round_points": [point(*p) for p in pull]},
                     {"mode": "nixl-push", "round_points": [point(2.0, 0, 999.0, 1.0)]}]}


def test_rounds_pair_up_by_rate_and_round_only_where_both_modes_measured():
    doc = report([(2.0, 0, 900.0, 600.0), (2.0, 1, 800.0, None), (1.0, 0, 500.0, 400.0)],
                 [(2.0, 0, 1000.0, 500.0), (2.0, 1, 800.0, 700.0)])
    pairs = rar.round_pairs(doc, "run", "kvpush", "nixl-pull")
    assert [(p.rate, p.ttft_ratio, p.prefill_ratio) for p in pairs] == [(2.0, 0.9, 1.2), (2.0, 1.0, None)]


def test_at_equal_prefill_speed_is_the_fits_intercept():
    # TTFT ratio = 0.95 * prefill ratio ** 1.5 exactly: the raw mean says little, the intercept 0.95
    prefill = [0.8, 0.9, 1.0, 1.1, 1.3]
    pairs = [rar.RoundPair("r", 2.0, 0.95 * q ** 1.5, q) for q in prefill]
    s = rar.summarize(pairs)
    assert s.rounds == 5 and s.lower_in == sum(0.95 * q ** 1.5 < 1 for q in prefill)
    assert s.at_equal_prefill == pytest.approx(0.95) and s.at_equal_prefill_ci == pytest.approx((0.95, 0.95))
    assert s.ratio == pytest.approx(math.exp(sum(math.log(p.ttft_ratio) for p in pairs) / 5))
    assert s.ratio_ci[0] < s.ratio < s.ratio_ci[1]


def test_the_command_prints_one_line_per_rate(tmp_path, capsys):
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(report([(1.0, k, 90.0 + k, 100.0 + k) for k in range(3)],
                                      [(1.0, k, 100.0, 100.0) for k in range(3)])))
    assert rar.main([str(path)]) == 0
    out = capsys.readouterr().out
    assert "1 req/s: 3 rounds, lower in 3; geometric mean 0.910x" in out and "at equal prefill speed" in out


def test_runs_packed_into_a_folders_archive_are_read_by_glob(tmp_path, capsys):
    for k, ttft in enumerate((90.0, 80.0)):
        (tmp_path / f"run{k}.json").write_text(json.dumps(report([(1.0, 0, ttft, None)], [(1.0, 0, 100.0, None)])))
    (tmp_path / "other.json").write_text(json.dumps(report([(1.0, 0, 10.0, None)], [(1.0, 0, 100.0, None)])))
    pack(tmp_path)
    assert not (tmp_path / "run0.json").exists()
    assert rar.main([str(tmp_path / "run*.json")]) == 0
    out = capsys.readouterr().out
    assert "2 run(s)" in out and "1 req/s: 2 rounds, lower in 2" in out
    with pytest.raises(SystemExit, match="nothing.json: no such file, nor a match in"):
        rar.main([str(tmp_path / "nothing.json")])
