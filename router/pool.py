"""Instances the router may use: selection policy, health bookkeeping, and the load each reports.

Selection never does I/O: it reads counters kept by the dispatcher (legs in flight), by the
background scraper (the instance's own /metrics) and, under the prefix-aware policy, the record of
which prompts went where (prefix_policy.py). Probing each instance's /health is background work
(rotation.py).

Ejection is for instances that are gone or hung, not for requests that went wrong: only failures
to reach an instance (connection refused, reset, closed mid-answer) and failed health checks (no
200 within the health bound) count toward it. A slow answer, a 5xx or an error event is counted
per instance and reason, and the health probe decides whether the instance itself is broken. An
ejected instance's legs still waiting for its first answer fail at once (LeftRotation), so their
attempts are retried elsewhere instead of waiting out their own timeouts.

The instance list can change while the router runs (instances.py): a removed instance leaves
rotation at once and drains (its legs, and transfers from it, finish); an added one enters
rotation on its first healthy probe, like every instance at start.
"""
from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field
from typing import AbstractSet, Any

from kvpush.common.vllm_metrics import vllm_load

from .config import Policy, PrefixAwareSettings, Upstream
from .metrics import RouterMetrics
from .prefix_policy import PrefixAware, new_salt
from .prompt_blocks import PromptBlocks, prompt_blocks

log = logging.getLogger("kvpush.router")

EJECTING_REASONS = frozenset({"connect", "mid_stream", "ended_early", "health"})
RESTART_TOLERANCE_S = 0.5  # a process start time read twice may differ by rounding, never by this


class LeftRotation(Exception):
    """What a leg still waiting for its instance's first answer fails with when that instance
    leaves rotation (it stopped answering or cannot be reached)."""


@dataclass
class InstanceLoad:
    """What the instance's /metrics said at the last scrape."""

    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0
    own_inflight_at_scrape: int = 0  # our legs in flight when the scrape answered


