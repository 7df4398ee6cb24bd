"""Tail latencies and goodput of one mode at one rate, each with a 95% confidence interval (pure).

Computed from per-request results (RequestSamples), the same way for every mode, for one round or
pooled over rounds; `kvpush bench --recompute DIR` runs the same code on a bench's kept raw files.

- A percentile's interval is distribution-free: the order statistics X(l) <= X(u) with
  P(l <= B < u) >= 95%, where B ~ Binomial(n, q) counts the samples below the true q-quantile. With
  too few samples one side has no such order statistic and stays open (None): an upper bound on
  p99 needs at least 368 requests, on p90 at least 36.
- Goodput is requests per second of bench time that succeeded with TTFT <= the TTFT SLO and TPOT <=
  the TPOT SLO (a one-token answer has no TPOT and meets that SLO). Its interval is the Wilson score
  interval of the good fraction of the requests sent, times requests sent per second.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist

CONFIDENCE = 0.95
QUANTILES = {"p50": 0.50, "p90": 0.90, "p99": 0.99}
TAIL_METRICS = ("ttft", "tpot", "e2el")
DEFAULT_SLO_TTFT_MS = 1000.0  # an interactive answer starts within a second
DEFAULT_SLO_TPOT_MS = 100.0  # then streams at 10 tokens/s or faster, above reading speed


@dataclass(frozen=True)
class Slo:
    ttft_ms: float = DEFAULT_SLO_TTFT_MS
    tpot_ms: float = DEFAULT_SLO_TPOT_MS

    def problem(self) -> str | None:
        """Why these SLOs cannot be used, as the CLI option names them; None when they can."""
        for name, value in (("--slo-ttft-ms", self.ttft_ms), ("--slo-tpot-ms", self.tpot_ms)):
            if not (value > 0 and math.isfinite(value)):
                return f"{name} must be a positive number of milliseconds (got {value:g})"
        return None


@dataclass(frozen=True)
class Estimate:
    """A figure and its confidence interval (None: that side is not bounded by the samples at hand)."""

    value: float | None
    low: float | None
    high: float | None


@dataclass(frozen=True)
class Tails:
    sent: int  # requests sent, failed included
    completed: int
    duration_s: float  # bench time the requests took (summed over pooled rounds)
    throughput: float  # completed requests per second
    latency: dict[str, dict[str, Estimate]]  # ttft | tpot | e2el -> p50 | p90 | p99 -> ms
    slo: Slo
    good: int  # requests that met both SLOs
    goodput: Estimate  # good requests per second
    good_fraction: Estimate  # good / sent
    confidence: float = CONFIDENCE


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between the nearest ranks, as numpy's default (and so `vllm bench serve`) does."""
    ordered = sorted(values)
    position = (len(ordered) - 1) * q
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def _binomial_cdf(n: int, q: float) -> list[float]:
    """P(B <= k) for k = 0..n, B ~ Binomial(n, q), 0 < q < 1."""
    log_q, log_rest = math.log(q), math.log1p(-q)
    cdf, total = [], 0.0
    for k in range(n + 1):
        total += math.exp(
            math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1) + k * log_q + (n - k) * log_rest
        )
        cdf.append(min(total, 1.0))
    return cdf


def order_statistic_ranks(n: int, q: float, confidence: float = CONFIDENCE) -> tuple[int | None, int | None]:
    """1-based ranks (l, u) of the order statistics bounding the q-quantile with at least `confidence`,
    each side taking at most half the miss; None for a side that n samples cannot bound."""
    if n < 1:
        return None, None
    tail = (1 - confidence) / 2
    cdf = _binomial_cdf(n, q)
    # X(l) <= quantile unless B < l: P(B <= l - 1) = cdf[l - 1] must stay within the tail
    low = max((rank for rank in range(1, n + 1) if cdf[rank - 1] <= tail), default=None)
    # X(u) >= quantile unless B >= u: 1 - cdf[u - 1] must stay within the tail
    high = min((rank for rank in range(1, n + 1) if 1 - cdf[rank - 1] <= tail), default=None)
    return low, high


def percentile_estimate(values: list[float], q: float, confidence: float = CONFIDENCE) -> Estimate:
    if not values:
        return Estimate(None, None, None)
    ordered = sorted(values)
    low, high = order_statistic_ranks(len(ordered), q, confidence)
    return Estimate(percentile(ordered, q), None if low is None else ordered[low - 1],
                    None if high is None else ordered[high - 1])


def wilson_interval(successes: int, trials: int, confidence: float = CONFIDENCE) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion (sensible also at 0 or all successes)."""
    if trials < 1:
        return 0.0, 1.0
    z = NormalDist().inv_cdf(1 - (1 - confidence) / 2)
    p = successes / trials
    centre = (p + z * z / (2 * trials)) / (1 + z * z / trials)
    half = z / (1 + z * z / trials) * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials))
    # the interval holds p by construction; rounding must not put p outside it (at p = 1 it did)
    return max(0.0, min(p, centre - half)), min(1.0, max(p, centre + half))


def is_good(ttft_ms: float, tpot_ms: float | None, slo: Slo) -> bool:
    return ttft_ms <= slo.ttft_ms and (tpot_ms is None or tpot_ms <= slo.tpot_ms)


def summarize(ttft: list[float], request_tpot: list[float | None], e2el: list[float], sent: int, duration_s: float,
              slo: Slo, confidence: float = CONFIDENCE) -> Tails:
    """Tails of the requests that succeeded (ttft, request_tpot, e2el aligned per request) out of `sent`."""
    tpot = [v for v in request_tpot if v is not None]
    latency = {metric: {name: percentile_estimate(values, q, confidence) for name, q in QUANTILES.items()}
               for metric, values in (("ttft", ttft), ("tpot", tpot), ("e2el", e2el))}
    good = sum(is_good(first, per_token, slo) for first, per_token in zip(ttft, request_tpot))
    sent = max(sent, len(ttft))
    low, high = wilson_interval(good, sent, confidence)
    fraction = Estimate(good / sent if sent else None, low if sent else None, high if sent else None)
    per_s = sent / duration_s if duration_s > 0 else None
    goodput = (Estimate(good / duration_s, low * per_s, high * per_s) if per_s is not None
               else Estimate(None, None, None))
    return Tails(sent=sent, completed=len(ttft), duration_s=duration_s,
                 throughput=len(ttft) / duration_s if duration_s > 0 else 0.0, latency=latency, slo=slo, good=good,
                 goodput=goodput, good_fraction=fraction, confidence=confidence)
