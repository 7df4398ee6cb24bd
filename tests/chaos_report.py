"""What a chaos run found, per topology: requests, answers, wrong answers, failures with and
without a healthy instance of each role, slow requests, latency and the faults injected; and the
failures grouped by what they said and which fault they met. Works on the JSON rows the run
writes (RequestRecord.to_json, Fault.to_json), so a table can be made again from the files."""
from __future__ import annotations

import re
import statistics
from collections import Counter

from chaos_requests import SLOW_S

SUMMARY_COLUMNS = [
    ("topology", "topology"), ("requests", "requests (streamed)"), ("answered", "answered"), ("wrong", "wrong answers"),
    ("failed_with_peer", "failed, healthy instance of each role"), ("failed_without_peer", "failed, a role had none"),
    ("cut", "streams cut by a killed decode"),
    ("slow", f"over {SLOW_S:g} s"), ("latency", "latency p50 / p99 / max (s)"), ("faults", "SIGSTOPs / SIGKILLs"),
    ("up_s", "`up` min-max (s)"),
]


def _quantile(values: list[float], q: float) -> float:
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[round(q * 100) - 1]


def cut_by_killed_decode(request: dict, faults_by_id: dict[str, dict]) -> bool:
    """A stream that had begun and was cut while a decode instance was killed: the tokens came from
    that decode (a request is not moved to another decode once it streams), so no peer can save it."""
    return (request["streamed"] and not request["answered"] and request["first_token_s"] is not None
            and any(faults_by_id[i]["kind"] == "kill" and faults_by_id[i]["role"] == "decode"
                    for i in request["faults"] if i in faults_by_id))


def summarize(topology: str, requests: list[dict], faults: list[dict]) -> dict:
    """One topology's numbers from its request and fault rows. A failed request counts as failed
    with a healthy peer unless a role had no untouched instance during it, or it was a stream cut
    by a killed decode (counted apart)."""
    by_id = {f["id"]: f for f in faults}
    cut = [r for r in requests if cut_by_killed_decode(r, by_id)]
    failed = [r for r in requests if not r["answered"]]
    latencies = sorted(r["latency_s"] for r in requests)
    ups = [f["up_s"] for f in faults if f.get("up_s") is not None]
    return {
        "topology": topology,
        "requests": len(requests), "streamed": sum(r["streamed"] for r in requests),
        "answered": len(requests) - len(failed),
        "answered_streamed": sum(r["answered"] and r["streamed"] for r in requests),
        "wrong": sum(r["matches_reference"] is False for r in requests),
        "failed_with_peer": sum(r["healthy_peer"] for r in failed) - sum(r["healthy_peer"] for r in cut),
        "failed_without_peer": sum(not r["healthy_peer"] for r in failed) - sum(not r["healthy_peer"] for r in cut),
        "cut_by_killed_decode": len(cut),
        "failed_streamed": sum(r["streamed"] for r in failed),
        "slow": sum(r["latency_s"] > SLOW_S for r in requests),
        "latency_p50_s": round(_quantile(latencies, 0.5), 2) if latencies else None,
        "latency_p99_s": round(_quantile(latencies, 0.99), 2) if latencies else None,
        "latency_max_s": round(latencies[-1], 2) if latencies else None,
        "stops": sum(f["kind"] == "stop" for f in faults), "kills": sum(f["kind"] == "kill" for f in faults),
        "up_min_s": min(ups) if ups else None, "up_max_s": max(ups) if ups else None,
    }


COUNTS = ("requests", "streamed", "answered", "answered_streamed", "wrong", "failed_with_peer", "failed_without_peer",
          "cut_by_killed_decode", "failed_streamed", "slow", "stops", "kills")


def total(summaries: list[dict]) -> dict:
    """The topologies together: counts added, the slowest request and the `up` range over all."""
    ups = [s[k] for s in summaries for k in ("up_min_s", "up_max_s") if s[k] is not None]
    latencies = [s["latency_max_s"] for s in summaries if s["latency_max_s"] is not None]
    return {"topology": "all", **{k: sum(s[k] for s in summaries) for k in COUNTS}, "latency_p50_s": None,
            "latency_p99_s": None, "latency_max_s": max(latencies, default=None),
            "up_min_s": min(ups, default=None), "up_max_s": max(ups, default=None)}


def _cells(s: dict) -> dict[str, str]:
    return {
        "topology": s["topology"], "requests": f"{s['requests']:,} ({s['streamed']:,})", "answered": f"{s['answered']:,}",
        "wrong": f"{s['wrong']:,}", "failed_with_peer": f"{s['failed_with_peer']:,}",
        "failed_without_peer": f"{s['failed_without_peer']:,}", "cut": f"{s['cut_by_killed_decode']:,}",
        "slow": f"{s['slow']:,}",
        "latency": " / ".join("-" if s[k] is None else f"{s[k]:.2f}" for k in ("latency_p50_s", "latency_p99_s", "latency_max_s")),
        "faults": f"{s['stops']} / {s['kills']}",
        "up_s": "-" if s["up_min_s"] is None else f"{s['up_min_s']:.1f}-{s['up_max_s']:.1f}",
    }


def summary_table(summaries: list[dict]) -> str:
    """A markdown table, one row per topology (and one for all of them, when there are several)."""
    head = [title for _, title in SUMMARY_COLUMNS]
    rows = [[_cells(s)[key] for key, _ in SUMMARY_COLUMNS] for s in summaries + ([total(summaries)] if len(summaries) > 1 else [])]
    return "\n".join("| " + " | ".join(row) + " |" for row in [head, ["---"] * len(head), *rows])


def _what_it_said(error: str) -> str:
    """An error without what differs between requests (ids, numbers), so alike failures group."""
    said = re.sub(r"[0-9a-f]{16,}", "<id>", error)
    said = re.sub(r"\d+(\.\d+)?", "N", said)
    return said[:140]


def failure_causes(requests: list[dict], faults: list[dict]) -> list[tuple[int, str, str, str]]:
    """(count, topology, fault under way, what the client got) for every failed or wrong request,
    most frequent first. The fault is named by kind, role and process (`kill decode api_server`);
    `none` when no fault was under way."""
    by_id = {f["id"]: f for f in faults}
    groups: Counter = Counter()
    for r in requests:
        if r["answered"] and r["matches_reference"] is not False:
            continue
        met = sorted({f"{by_id[i]['kind']} {by_id[i]['role']} {by_id[i]['process']}" for i in r["faults"] if i in by_id})
        what = "wrong answer" if r["matches_reference"] is False else _what_it_said(r["error"])
        groups[(r["topology"], ", ".join(met) or "none", what)] += 1
    return [(n, *key) for key, n in groups.most_common()]


def causes_table(causes: list[tuple[int, str, str, str]]) -> str:
    lines = ["| requests | topology | fault under way | what the client got |", "|---|---|---|---|"]
    lines += [f"| {n} | {topology} | {fault} | {what.replace('|', '/')} |" for n, topology, fault, what in causes]
    return "\n".join(lines)