@dataclass(eq=False)
class Instance:
    upstream: Upstream
    role: str
    inflight: int = 0  # legs
    transfers: int = 0  # attempts taking the prompt's KV from this (prefill) instance, until decode's head
    consecutive_failures: int = 0
    in_rotation: bool = False  # admitted by its first healthy probe, never before
    removed: bool = False  # gone from the instance list: never in rotation again, drains
    load: InstanceLoad | None = None
    prefix_caching: bool | None = None  # from the instance's vllm:cache_config_info; None: not known
    start_time: float | None = None  # its server process's, from /metrics at admission
    restarts: int = 0  # start times seen to change
    inflight_gauge: Any = None  # this instance's child of kvpush_router_inflight (labels() is not free)
    waiting: set = field(default_factory=set)  # answers (UpstreamResponse) of legs before their first answer
    prefix_salt: int = field(default_factory=new_salt)  # its key in the prefix record; a new one forgets it

    @property
    def name(self) -> str:
        return self.upstream.name

    @property
    def busy(self) -> int:
        return self.inflight + self.transfers

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

    def __init__(self, role: str, upstreams: list[Upstream], policy: Policy, eject_after: int, metrics: RouterMetrics,
                 prefix: PrefixAwareSettings | None = None):
        self.role = role
        self.policy = policy
        self.prefix_settings = prefix or PrefixAwareSettings()
        self.prefixes = (PrefixAware(self.prefix_settings.prefix_weight, self.prefix_settings.load_weight,
                                     self.prefix_settings.record_blocks) if policy == "prefix-aware" else None)
        self._record_gauge = metrics.prefix_record.labels(role)
        self.eject_after = eject_after
        self.metrics = metrics
        self._turn = itertools.count()
        self.leg_latency = metrics.leg_latency.labels(role)  # this role's child of kvpush_router_leg_seconds
        self.instances = [self._new(u) for u in upstreams]  # the listed ones
        self.draining: list[Instance] = []  # removed from the list, still busy

    def _new(self, upstream: Upstream) -> Instance:
        inst = Instance(upstream, self.role)
        self.metrics.in_rotation.labels(inst.name, self.role).set(0)
        inst.inflight_gauge = self.metrics.inflight.labels(inst.name, self.role)
        inst.inflight_gauge.set(0)
        return inst

    def __len__(self) -> int:
        return len(self.instances)

    def available(self) -> list[Instance]:
        return [i for i in self.instances if i.in_rotation]

    def prompt_of(self, body: dict, chat: bool) -> PromptBlocks | None:
        """A part's prompt as the prefix-aware policy reads it; None under another policy."""
        if self.prefixes is None:
            return None
        s = self.prefix_settings
        return prompt_blocks(body, chat, s.block_tokens, s.block_chars)

    def pick(self, avoid: AbstractSet[str] = frozenset(), strict: bool = False,
             prompt: PromptBlocks | None = None) -> Instance | None:
        """An instance in rotation, preferring ones not in `avoid` (strict: only those); None if
        there is none. Under the prefix-aware policy, the best for `prompt` among them."""
        candidates = self.available()
        preferred = [i for i in candidates if i.name not in avoid]
        if not preferred and not strict:
            preferred = candidates
        if not preferred:
            return None
        start = next(self._turn) % len(preferred)
        rotated = preferred[start:] + preferred[:start]
        if self.prefixes is not None:
            return self.prefixes.choose(rotated, prompt)
        if self.policy == "least-loaded":
            return min(rotated, key=Instance.score)  # min keeps the first of equals: round-robin ties
        return rotated[0]

    def sent(self, inst: Instance, prompt: PromptBlocks | None) -> None:
        """An attempt sends `prompt` to `inst`: what it held before is counted, then it holds it."""
        if self.prefixes is None or prompt is None:
            return
        held = self.prefixes.held(inst, prompt)
        self.metrics.prefix_hit.labels(self.role, prompt.unit).observe(held)
        if self.role == "decode":
            self.metrics.prompt_length.labels(prompt.unit).inc(prompt.length)
            self.metrics.prompt_to_move.labels(prompt.unit).inc(prompt.length - held)
        self.prefixes.sent(inst, prompt)
        self._record_gauge.set(len(self.prefixes.record))

    def forget(self, inst: Instance) -> None:
        """The prefix record no longer says `inst` holds anything (its cache is gone or unknown)."""
        inst.prefix_salt = new_salt()

    # --- the instance list -----------------------------------------------------------------

    def replace(self, upstreams: list[Upstream]) -> tuple[list[Instance], list[Instance]]:
        """Make `upstreams` the listed instances: one listed before, unchanged, keeps its state; a
        new one (or a changed one: same name, other address or identity) waits for its first
        healthy probe; one no longer listed leaves rotation and drains. Returns (added, removed)."""
        old = {i.name: i for i in self.instances}
        listed, added = [], []
        for upstream in upstreams:
            inst = old.get(upstream.name)
            if inst is not None and inst.upstream == upstream:
                del old[upstream.name]
            else:
                inst = self._new(upstream)
                added.append(inst)
            listed.append(inst)
        self.instances = listed
        removed = list(old.values())
        names = {i.name for i in listed}
        for inst in removed:
            self._remove(inst, inst.name in names)
        return added, removed

    def _remove(self, inst: Instance, replaced: bool) -> None:
        inst.removed = True
        inst.in_rotation = False
        if not replaced:  # a changed instance's new self keeps its labels
            self.metrics.in_rotation.labels(inst.name, self.role).set(0)
        if inst.busy:
            self.draining.append(inst)
            log.warning("%s instance %s removed from the instance list: out of rotation, draining %d leg(s) and "
                        "transfer(s)", self.role, inst.name, inst.busy)
        else:
            log.warning("%s instance %s removed from the instance list (nothing in flight)", self.role, inst.name)
        self.metrics.draining.labels(inst.name, self.role).set(inst.busy)

    def _drain_step(self, inst: Instance) -> None:
        self.metrics.draining.labels(inst.name, self.role).set(inst.busy)
        if not inst.busy and inst in self.draining:
            self.draining.remove(inst)
            log.warning("%s instance %s drained", self.role, inst.name)

    # --- what legs and transfers tell -------------------------------------------------------

    def leg_started(self, inst: Instance) -> None:
        inst.inflight += 1
        inst.inflight_gauge.set(inst.inflight)

    def leg_ended(self, inst: Instance) -> None:
        inst.inflight -= 1
        inst.inflight_gauge.set(inst.inflight)
        if inst.removed:
            self._drain_step(inst)

    def transfer_started(self, inst: Instance) -> None:
        inst.transfers += 1

    def transfer_ended(self, inst: Instance) -> None:
        inst.transfers -= 1
        if inst.removed:
            self._drain_step(inst)

    def succeeded(self, inst: Instance) -> None:
        inst.consecutive_failures = 0

    def failed(self, inst: Instance, reason: str) -> None:
        self.metrics.leg_failures.labels(inst.name, self.role, reason).inc()
        if reason not in EJECTING_REASONS:
            return
        inst.consecutive_failures += 1
        if inst.in_rotation and inst.consecutive_failures >= self.eject_after:
            self.eject(inst, f"{inst.consecutive_failures} failures in a row (last: {reason})")

    def eject(self, inst: Instance, why: str) -> None:
        """Out of rotation until /health answers 200 again; legs still waiting for its first answer
        fail now (their attempts are retried elsewhere)."""
        inst.in_rotation = False
        self.forget(inst)  # it may come back restarted, with an empty cache
        self.metrics.in_rotation.labels(inst.name, self.role).set(0)
        log.warning("%s instance %s out of rotation after %s; probing its /health", self.role, inst.name, why)
        waiting, inst.waiting = inst.waiting, set()
        for resp in waiting:
            resp.fail(LeftRotation(f"{self.role} instance {inst.name} left rotation ({why})"))

    def restore(self, inst: Instance) -> None:
        if inst.removed:
            return
        inst.in_rotation = True
        inst.consecutive_failures = 0
        self.metrics.in_rotation.labels(inst.name, self.role).set(1)
        log.info("%s instance %s in rotation (/health answered 200)", self.role, inst.name)

    def observe_start_time(self, inst: Instance, start_time: float | None) -> None:
        """A changed start time of the instance's server is a restart (by its supervisor, by `up`,
        by hand) that the router may not have seen otherwise."""
        if start_time is None:
            return
        if inst.start_time is not None and abs(start_time - inst.start_time) > RESTART_TOLERANCE_S:
            inst.restarts += 1
            self.forget(inst)
            self.metrics.restarts.labels(inst.name, self.role).set(inst.restarts)
            log.warning("%s instance %s was restarted (%d restart(s) seen)", self.role, inst.name, inst.restarts)
        inst.start_time = start_time

    def observe_load(self, inst: Instance, load: InstanceLoad | None) -> None:
        if load is not None:
            load.own_inflight_at_scrape = inst.inflight
        inst.load = load
