"""Instances the router may use: selection policy, health bookkeeping, and the load each reports.

Selection never does I/O: it reads counters kept by the dispatcher (legs in flight) and by the
background scraper (the instance's own /metrics). Probing ejected instances is also background work.

Ejection is for instances that are gone, not for requests that went wrong: only failures to reach
an instance (connection refused, reset, closed mid-answer) and failed health checks count toward
it. A slow answer, a 5xx or an error event is counted per instance and reason, and the health
probe decides whether the instance itself is broken.
"""
from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass
from typing import Any

from kvpush.common.vllm_metrics import vllm_load

from .config import Policy, Upstream
from .metrics import RouterMetrics

log = logging.getLogger("kvpush.router")

EJECTING_REASONS = frozenset({"connect", "mid_stream", "ended_early", "health"})


@dataclass
class InstanceLoad:
    """What the instance's /metrics said at the last scrape."""

    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0
    own_inflight_at_scrape: int = 0  # our legs in flight when the scrape answered


@dataclass
class Instance:
    upstream: Upstream
    role: str
    inflight: int = 0
    consecutive_failures: int = 0
    in_rotation: bool = False  # admitted by its first healthy probe, never before
    load: InstanceLoad | None = None
    prefix_caching: bool | None = None  # from the instance's vllm:cache_config_info; None: not known
    inflight_gauge: Any = None  # this instance's child of kvpush_router_inflight (labels() is not free)

    @property
    def name(self) -> str:
        return self.upstream.name

    def score(self) -> float:
        """Least-loaded key: our own legs (fresh) + load from others seen at the last scrape
        (queued work the router did not send) + KV usage (0..1) as the tie-breaker."""
        if self.load is None:
            return float(self.inflight)
        foreign = max(0.0, self.load.running + self.load.waiting - self.load.own_inflight_at_scrape)
        return self.inflight + foreign + self.load.kv_usage


def parse_load(text: str) -> InstanceLoad:
    """The gauges least-loaded uses, summed over engines (DP), from an instance's /metrics text."""
    seen = vllm_load(text)
    return InstanceLoad(running=seen.running or 0.0, waiting=seen.waiting or 0.0, kv_usage=seen.kv_usage or 0.0)


class Pool:
    """The instances of one role."""

    def __init__(self, role: str, upstreams: list[Upstream], policy: Policy, eject_after: int, metrics: RouterMetrics):
        self.role = role
        self.instances = [Instance(u, role) for u in upstreams]
        self.policy = policy
        self.eject_after = eject_after
        self.metrics = metrics
        self._turn = itertools.count()
        self.leg_latency = metrics.leg_latency.labels(role)  # this role's child of kvpush_router_leg_seconds
        for inst in self.instances:
            metrics.in_rotation.labels(inst.name, role).set(0)
            inst.inflight_gauge = metrics.inflight.labels(inst.name, role)
            inst.inflight_gauge.set(0)

    def __len__(self) -> int:
        return len(self.instances)

    def available(self) -> list[Instance]:
        return [i for i in self.instances if i.in_rotation]

    def pick(self, avoid: set[str] = frozenset()) -> Instance | None:
        """An instance in rotation, preferring ones not in `avoid`; None if none is in rotation."""
        candidates = self.available()
        preferred = [i for i in candidates if i.name not in avoid] or candidates
        if not preferred:
            return None
        start = next(self._turn) % len(preferred)
        rotated = preferred[start:] + preferred[:start]
        if self.policy == "least-loaded":
            return min(rotated, key=Instance.score)  # min keeps the first of equals: round-robin ties
        return rotated[0]

    def leg_started(self, inst: Instance) -> None:
        inst.inflight += 1
        inst.inflight_gauge.set(inst.inflight)

    def leg_ended(self, inst: Instance) -> None:
        inst.inflight -= 1
        inst.inflight_gauge.set(inst.inflight)

    def succeeded(self, inst: Instance) -> None:
        inst.consecutive_failures = 0

    def failed(self, inst: Instance, reason: str) -> None:
        self.metrics.leg_failures.labels(inst.name, self.role, reason).inc()
        if reason not in EJECTING_REASONS:
            return
        inst.consecutive_failures += 1
        if inst.in_rotation and inst.consecutive_failures >= self.eject_after:
            inst.in_rotation = False
            self.metrics.in_rotation.labels(inst.name, self.role).set(0)
            log.warning("%s instance %s out of rotation after %d failures in a row (last: %s); probing its /health",
                        self.role, inst.name, inst.consecutive_failures, reason)

    def restore(self, inst: Instance) -> None:
        inst.in_rotation = True
        inst.consecutive_failures = 0
        self.metrics.in_rotation.labels(inst.name, self.role).set(1)
        log.warning("%s instance %s back in rotation (/health answered 200)", self.role, inst.name)

    def observe_load(self, inst: Instance, load: InstanceLoad | None) -> None:
        if load is not None:
            load.own_inflight_at_scrape = inst.inflight
        inst.load = load
