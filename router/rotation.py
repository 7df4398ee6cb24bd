"""Which instances get legs, kept up to date in the background: each instance's /health probed on
its own schedule, each instance's load scraped (for the least-loaded and prefix-aware policies),
and the instance list read again on request (SIGHUP, instances.py).

An instance enters rotation on its first 200 from /health, never before (at start, after a
reload that added it, after it was ejected). A probe without a 200 within `timeouts.health_s`
(refused, an error status, or no answer: a hung process) counts as a failure, and
`eject_after_failures` of them in a row (legs failing to connect count too) take the instance out.
Probes go out every `probe_interval_s` whether or not the previous one answered, so a process that
stops answering is out within about probe_interval_s + health_s + (eject_after_failures - 1) x
probe_interval_s: 2 s with the defaults.

On admission the router also reads the instance's /metrics: whether decode caches prefixes (several
samples share one transfer through that cache), and its server's start time, which counts a
restart when it changed.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from typing import Awaitable, Callable

from kvpush.common.vllm_metrics import prefix_caching, process_start_time

from .config import RouterConfig
from .instances import InstanceList, list_digest
from .metrics import RouterMetrics
from .pool import Instance, Pool, parse_load
from .upstream_http import UpstreamError

log = logging.getLogger("kvpush.router")

Get = Callable[[str, str, float], Awaitable[tuple[int, str]]]  # (base URL, path, timeout) -> (status, text)


class Rotation:
    def __init__(self, config: RouterConfig, prefill: Pool, decode: Pool, metrics: RouterMetrics, get: Get):
        self.config = config
        self.pools = [prefill, decode]
        self.metrics = metrics
        self._get = get
        self._probes: dict[Instance, asyncio.Task] = {}
        self._admitting: set[Instance] = set()
        self._scraper: asyncio.Task | None = None
        self.digest = list_digest([i.upstream for i in prefill.instances], [i.upstream for i in decode.instances])
        # probes of one instance in flight at once: enough to send one every interval while a
        # hung instance leaves each unanswered for health_s
        self._max_probes = max(1, math.ceil(config.timeouts.health_s / config.probe_interval_s)) + 1

    async def start(self) -> None:
        """One round of probes now, so a router started beside ready instances serves at once (one
        started beside loading ones reports 503 on /health until they are up), then the loops."""
        self.metrics.instance_list.labels(self.digest).set(1)
        everyone = [(pool, inst) for pool in self.pools for inst in pool.instances]
        await asyncio.gather(*(self._probe(pool, inst) for pool, inst in everyone))
        for pool, inst in everyone:
            self._watch(pool, inst)
        if self.config.policy != "round-robin":
            self._scraper = asyncio.create_task(self._scrape_loop())

    async def stop(self) -> None:
        tasks = list(self._probes.values()) + ([self._scraper] if self._scraper is not None else [])
        self._probes.clear()
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    # --- health ----------------------------------------------------------------------------

    def _watch(self, pool: Pool, inst: Instance, probe_now: bool = False) -> None:
        self._probes[inst] = asyncio.create_task(self._probe_loop(pool, inst, probe_now))

    async def _probe_loop(self, pool: Pool, inst: Instance, probe_now: bool) -> None:
        in_flight: set[asyncio.Task] = set()
        try:
            while True:
                if not probe_now:
                    await asyncio.sleep(self.config.probe_interval_s)
                probe_now = False
                if len(in_flight) < self._max_probes:
                    task = asyncio.create_task(self._probe(pool, inst))
                    in_flight.add(task)
                    task.add_done_callback(in_flight.discard)
        finally:
            for task in in_flight:
                task.cancel()

    async def _probe(self, pool: Pool, inst: Instance) -> None:
        try:
            status, _ = await self._get(inst.upstream.url, "/health", self.config.timeouts.health_s)
        except asyncio.TimeoutError:
            status = None
        except UpstreamError:
            status = None
        if inst.removed:
            return
        if status != 200:
            if inst.in_rotation:
                pool.failed(inst, "health")
            return
        if inst.in_rotation:
            pool.succeeded(inst)
        elif inst not in self._admitting:
            self._admitting.add(inst)
            try:
                await self._learn(pool, inst)
                pool.restore(inst)
            finally:
                self._admitting.discard(inst)

    async def _learn(self, pool: Pool, inst: Instance) -> None:
        """What an instance joining rotation says about itself on its /metrics (unknown stays unknown)."""
        try:
            status, text = await self._get(inst.upstream.url, "/metrics", self.config.timeouts.connect_s)
        except (UpstreamError, asyncio.TimeoutError):
            return
        if status != 200:
            return
        if pool.role == "decode":
            inst.prefix_caching = prefix_caching(text)
        pool.observe_start_time(inst, process_start_time(text))

    # --- load --------------------------------------------------------------------------------

    async def _scrape_loop(self) -> None:
        """Each instance's own load, for the policies that weigh it; never on the request path."""
        timeout = min(self.config.metrics_refresh_s, self.config.timeouts.connect_s) or 1.0

        async def scrape(pool: Pool, inst: Instance) -> None:
            try:
                status, text = await self._get(inst.upstream.url, "/metrics", timeout)
            except (UpstreamError, asyncio.TimeoutError):
                pool.observe_load(inst, None)
                return
            pool.observe_load(inst, parse_load(text) if status == 200 else None)

        while True:
            await asyncio.gather(*(scrape(p, i) for p in self.pools for i in p.instances if i.in_rotation))
            await asyncio.sleep(self.config.metrics_refresh_s)

    # --- the instance list -------------------------------------------------------------------

    def take(self, listed: InstanceList, path: str, digest: str) -> None:
        """Take the list read again from instances_file (reload.py; `digest` is the list's, worked
        out off the event loop): removed instances leave rotation and drain, added ones are probed
        and enter on their first healthy answer."""
        if self.config.protocol == "colocated" and listed.prefill:
            log.error("router instances file %s: lists prefill instances, but the protocol is colocated; "
                      "still serving the instance list it had", path)
            return
        if digest == self.digest:
            log.info("instance list %s read again: unchanged", path)
            return
        changes = []
        for pool, upstreams in zip(self.pools, (listed.prefill, listed.decode)):
            added, removed = pool.replace(upstreams)
            for inst in removed:
                task = self._probes.pop(inst, None)
                if task is not None:
                    task.cancel()
            for inst in added:
                self._watch(pool, inst, probe_now=True)
            changes += [f"+{i.name}" for i in added] + [f"-{i.name}" for i in removed]
        self.metrics.instance_list.labels(self.digest).set(0)
        self.metrics.instance_list.labels(digest).set(1)
        self.digest = digest
        log.warning("instance list %s taken (%s): %s", path, digest, " ".join(changes) or "same instances")
