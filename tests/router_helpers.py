"""What the router's unit tests share: running a coroutine with a bound, and reading the router's
/metrics page with the project's own Prometheus sample parser."""
from __future__ import annotations

import asyncio

from kvpush.common.vllm_metrics import metric_sum


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def sample(metrics: str, name: str, **labels: str) -> float:
    """Sum of the samples of `name` having `labels` in a Prometheus text page (0 if none)."""
    return metric_sum(metrics, name, **labels) or 0.0
