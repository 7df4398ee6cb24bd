"""kvpush.bench.conversation_table: per mode and rate, KV moved per turn against the new
tokens, TTFT by turn, and answers compared with the reference mode's."""
from __future__ import annotations

import json

from kvpush.bench.conversation_table import conversation_rows, markdown


def raw(answers: list[list[int]], errors: list[str], ttfts: list[float]) -> str:
    return json.dumps({"errors": errors, "ttfts": ttfts,
                       "conversations": {"new_tokens": [300, 100, 300, 100], "turn": [0, 1, 0, 1],
                                         "answer_token_ids": answers}})


def point(mode: str, raw_file: str, external: float, cached: float, local: float, prefill_local: float,
          rate: float = 1.0, round_: int = 0) -> dict:
    return {"rate": rate, "round": round_, "raw_file": raw_file,
            "instances": [{"role": "decode", "prompt_tokens_external": external, "prompt_tokens_cached": cached,
                           "prompt_tokens_local": local},
                          {"role": "prefill", "prompt_tokens_external": 0, "prompt_tokens_cached": 0,
                           "prompt_tokens_local": prefill_local}]}


def test_rows_divide_the_instances_counts_by_completed_turns_and_compare_answers_with_colocated():
    files = {
        "c.json": raw([[1], [2], [3], [4]], ["", "", "", ""], [0.1, 0.02, 0.1, 0.02]),
        "k.json": raw([[1], [2], [3], [9]], ["", "", "", ""], [0.2, 0.04, 0.3, 0.06]),
        "l.json": raw([[1], [], [3], [4]], ["", "HTTP 500", "", ""], [0.2, 0.0, 0.3, 0.08]),
    }
    doc = {"runs": [
        {"mode": "colocated", "points": [point("colocated", "c.json", 0, 300, 500, 0)]},
        {"mode": "kvpush", "points": [point("kvpush", "k.json", 800, 0, 0, 800)]},
        {"mode": "kvpush+least-loaded", "points": [point("kvpush+least-loaded", "l.json", 700, 0, 0, 600)]},
    ]}
    rows = {r.mode: r for r in conversation_rows(doc, files.__getitem__)}
    k = rows["kvpush"]
    assert (k.turns_done, k.turns_sent, k.new_per_turn, k.moved_per_turn, k.prefill_computed_per_turn) == (
        4, 4, 200.0, 200.0, 200.0)
    assert k.moved_over_new == 1.0
    assert (k.answers_equal, k.answers_compared) == (3, 4)
    assert round(k.ttft_first_p50_ms, 6) == 250.0 and round(k.ttft_later_p50_ms, 6) == 50.0
    least = rows["kvpush+least-loaded"]
    assert least.turns_done == 3 and least.new_per_turn == 700 / 3 and (least.answers_equal, least.answers_compared) == (3, 3)
    c = rows["colocated"]
    assert c.answers_equal is None and c.moved_per_turn == 0 and c.cached_per_turn == 75.0
    text = markdown(list(rows.values()), reference="colocated")
    assert "| kvpush, least-loaded router | 1 | 3/4 |" in text and "| 3/4 |" in text


def test_rounds_pool_and_answers_compare_within_the_same_round():
    files = {"c1": raw([[1], [2], [3], [4]], [""] * 4, [0.1] * 4), "c2": raw([[5], [6], [7], [8]], [""] * 4, [0.1] * 4),
             "k1": raw([[1], [2], [3], [4]], [""] * 4, [0.1] * 4), "k2": raw([[5], [6], [7], [8]], [""] * 4, [0.1] * 4)}
    doc = {"runs": [
        {"mode": "colocated", "round_points": [point("colocated", "c1", 0, 0, 1, 0, round_=0),
                                               point("colocated", "c2", 0, 0, 1, 0, round_=1)]},
        {"mode": "kvpush", "round_points": [point("kvpush", "k1", 400, 0, 0, 0, round_=0),
                                            point("kvpush", "k2", 400, 0, 0, 0, round_=1)]},
    ]}
    k = next(r for r in conversation_rows(doc, files.__getitem__) if r.mode == "kvpush")
    assert (k.turns_done, k.moved_per_turn, k.answers_equal, k.answers_compared) == (8, 100.0, 8, 8)


def test_without_a_reference_no_answers_are_compared():
    files = {"k": raw([[1], [2], [3], [4]], [""] * 4, [0.1] * 4)}
    rows = conversation_rows({"runs": [{"mode": "kvpush", "points": [point("kvpush", "k", 0, 0, 0, 0)]}]}, files.__getitem__)
    assert rows[0].answers_equal is None and markdown(rows).rstrip().endswith("| 100.0 | 100.0 | - |")
