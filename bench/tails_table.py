"""The headline table of a bench, per rate: goodput and tail latencies with their confidence intervals,
and the same-run ratio to the baseline (pure text; the CLI renders it, `--recompute --markdown` prints it)."""
from __future__ import annotations

from .modes import mode_label
from .results import ModeRun
from .tails import Estimate, Tails

TailsTable = dict[str, dict[float, Tails]]  # mode -> rate -> tails

COLUMNS = ("mode", "sent", "done/s", "goodput/s [95% CI]", "good %", "TTFT p50 [CI]", "TTFT p90", "TTFT p99 [CI]",
           "TPOT p50 [CI]", "TPOT p99", "E2E p50", "E2E p99", "TTFT p50 ratio", "TTFT p99 ratio", "goodput ratio")


def tails_of(runs: list[ModeRun]) -> TailsTable:
    return {run.mode: {p.rate: p.tails for p in run.points if p.tails is not None} for run in runs}


def rates_in(table: TailsTable) -> list[float]:
    return sorted({rate for by_rate in table.values() for rate in by_rate})


def ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}" if value >= 100 else f"{value:.1f}"


def with_interval(e: Estimate, fmt=ms) -> str:
    """'value [low, high]'; an open side shows as '?' (too few requests to bound it)."""
    if e.value is None:
        return "-"
    side = lambda v: "?" if v is None else fmt(v)  # noqa: E731
    return f"{fmt(e.value)} [{side(e.low)}, {side(e.high)}]"


def per_s(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def ratio_text(value: float | None, baseline: float | None) -> str:
    if value is None or baseline is None or baseline <= 0:
        return "-"
    return f"{value / baseline:.2f}x"


def rows(table: TailsTable, rate: float, baseline: str, platform: str = "cpu") -> list[list[str]]:
    base = table.get(baseline, {}).get(rate)
    out = []
    for mode, by_rate in table.items():
        t = by_rate.get(rate)
        label = mode_label(mode, platform)
        if t is None:
            out.append([label] + ["-"] * (len(COLUMNS) - 1))
            continue
        lat = t.latency
        out.append([
            label, str(t.sent), per_s(t.throughput), with_interval(t.goodput, per_s),
            with_interval(t.good_fraction, lambda v: f"{100 * v:.0f}"),
            with_interval(lat["ttft"]["p50"]), ms(lat["ttft"]["p90"].value), with_interval(lat["ttft"]["p99"]),
            with_interval(lat["tpot"]["p50"]), ms(lat["tpot"]["p99"].value),
            ms(lat["e2el"]["p50"].value), ms(lat["e2el"]["p99"].value),
            ratio_text(lat["ttft"]["p50"].value, base.latency["ttft"]["p50"].value if base else None),
            ratio_text(lat["ttft"]["p99"].value, base.latency["ttft"]["p99"].value if base else None),
            ratio_text(t.goodput.value, base.goodput.value if base else None),
        ])
    return out


def caption(table: TailsTable, rate: float, baseline: str) -> str:
    slo = next((by_rate[rate].slo for by_rate in table.values() if rate in by_rate), None)
    where = f" at TTFT <= {slo.ttft_ms:g} ms and TPOT <= {slo.tpot_ms:g} ms" if slo else ""
    return f"{rate:g} req/s: goodput{where}; ratios vs {baseline}; ms unless marked"


def markdown(table: TailsTable, baseline: str, platform: str = "cpu") -> str:
    parts = []
    for rate in rates_in(table):
        parts.append(f"**{caption(table, rate, baseline)}**\n")
        parts.append("| " + " | ".join(COLUMNS) + " |")
        parts.append("|" + "|".join("---" if c == "mode" else "---:" for c in COLUMNS) + "|")
        parts += ["| " + " | ".join(row) + " |" for row in rows(table, rate, baseline, platform)]
        parts.append("")
    return "\n".join(parts)
