"""When the router is ready for traffic: every instance it knows is in its rotation.

The router takes an instance out of rotation when a probe of it fails (also while the instance is
still loading) and takes it back only at its next probe, so every /health answering 200 does not
mean the router sends legs to every instance. Its /metrics says: the gauge below is 0 for an
instance that any of its workers holds out. An instance removed from the router's list by a reload
keeps its sample at 0 (a worker's values outlive a label there), so callers that know the planned
instances name them.
"""
from __future__ import annotations

import time
from typing import Callable, Collection

from kvpush.common.errors import KvpushError
from kvpush.common.vllm_metrics import samples
from kvpush.deploy.runners import Runner

from .secrets import AccessKeys

ROUTER_IN_ROTATION = "kvpush_router_instance_in_rotation"
POLL_S = 0.2


def out_of_rotation(router_page: str, instances: Collection[str] | None = None) -> list[str]:
    """Instances the router does not send legs to right now (of `instances`, when given)."""
    out = []
    for metric, labels, value in samples(router_page):
        name = labels.get("instance", "?")
        if metric == ROUTER_IN_ROTATION and value < 1 and (instances is None or name in instances):
            out.append(name)
    return sorted(out)


def wait_router_ready(runner: Runner, router_url: str, timeout_s: float, keys: AccessKeys = AccessKeys(),
                      clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
                      instances: Collection[str] | None = None) -> None:
    """Until the router at `router_url` (reached through `runner`) has every instance (of
    `instances`, when given) in rotation; raises KvpushError naming the instances still out after
    `timeout_s`."""
    end = clock() + timeout_s
    while True:
        response = runner.http("GET", router_url + "/metrics", timeout=15, headers=keys.headers("router"))
        left = (
            out_of_rotation(response.text(), instances)
            if response.status == 200
            else [f"(its /metrics answers HTTP {response.status})"]
        )
        if not left:
            return
        if clock() >= end:
            raise KvpushError(
                f"the router {router_url} still has {', '.join(left)} out of rotation {timeout_s:.0f} s after "
                "every process was ready; see `kvpush logs router`"
            )
        sleep(POLL_S)
