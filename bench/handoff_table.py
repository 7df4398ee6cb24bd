"""The handoff diagnostic's table, per rate: both intervals from the engines' own timestamps and how many
requests had both spans (pure text; the CLI renders it, `--recompute --markdown` prints it)."""
from __future__ import annotations

from .handoff import HandoffSummary
from .modes import mode_label
from .results import ModeRun
from .tails_table import ms

HandoffTable = dict[str, dict[float, HandoffSummary]]  # mode -> rate -> summary

COLUMNS = ("mode", "joined", "P answer -> D first p50", "p90", "p99", "P start -> D first p50", "p90", "p99",
           "P in prefill p50")
DEFINITION = ("engine handoff, from each request's vLLM spans on both instances (one host's wall clock): "
              "P answer = prefill's API server has the first token; P start = prefill's engine first scheduled "
              "the request; D first = decode's API server has the first token. P start -> D first holds the "
              "prompt's forward and the KV copy wherever a mode makes it; joined = requests with both spans "
              "of those completed")


def handoff_of(runs: list[ModeRun]) -> HandoffTable:
    return {run.mode: {p.rate: p.engine_handoff for p in run.points if p.engine_handoff is not None}
            for run in runs if any(p.engine_handoff is not None for p in run.points)}


def rates_in(table: HandoffTable) -> list[float]:
    return sorted({rate for by_rate in table.values() for rate in by_rate})


def rows(table: HandoffTable, rate: float, platform: str = "cpu") -> list[list[str]]:
    out = []
    for mode, by_rate in table.items():
        h = by_rate.get(rate)
        if h is None:
            continue
        out.append([mode_label(mode, platform), f"{h.joined}/{h.requests}",
                    *(ms(h.answer_to_first[q]) for q in ("p50", "p90", "p99")),
                    *(ms(h.compute_to_first[q]) for q in ("p50", "p90", "p99")), ms(h.prefill["p50"])])
    return out


def caption(rate: float) -> str:
    return f"{rate:g} req/s: engine handoff, ms"


def markdown(table: HandoffTable, platform: str = "cpu") -> str:
    parts = []
    for rate in rates_in(table):
        parts.append(f"**{caption(rate)}**\n")
        parts.append("| " + " | ".join(COLUMNS) + " |")
        parts.append("|" + "|".join("---" if c == "mode" else "---:" for c in COLUMNS) + "|")
        parts += ["| " + " | ".join(row) + " |" for row in rows(table, rate, platform)]
        parts.append("")
    return "\n".join(parts)
