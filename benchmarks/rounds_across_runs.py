"""kvpush against a baseline mode over the rounds of several `kvpush bench --rounds` runs.

One round of one run gives one pair: kvpush's TTFT p50 over the baseline's, on the same prompts
at the same rate, minutes apart. At saturation those ratios spread widely (0.3x-3x per round on
the 2-core host) because prefill's own speed varies from round to round, and a run of 6 rounds
cannot tell a 3% difference from noise. Pooling the rounds of many runs can. For each rate this
prints the geometric mean of the per-round ratios with a 95% confidence interval and how many
rounds kvpush was lower in. It also fits log(TTFT ratio) = a + b * log(prefill engine time ratio)
and prints exp(a): the TTFT ratio at equal prefill speed, i.e. with prefill's round-to-round
variance taken out.

    python benchmarks/rounds_across_runs.py RUN.json [RUN.json ...] [--mode kvpush] [--baseline nixl-pull]

A RUN.json that is not a file is looked up, as a glob (quote it), in its folder's raw.tar.xz, where
benchmarks/pack_results.py keeps a committed run's files.
"""
from __future__ import annotations

import argparse
import fnmatch
import json
import math
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

from kvpush.bench.raw import KeptFiles

Z95 = 1.96


@dataclass(frozen=True)
class RoundPair:
    run: str
    rate: float
    ttft_ratio: float
    prefill_ratio: float | None  # prefill's engine time per request, where the run recorded it


def round_pairs(report: dict, run: str, mode: str, baseline: str) -> list[RoundPair]:
    """Every round in which both modes measured the same rate."""
    by_key: dict[tuple[float, int], dict[str, dict]] = {}
    for mode_run in report["runs"]:
        for point in mode_run.get("round_points", []):
            by_key.setdefault((point["rate"], point["round"]), {})[mode_run["mode"]] = point
    pairs = []
    for (rate, _), points in sorted(by_key.items()):
        if mode not in points or baseline not in points:
            continue
        ours, theirs = points[mode], points[baseline]
        ttft = [p["client"]["latency"]["ttft"]["p50"] for p in (ours, theirs)]
        prefill = [p.get("prefill_engine_ms") for p in (ours, theirs)]
        if not all(ttft):
            continue
        pairs.append(RoundPair(run, rate, ttft[0] / ttft[1], prefill[0] / prefill[1] if all(prefill) else None))
    return pairs


@dataclass(frozen=True)
class Summary:
    rounds: int
    lower_in: int
    ratio: float  # geometric mean of the per-round TTFT ratios
    ratio_ci: tuple[float, float]
    at_equal_prefill: float | None  # exp(intercept) of the fit against the prefill ratio
    at_equal_prefill_ci: tuple[float, float] | None


def summarize(pairs: list[RoundPair]) -> Summary:
    logs = [math.log(p.ttft_ratio) for p in pairs]
    mean = statistics.fmean(logs)
    half = Z95 * statistics.stdev(logs) / math.sqrt(len(logs)) if len(logs) > 1 else math.inf
    fit = _intercept([(math.log(p.prefill_ratio), math.log(p.ttft_ratio)) for p in pairs if p.prefill_ratio])
    return Summary(len(pairs), sum(p.ttft_ratio < 1 for p in pairs), math.exp(mean), (math.exp(mean - half), math.exp(mean + half)),
                   None if fit is None else math.exp(fit[0]),
                   None if fit is None else (math.exp(fit[0] - fit[1]), math.exp(fit[0] + fit[1])))


def _intercept(points: list[tuple[float, float]]) -> tuple[float, float] | None:
    """Least-squares intercept of y on x and its 95% half-width; None with fewer than 3 points."""
    n = len(points)
    if n < 3:
        return None
    mx = statistics.fmean(x for x, _ in points)
    my = statistics.fmean(y for _, y in points)
    sxx = sum((x - mx) ** 2 for x, _ in points)
    if sxx == 0:
        return None
    slope = sum((x - mx) * (y - my) for x, y in points) / sxx
    a = my - slope * mx
    residual = sum((y - a - slope * x) ** 2 for x, y in points) / (n - 2)
    return a, Z95 * math.sqrt(residual * (1 / n + mx * mx / sxx))


def reports_at(path: Path) -> list[tuple[str, str]]:
    """(name, text) of the file at `path`, or of every member of its folder's raw.tar.xz matching its name."""
    if path.is_file():
        return [(path.name, path.read_text())]
    files = KeptFiles(path.parent)
    names = sorted(fnmatch.filter(files.archived(), path.name))
    if not names:
        raise SystemExit(f"{path}: no such file, nor a match in {path.parent / 'raw.tar.xz'}")
    return [(name, files.read_text(name)) for name in names]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", type=Path, help="bench.json files of `kvpush bench --rounds N` runs")
    ap.add_argument("--mode", default="kvpush")
    ap.add_argument("--baseline", default="nixl-pull")
    args = ap.parse_args(argv)
    pairs: list[RoundPair] = []
    reports = [kept for path in args.runs for kept in reports_at(path)]
    for name, text in reports:
        pairs += round_pairs(json.loads(text), name, args.mode, args.baseline)
    if not pairs:
        print(f"no round measured both {args.mode} and {args.baseline}", file=sys.stderr)
        return 1
    print(f"{args.mode} TTFT p50 / {args.baseline}'s, per round, {len(reports)} run(s)")
    for rate in sorted({p.rate for p in pairs}):
        s = summarize([p for p in pairs if p.rate == rate])
        line = (f"{rate:g} req/s: {s.rounds} rounds, lower in {s.lower_in}; geometric mean {s.ratio:.3f}x "
                f"(95% CI {s.ratio_ci[0]:.3f}-{s.ratio_ci[1]:.3f})")
        if s.at_equal_prefill is not None:
            line += (f"; at equal prefill speed {s.at_equal_prefill:.3f}x "
                     f"(95% CI {s.at_equal_prefill_ci[0]:.3f}-{s.at_equal_prefill_ci[1]:.3f})")
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
