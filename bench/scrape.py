"""What the bench reads from /metrics pages (pure parsing; fetching lives in runner.py).

Router: the handoff gap histogram (prefill's answer to decode's first token), retries, leg
failures and request outcomes. Instances: prompt tokens by source (received by KV transfer vs
computed locally), connector byte counters, failed transfers, and the engine's own time per
request (queued, and from first scheduled to first token). Every figure is a difference
between a scrape before and one after a load level.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from kvpush.common.vllm_metrics import PROMPT_TOKENS_BY_SOURCE, metric_sum, samples

HANDOFF_GAP = "kvpush_router_handoff_gap_seconds"
ROUTER_RETRIES = "kvpush_router_retries_total"
ROUTER_LEG_FAILURES = "kvpush_router_leg_failures_total"
ROUTER_REQUESTS = "kvpush_router_requests_total"
EXTERNAL_SOURCE = "external_kv_transfer"
LOCAL_SOURCES = ("local_compute",)
CACHED_SOURCES = ("local_cache_hit",)
ENGINE_PREFILL_TIME = "vllm:request_prefill_time_seconds"  # first scheduled -> first token
ENGINE_QUEUE_TIME = "vllm:request_queue_time_seconds"  # arrived at the engine -> first scheduled
FAILED_TRANSFERS = ("vllm:nixl_num_failed_transfers_total", "vllm:kvpush_failed_transfers_total")
# Bytes a connector reports moving; the first group of each name is summed.
BYTES_PREFIXES = ("vllm:nixl_", "vllm:kvpush_")
_BYTES_METRIC = re.compile(r"^(vllm:(?:nixl|kvpush)_\w*bytes\w*?)(_sum|_total)$")



@dataclass(frozen=True)
class Histogram:
    """Cumulative bucket counts by upper bound (inf last), summed over label sets."""

    buckets: tuple[tuple[float, float], ...]
    count: float
    total: float

    def minus(self, before: Histogram) -> Histogram:
        prior = dict(before.buckets)
        return Histogram(tuple((le, c - prior.get(le, 0.0)) for le, c in self.buckets),
                         self.count - before.count, self.total - before.total)

    def quantile(self, q: float) -> float | None:
        """Prometheus-style estimate: linear inside the bucket that holds the q-th observation."""
        if self.count <= 0 or not self.buckets:
            return None
        rank = q * self.count
        lower_bound, lower_count = 0.0, 0.0
        for le, cumulative in self.buckets:
            if cumulative >= rank:
                if le == float("inf"):
                    return lower_bound  # beyond the last finite bound: the best we know
                span = cumulative - lower_count
                fraction = (rank - lower_count) / span if span > 0 else 1.0
                return lower_bound + (le - lower_bound) * fraction
            lower_bound, lower_count = le, cumulative
        return lower_bound

    @property
    def mean(self) -> float | None:
        return self.total / self.count if self.count > 0 else None


def histogram(text: str, name: str) -> Histogram:
    buckets: dict[float, float] = {}
    count = total = 0.0
    for metric, labels, value in samples(text, (name,)):
        if metric == f"{name}_bucket" and "le" in labels:
            le = float(labels["le"])  # "+Inf" reads as inf
            buckets[le] = buckets.get(le, 0.0) + value
        elif metric == f"{name}_count":
            count += value
        elif metric == f"{name}_sum":
            total += value
    return Histogram(tuple(sorted(buckets.items())), count, total)


def _sum_by_label(text: str, name: str, label: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for metric, labels, value in samples(text, (name,)):
        if metric == name:
            key = labels.get(label, "")
            out[key] = out.get(key, 0.0) + value
    return out


def _delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v - before.get(k, 0.0)}


@dataclass(frozen=True)
class RouterFigures:
    handoff_gap_p50_ms: float | None
    handoff_gap_p90_ms: float | None
    handoff_gap_mean_ms: float | None
    handoff_observations: int
    retries: float
    leg_failures: float
    outcomes: dict[str, float]  # requests by outcome (success, failed, ...)


def router_figures(before: str, after: str) -> RouterFigures:
    gap = histogram(after, HANDOFF_GAP).minus(histogram(before, HANDOFF_GAP))

    def ms(value: float | None) -> float | None:
        return None if value is None else value * 1000.0

    def total(name: str) -> float:
        return (metric_sum(after, name) or 0.0) - (metric_sum(before, name) or 0.0)

    return RouterFigures(
        handoff_gap_p50_ms=ms(gap.quantile(0.5)),
        handoff_gap_p90_ms=ms(gap.quantile(0.9)),
        handoff_gap_mean_ms=ms(gap.mean),
        handoff_observations=int(gap.count),
        retries=total(ROUTER_RETRIES),
        leg_failures=total(ROUTER_LEG_FAILURES),
        outcomes=_delta(
            _sum_by_label(after, ROUTER_REQUESTS, "outcome"), _sum_by_label(before, ROUTER_REQUESTS, "outcome")
        ),
    )


@dataclass(frozen=True)
class InstanceFigures:
    """KV-transfer evidence of one instance over one load level."""

    name: str
    role: str
    prompt_tokens_external: float  # received by KV transfer
    prompt_tokens_local: float  # computed here
    prompt_tokens_cached: float  # local prefix-cache hits
    kv_bytes: dict[str, float]  # connector byte metrics that moved
    failed_transfers: float
    # the engine's own timing, as sums so that rounds pool: a mode whose prefill computes slower
    # shows here, apart from anything the router or the transfer adds
    engine_requests: float = 0.0  # requests whose prefill time the engine recorded
    engine_prefill_s: float = 0.0
    engine_queued: float = 0.0  # requests whose queue time it recorded
    engine_queue_s: float = 0.0

    @property
    def prefill_ms_per_request(self) -> float | None:
        return ms_per_request(self.engine_prefill_s, self.engine_requests)

    @property
    def queue_ms_per_request(self) -> float | None:
        return ms_per_request(self.engine_queue_s, self.engine_queued)


def ms_per_request(total_s: float, requests: float) -> float | None:
    """Mean milliseconds per request from a histogram's sum and count; None when nothing was counted."""
    return total_s / requests * 1000 if requests else None


