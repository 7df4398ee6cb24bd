"""The handoff diagnostic from the engines' own timestamps, defined the same for every mode (pure).

Per request the router sends two legs carrying one X-Request-Id (router.protocols.new_transfer_id:
the client's id, then random hex), so vLLM names the request alike on both instances and each
exports one span for it (engine_spans.py). From the pair:

- P first token = P's arrival + P's TTFT (when prefill's API server had the first token)
- P compute start = P first token - P's time in prefill (when prefill's engine first scheduled it)
- D first token = D's arrival + D's TTFT

and two intervals, in ms: **P answer -> D first** (D first token - P first token) and **P start ->
D first** (D first token - P compute start). The second holds the prompt's forward, which costs the
same in every mode, and the KV copy wherever a connector does it: inside prefill's step (kvpush on
CPU, so before P's first token) or after it (nixl-pull's READ, nixl-push's WRITE). All four
timestamps are wall-clock times of processes on one host.

The kept raw file of one load level (`raw/<mode>-rate<r>[-round<k>]-spans.json.gz`) holds the
request-id prefix the client used, the ids of the requests it completed, and every span that named
one of them: `HandoffSamples.of` recomputes everything from it.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from kvpush.router.protocols import client_id_in_transfer_id

from .engine_spans import EngineSpan
from .tails import percentile

SPANS_FORMAT = 1
QUANTILES = {"p50": 0.50, "p90": 0.90, "p99": 0.99}
# vLLM's id for a request whose X-Request-Id is a dispatch's id: completions `cmpl-<id>-<prompt index>`,
# chat `chatcmpl-<id>`; the dispatch's id is `<client id>-<32 hex>`.
_DISPATCH = re.compile(r"(?:cmpl-(?P<completion>.+)-[0-9a-f]{32}-\d+|chatcmpl-(?P<chat>.+)-[0-9a-f]{32})")


def client_request_id(vllm_request_id: str) -> str | None:
    """The client's X-Request-Id inside vLLM's request id of one leg; None for a request no client named
    (warm-up, `up`'s proof) or one that did not come through the router's two legs."""
    match = _DISPATCH.fullmatch(vllm_request_id)
    if match is None:
        return None
    return match.group("completion") or match.group("chat")


@dataclass(frozen=True)
class HandoffSample:
    request_id: str  # the client's
    answer_to_first_ms: float  # P first token -> D first token
    compute_to_first_ms: float  # P compute start -> D first token
    prefill_ms: float  # P's time in prefill (engine)


@dataclass(frozen=True)
class HandoffSamples:
    """The requests of one load level (or of several, pooled) that the client completed, and those of
    them with both spans joined."""

    requests: int
    samples: list[HandoffSample] = field(default_factory=list)

    @property
    def joined(self) -> int:
        return len(self.samples)

    @classmethod
    def of(cls, kept: dict) -> HandoffSamples:
        """From a kept spans document (see `spans_document`)."""
        wanted = [r for r in kept.get("requests", []) if isinstance(r, str)]
        spans = [s for s in (EngineSpan.of(r) for r in kept.get("spans", [])) if s is not None]
        return join(spans, wanted)


def join(spans: list[EngineSpan], requests: list[str]) -> HandoffSamples:
    """Pair each completed request's prefill and decode spans. A retried request has one dispatch per
    try; the one whose decode produced a first token last is the one that answered the client."""
    by_dispatch: dict[str, dict[str, EngineSpan]] = {}
    for span in spans:
        by_dispatch.setdefault(span.request_id, {})[span.role] = span
    wanted = {client_id_in_transfer_id(r): r for r in requests}
    best: dict[str, tuple[EngineSpan, EngineSpan]] = {}
    for dispatch, roles in by_dispatch.items():
        client = client_request_id(dispatch)
        p, d = roles.get("prefill"), roles.get("decode")
        if client not in wanted or p is None or d is None:
            continue
        client = wanted[client]
        if client not in best or d.first_token_s > best[client][1].first_token_s:
            best[client] = (p, d)
    samples = [HandoffSample(client, (d.first_token_s - p.first_token_s) * 1000,
                             (d.first_token_s - p.compute_start_s) * 1000, p.prefill_s * 1000)
               for client, (p, d) in sorted(best.items())]
    return HandoffSamples(len(wanted), samples)


def missing(spans: list[EngineSpan], requests: list[str]) -> int:
    """How many of the requests still lack a prefill or a decode span."""
    return len(set(requests)) - join(spans, requests).joined


def pooled(parts: list[HandoffSamples]) -> HandoffSamples:
    return HandoffSamples(sum(p.requests for p in parts), [s for p in parts for s in p.samples])


@dataclass(frozen=True)
class HandoffSummary:
    """Milliseconds, by quantile name (p50, p90, p99); None where no request was joined."""

    requests: int  # completed by the client
    joined: int  # of those, with both spans
    answer_to_first: dict[str, float | None]
    compute_to_first: dict[str, float | None]
    prefill: dict[str, float | None]


def summarize(samples: HandoffSamples) -> HandoffSummary:
    def quantiles(values: list[float]) -> dict[str, float | None]:
        return {name: percentile(values, q) if values else None for name, q in QUANTILES.items()}

    s = samples.samples
    return HandoffSummary(samples.requests, samples.joined, quantiles([x.answer_to_first_ms for x in s]),
                          quantiles([x.compute_to_first_ms for x in s]), quantiles([x.prefill_ms for x in s]))


def spans_document(prefix: str, requests: list[str], records: list[dict]) -> dict:
    """What the bench keeps of one load level: enough to recompute its diagnostic."""
    return {"kvpush_engine_spans": SPANS_FORMAT, "request_id_prefix": prefix, "requests": requests, "spans": records}
