"""kvpush.bench.plots: real PNGs from recorded figures."""
from __future__ import annotations

import dataclasses

from kvpush.bench.plots import write_plots
from kvpush.bench.results import ModeRun

from test_bench_results import recorded_point  # noqa: F401  (fixture from recorded output)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_ttft_tpot_and_handoff_plots_are_written(tmp_path, recorded_point):  # noqa: F811
    second = dataclasses.replace(recorded_point, rate=2.0)
    runs = [ModeRun("nixl-pull", "a", [recorded_point, second]), ModeRun("colocated", "b", [])]
    paths = write_plots(runs, tmp_path, "tiny, 512 in / 16 out")
    assert [p.name for p in paths] == ["ttft.png", "tpot.png", "handoff.png"]
    for p in paths:
        assert p.read_bytes()[:8] == PNG_MAGIC and p.stat().st_size > 10_000


def test_the_goodput_plot_comes_first_when_the_points_have_tails(tmp_path, recorded_point):  # noqa: F811
    from kvpush.bench.tails import Slo, summarize

    tails = summarize([100.0, 2000.0], [10.0, 10.0], [500.0, 2500.0], sent=2, duration_s=2.0, slo=Slo())
    point = dataclasses.replace(recorded_point, tails=tails)
    paths = write_plots([ModeRun("kvpush", "a", [point, dataclasses.replace(point, rate=2.0)])], tmp_path, "x")
    assert paths[0].name == "goodput.png" and paths[0].read_bytes()[:8] == PNG_MAGIC


def test_nothing_measured_draws_nothing(tmp_path):
    assert write_plots([ModeRun("kvpush", "a", [])], tmp_path, "x") == []
    assert list(tmp_path.iterdir()) == []
