"""What the router tells about prompts decode computed itself: the counters, and for a fallback a
log line per cause (not one per request: a deployment without prefill falls back on every request).
"""
from __future__ import annotations

import logging
import time
from typing import Callable

from .fanout import FALLBACKS, NO_PREFILL, TRANSFERS_FAILED
from .metrics import RouterMetrics

log = logging.getLogger("kvpush.router")

REPEAT_AFTER_S = 60.0  # a cause still going on is logged again after this long, with its count since

_CAUSES = {
    NO_PREFILL: "no prefill instance is in rotation",
    TRANSFERS_FAILED: "every pair in rotation that could take the push failed it",
}


class DecodeComputed:
    def __init__(self, metrics: RouterMetrics, clock: Callable[[], float] = time.monotonic):
        self.metrics = metrics
        self._clock = clock
        self._logged_at: dict[str, float] = {}
        self._since: dict[str, int] = {}  # fallbacks of a cause not logged yet

    def served(self, reason: str, detail: str = "") -> None:
        """Decode computed a prompt itself for `reason` and answered (fanout's reasons)."""
        if reason not in FALLBACKS:
            self.metrics.decode_computed_prompts.labels(reason).inc()
            return
        self.metrics.fallbacks.labels(reason).inc()
        now = self._clock()
        self._since[reason] = self._since.get(reason, 0) + 1
        last = self._logged_at.get(reason)
        if last is not None and now - last < REPEAT_AFTER_S:
            return
        count, self._since[reason] = self._since[reason], 0
        self._logged_at[reason] = now
        also = f" ({count} prompt(s) since the last line)" if last is not None else ""
        log.warning("decode computes prompts itself (fallback %s): %s%s%s; logged again in %g s while it goes on",
                    reason, _CAUSES.get(reason, reason), f"; {detail}" if detail else "", also, REPEAT_AFTER_S)
