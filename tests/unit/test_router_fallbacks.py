"""router/fallbacks.py: each prompt decode computed itself is counted by reason; a fallback's
cause is logged once, and again only while it goes on past REPEAT_AFTER_S, with its count."""
from __future__ import annotations

import logging

from prometheus_client import generate_latest

from kvpush.router.fallbacks import REPEAT_AFTER_S, DecodeComputed
from kvpush.router.metrics import RouterMetrics
from router_helpers import sample


def test_fallbacks_are_counted_by_reason_and_each_cause_is_logged_once_until_it_goes_on_past_the_repeat(caplog):
    now = [100.0]
    metrics = RouterMetrics()
    told = DecodeComputed(metrics, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="kvpush.router"):
        for _ in range(5):
            told.served("no_prefill_in_rotation", "prefill instances listed: p0")
        told.served("transfers_failed", "last failure: decode leg on instance d0 failed: KV")
        told.served("transfers_failed")
        told.served("prompt_logprobs")  # by design: counted, never logged
        now[0] += REPEAT_AFTER_S
        told.served("no_prefill_in_rotation")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3
    assert "fallback no_prefill_in_rotation" in lines[0] and "no prefill instance is in rotation" in lines[0]
    assert "fallback transfers_failed" in lines[1] and "decode leg on instance d0" in lines[1]
    assert "fallback no_prefill_in_rotation" in lines[2] and "5 prompt(s) since the last line" in lines[2]
    m = generate_latest(metrics.registry).decode()
    assert sample(m, "kvpush_router_fallbacks_total", reason="no_prefill_in_rotation") == 6
    assert sample(m, "kvpush_router_fallbacks_total", reason="transfers_failed") == 2
    assert sample(m, "kvpush_router_decode_computed_prompts_total", reason="prompt_logprobs") == 1
    assert sample(m, "kvpush_router_decode_computed_prompts_total", reason="no_prefill_in_rotation") == 0
