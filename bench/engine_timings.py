"""The engines' own per-request timings during a bench: when they can be taken, and taking them for one
load level (the spans come to span_receiver.py; handoff.py joins them).

Every vLLM instance of every mode (colocated included, so each mode's servers do the same work)
sends its spans to the bench's receiver on loopback; that needs every instance on this machine, which
is also what makes their wall clocks comparable. After a load level the bench waits until each request
the client completed has both spans (the SDK exports every modes.SPAN_EXPORT_DELAY_MS), at most SPAN_WAIT_S,
then keeps them beside the client's result file.
"""
from __future__ import annotations

import gzip
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

from kvpush.common.errors import KvpushError
from kvpush.deploy.topology.topology import Topology
from kvpush.router.protocols import client_id_in_transfer_id

from .engine_spans import REQUEST_ID, EngineSpan
from .handoff import HandoffSamples, client_request_id, missing, spans_document
from .modes import SPAN_EXPORT_DELAY_MS
from .raw import read_text
from .span_receiver import SpanReceiver

if TYPE_CHECKING:
    from .options import BenchOptions

SPAN_WAIT_S = 30.0  # far beyond one export period: a request still without both spans then has none


def engine_timings_unavailable(topo: Topology) -> str | None:
    """Why the engines' timings cannot be taken for this topology; None when they can."""
    hosts = {spec.resolved_host for _, _, spec in topo.instances()}
    remote = sorted(h for h in hosts if not topo.hosts[h].is_local)
    if remote:
        return (f"instances on {', '.join(remote)}: the bench receives the engines' spans on loopback, and only "
                f"one host's wall clock makes their timestamps comparable")
    return None


def engine_timings_note(topo: Topology, options: BenchOptions) -> dict:
    """What bench.json says about the engines' timings: taken or not, and why not."""
    if not options.engine_timings:
        return {"taken": False, "why_not": "--no-engine-timings"}
    why_not = engine_timings_unavailable(topo)
    if why_not is not None or options.traces_endpoint is None:
        return {"taken": False, "why_not": why_not or "no span receiver"}
    return {"taken": True, "receiver": options.traces_endpoint, "export_delay_ms": SPAN_EXPORT_DELAY_MS,
            "wait_s": SPAN_WAIT_S, "clock": "wall clock of this host (every instance on it)"}


def _named(prefix: str):
    prefix = client_id_in_transfer_id(prefix)  # as the router passes the client's ids on

    def keep(record: dict) -> bool:
        request_id = record.get("attributes", {}).get(REQUEST_ID)
        client = client_request_id(request_id) if isinstance(request_id, str) else None
        return client is not None and client.startswith(prefix) and client[len(prefix):].isdigit()
    return keep


def collect(receiver: SpanReceiver, prefix: str, requests: list[str], path: Path,
            wait_s: float = SPAN_WAIT_S) -> HandoffSamples:
    """Wait for both spans of every completed request (ids `requests`, all starting with `prefix`), then
    take every span of this load level from the receiver, keep them at `path` (gzip JSON) and join them."""
    named = _named(prefix)

    def complete(held: list[dict]) -> bool:
        spans = [s for s in (EngineSpan.of(r) for r in held if named(r)) if s is not None]
        return missing(spans, requests) == 0

    receiver.wait_until(complete, wait_s)
    document = spans_document(prefix, requests, receiver.take(named))
    tmp = path.with_name(path.name + ".tmp")
    with gzip.open(tmp, "wt") as f:
        json.dump(document, f, separators=(",", ":"))
    os.replace(tmp, path)
    return HandoffSamples.of(document)


def read_kept(path: Path) -> HandoffSamples:
    try:
        text = read_text(path)
    except (OSError, EOFError, UnicodeDecodeError) as exc:
        raise KvpushError(f"{path}: not a kept spans file ({exc})") from None
    return parse_kept(text, str(path))


def parse_kept(text: str, where: str) -> HandoffSamples:
    """A kept spans file's samples from its text; `where` names the file in errors."""
    try:
        document = json.loads(text)
    except ValueError as exc:
        raise KvpushError(f"{where}: not a kept spans file ({exc})") from None
    if not isinstance(document, dict):
        raise KvpushError(f"{where}: not a kept spans file")
    return HandoffSamples.of(document)
