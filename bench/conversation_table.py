"""The multi-turn table of a finished `kvpush bench --conversations` (pure: a bench.json document and
a reader of its raw files in, rows out).

Per mode and rate, over every round, per completed turn: the tokens new in that turn (the first
turn's whole prompt, after it the user's new tokens: conversations.new_tokens), the prompt tokens
decode received by KV transfer, found in its own prefix cache and computed itself, the tokens prefill
computed (its prefix cache spares the rest), TTFT p50 of first and of later turns, and how many
answers equal the reference mode's (the same conversation, turn, rate and round; a plain vLLM
server's where the reference is `colocated`). The instances' figures are vLLM's own
`vllm:prompt_tokens_by_source` counters, differences around each rate.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Callable

from .modes import mode_label
from .tails import percentile

REFERENCE_MODE = "colocated"


@dataclass(frozen=True)
class ConversationRow:
    mode: str
    rate: float
    turns_done: int
    turns_sent: int
    new_per_turn: float | None
    moved_per_turn: float | None  # decode's prompt tokens by KV transfer
    cached_per_turn: float | None  # decode's prompt tokens from its own prefix cache
    decode_computed_per_turn: float | None
    prefill_computed_per_turn: float | None
    ttft_first_p50_ms: float | None
    ttft_later_p50_ms: float | None
    answers_equal: int | None  # to the reference's, of answers_compared; None: no reference
    answers_compared: int = 0

    @property
    def moved_over_new(self) -> float | None:
        if self.moved_per_turn is None or not self.new_per_turn:
            return None
        return self.moved_per_turn / self.new_per_turn


@dataclass
class _Turns:
    """One rate's requests of one round, from its raw result file."""

    done: list[bool]
    new: list[int]
    turn: list[int]
    ttft_s: list[float]
    answers: list[list[int]]


def _turns(text: str, source: str) -> _Turns:
    doc = json.loads(text)
    conv = doc.get("conversations")
    if not isinstance(conv, dict):
        raise ValueError(f"{source}: not a multi-turn result (no 'conversations')")
    return _Turns(
        [not e for e in doc["errors"]], conv["new_tokens"], conv["turn"], doc["ttfts"], conv["answer_token_ids"]
    )


def _per(total: float, count: int) -> float | None:
    return total / count if count else None


def conversation_rows(doc: dict, read: Callable[[str], str], reference: str | None = None) -> list[ConversationRow]:
    """Every mode's rows, rates ascending; `reference` (default: colocated where the bench ran it)
    is the mode whose answers the others' are compared with."""
    runs = doc.get("runs", [])
    modes = [r["mode"] for r in runs]
    reference = reference if reference is not None else (REFERENCE_MODE if REFERENCE_MODE in modes else None)
    points = {r["mode"]: (r.get("round_points") or r.get("points") or []) for r in runs}
    kept: dict[tuple[str, float, int], _Turns] = {}
    for mode, mode_points in points.items():
        for p in mode_points:
            if p.get("raw_file"):
                kept[(mode, float(p["rate"]), int(p.get("round", 0)))] = _turns(read(p["raw_file"]), p["raw_file"])
    rows = []
    for mode in modes:
        for rate in sorted({float(p["rate"]) for p in points[mode]}):
            rate_points = [p for p in points[mode] if float(p["rate"]) == rate]
            rounds = [kept[(mode, rate, int(p.get("round", 0)))] for p in rate_points
                      if (mode, rate, int(p.get("round", 0))) in kept]
            done = [(t, i) for t in rounds for i, ok in enumerate(t.done) if ok]
            figures = {"external": 0.0, "cached": 0.0, "local": 0.0, "prefill_local": 0.0}
            for p in rate_points:
                for inst in p.get("instances", []):
                    if inst["role"] == "decode":
                        figures["external"] += inst["prompt_tokens_external"]
                        figures["cached"] += inst["prompt_tokens_cached"]
                        figures["local"] += inst["prompt_tokens_local"]
                    elif inst["role"] == "prefill":
                        figures["prefill_local"] += inst["prompt_tokens_local"]
            first = [t.ttft_s[i] * 1000 for t, i in done if t.turn[i] == 0]
            later = [t.ttft_s[i] * 1000 for t, i in done if t.turn[i] > 0]
            equal, compared = None, 0
            if reference is not None and mode != reference:
                equal = 0
                for p in rate_points:
                    key = (mode, rate, int(p.get("round", 0)))
                    ref = kept.get((reference, rate, int(p.get("round", 0))))
                    if key not in kept or ref is None:
                        continue
                    mine = kept[key]
                    for i, ok in enumerate(mine.done):
                        if ok and i < len(ref.done) and ref.done[i]:
                            compared += 1
                            equal += mine.answers[i] == ref.answers[i]
            n = len(done)
            rows.append(ConversationRow(
                mode=mode, rate=rate, turns_done=n, turns_sent=sum(len(t.done) for t in rounds),
                new_per_turn=_per(sum(t.new[i] for t, i in done), n), moved_per_turn=_per(figures["external"], n),
                cached_per_turn=_per(figures["cached"], n), decode_computed_per_turn=_per(figures["local"], n),
                prefill_computed_per_turn=_per(figures["prefill_local"], n),
                ttft_first_p50_ms=percentile(first, 0.5) if first else None,
                ttft_later_p50_ms=percentile(later, 0.5) if later else None,
                answers_equal=equal, answers_compared=compared))
    return rows


COLUMNS = ("mode", "conv/s", "turns done", "new tok/turn", "KV by transfer tok/turn", "transfer / new",
           "decode cache hit tok/turn", "decode computed tok/turn", "prefill computed tok/turn",
           "TTFT p50 turn 1 ms", "TTFT p50 later turns ms", "answers = reference")


def _num(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def row_cells(row: ConversationRow, platform: str = "cpu") -> list[str]:
    answers = "-" if row.answers_equal is None else f"{row.answers_equal}/{row.answers_compared}"
    ratio = "-" if row.moved_over_new is None else f"{row.moved_over_new:.2f}x"
    return [mode_label(row.mode, platform), f"{row.rate:g}", f"{row.turns_done}/{row.turns_sent}",
            _num(row.new_per_turn), _num(row.moved_per_turn), ratio, _num(row.cached_per_turn),
            _num(row.decode_computed_per_turn), _num(row.prefill_computed_per_turn),
            _num(row.ttft_first_p50_ms, 1), _num(row.ttft_later_p50_ms, 1), answers]


def markdown(rows: list[ConversationRow], platform: str = "cpu", reference: str | None = None) -> str:
    lines = ["**Multi-turn: prompt tokens per completed turn (vLLM's own counters), TTFT by turn"
             + (f", answers compared with {reference}'s" if reference else "") + "**", "",
             "| " + " | ".join(COLUMNS) + " |", "|---|" + "---:|" * (len(COLUMNS) - 1)]
    lines += ["| " + " | ".join(row_cells(r, platform)) + " |" for r in rows]
    return "\n".join(lines) + "\n"