def _bytes_metrics(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for metric, _, value in samples(text, BYTES_PREFIXES):
        m = _BYTES_METRIC.match(metric)
        if m:
            out[m.group(1)] = out.get(m.group(1), 0.0) + value
    return out


def instance_figures(name: str, role: str, before: str, after: str) -> InstanceFigures:
    by_source = _delta(_sum_by_label(after, PROMPT_TOKENS_BY_SOURCE, "source"),
                       _sum_by_label(before, PROMPT_TOKENS_BY_SOURCE, "source"))
    failed = sum((metric_sum(after, n) or 0.0) - (metric_sum(before, n) or 0.0) for n in FAILED_TRANSFERS)
    prefill_time = histogram(after, ENGINE_PREFILL_TIME).minus(histogram(before, ENGINE_PREFILL_TIME))
    queue_time = histogram(after, ENGINE_QUEUE_TIME).minus(histogram(before, ENGINE_QUEUE_TIME))
    return InstanceFigures(
        name=name, role=role,
        prompt_tokens_external=by_source.get(EXTERNAL_SOURCE, 0.0),
        prompt_tokens_local=sum(by_source.get(s, 0.0) for s in LOCAL_SOURCES),
        prompt_tokens_cached=sum(by_source.get(s, 0.0) for s in CACHED_SOURCES),
        kv_bytes=_delta(_bytes_metrics(after), _bytes_metrics(before)),
        failed_transfers=failed,
        engine_requests=prefill_time.count, engine_prefill_s=prefill_time.total,
        engine_queued=queue_time.count, engine_queue_s=queue_time.total,
    )
