"""Recompute a finished bench's tails and goodput from its kept raw files (`kvpush bench --recompute DIR`).

Reads DIR/bench.json for which raw file holds which mode, rate and round (each on disk or inside
DIR/raw.tar.xz, see raw.KeptFiles), pools every round's
per-request results the way the bench did (tails.summarize), optionally at other SLOs, and
returns what the tables print. Nothing is deployed and nothing in DIR is changed.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from kvpush.common.errors import UsageError

from .conversation_table import ConversationRow, conversation_rows
from .engine_timings import parse_kept
from .handoff import HandoffSamples, pooled, summarize
from .handoff_table import HandoffTable
from .raw import KeptFiles
from .report import RESULT_FILE
from .results import RequestSamples, parse_request_samples, pooled_samples
from .tails import Slo
from .tails_table import TailsTable


@dataclass(frozen=True)
class Recomputed:
    modes: list[str]
    baseline: str
    slo: Slo
    tails: TailsTable
    platform: str = "cpu"
    handoff: HandoffTable | None = None  # the engines' handoff, where the bench kept their spans
    conversations: list[ConversationRow] | None = None  # a multi-turn bench's table


def recompute(bench_dir: Path, slo: Slo | None = None, baseline: str | None = None) -> Recomputed:
    files = KeptFiles(bench_dir)
    path = files.where(RESULT_FILE)
    try:
        doc = json.loads(files.read_text(RESULT_FILE))
    except FileNotFoundError:
        raise UsageError(f"{path}: not found; give the --out directory of a finished `kvpush bench`") from None
    except ValueError as exc:
        raise UsageError(f"{path}: not JSON ({exc})") from None
    options = doc.get("options", {})
    if slo is None:
        kept = options.get("slo") or {}
        slo = Slo(**{f: float(kept[f]) for f in ("ttft_ms", "tpot_ms") if f in kept})
    if slo.problem():
        raise UsageError(slo.problem())
    baseline = baseline or options.get("baseline", "")
    table: TailsTable = {}
    handoff: HandoffTable = {}
    for run in doc.get("runs", []):
        points = run.get("round_points") or run.get("points") or []
        by_rate: dict[float, list[RequestSamples]] = {}
        spans_by_rate: dict[float, list[HandoffSamples]] = {}
        for point in points:
            name = point.get("raw_file")
            if not name:
                raise UsageError(f"{path}: mode {run['mode']} names no raw files; it was written by a kvpush bench "
                                 f"that did not keep them, so its figures cannot be recomputed")
            by_rate.setdefault(float(point["rate"]), []).append(
                parse_request_samples(_read(files, name, run["mode"], point), files.where(name)))
            if point.get("spans_file"):
                spans = point["spans_file"]
                spans_by_rate.setdefault(float(point["rate"]), []).append(
                    parse_kept(_read(files, spans, run["mode"], point), files.where(spans)))
        table[run["mode"]] = {rate: pooled_samples(samples).tails(slo) for rate, samples in sorted(by_rate.items())}
        if spans_by_rate:
            handoff[run["mode"]] = {rate: summarize(pooled(parts)) for rate, parts in sorted(spans_by_rate.items())}
    platform = (doc.get("configuration", {}).get("topology") or {}).get("platform", "cpu")
    conversations = conversation_rows(doc, files.read_text) if options.get("conversations") else None
    return Recomputed([r["mode"] for r in doc.get("runs", [])], baseline, slo, table, platform, handoff or None,
                      conversations)


def _read(files: KeptFiles, name: str, mode: str, point: dict) -> str:
    if not files.exists(name):
        raise UsageError(f"{files.dir / name}: missing; bench.json names it for {mode} at {point['rate']:g} req/s")
    return files.read_text(name)
