"""Admission's decisions without sockets: which HELLOs pair with this prefill rank, and how often a
flood of refusals reaches the log."""
from __future__ import annotations

import logging
from collections import Counter
from types import SimpleNamespace

from kvpush.connector import admission, wire
from kvpush.connector.admission import Admission, ThrottledWarnings
from kvpush.connector.producer import ProducerConfig
from kvpush.connector.regions import HeadLayout, LayoutIdentity, Region
from kvpush.connector.sharding import HeadSharding

IDENTITY = LayoutIdentity("m", "bfloat16", 16, ("l0",), 4)
HEAD_BYTES = 1024  # 4 KV heads of 1 KiB per block in all


def gate(tp_rank=0, tp_size=1):
    heads_here = 4 // tp_size
    region = Region(1 << 20, HEAD_BYTES * heads_here, HEAD_BYTES * heads_here, 64)
    config = ProducerConfig("P", IDENTITY, frozenset({"D"}), "127.0.0.1", 0, tp_rank=tp_rank,
                            sharding=HeadSharding(4, tp_size),
                            head_layouts=(HeadLayout(heads_here, HEAD_BYTES, (0,)),))
    engine = SimpleNamespace(regions=(region,), device_id=0)
    return Admission(config, engine, Counter(), lambda kind: None, ThrottledWarnings(), lambda conn, why: None)


def hello(engine="D", rank=0, tp_size=1, identity=IDENTITY):
    """A decode rank's HELLO and LAYOUT, as `check` takes them."""
    heads = 4 // tp_size
    region = Region(2 << 20, HEAD_BYTES * heads, HEAD_BYTES * heads, 64)
    return wire.Hello(engine, rank, tp_size), wire.Layout("agent", b"meta", identity, (region,),
                                                         (HeadLayout(heads, HEAD_BYTES, (0,)),))


def test_an_engine_outside_the_allow_list_is_refused_by_name():
    reason, plan = gate().check(*hello(engine="stranger"))
    assert plan is None and "'stranger' is not in this prefill's allowed_engines ['D']" in reason


def test_a_different_model_layout_is_refused_naming_the_difference():
    other = LayoutIdentity("m", "float16", 16, ("l0",), 4)
    reason, plan = gate().check(*hello(identity=other))
    assert plan is None and "differs" in reason and "float16" in reason


def test_a_decode_rank_that_takes_no_heads_from_this_rank_is_refused():
    # prefill TP 2 rank 1 holds heads 2-3; decode TP 2 rank 0 holds heads 0-1
    reason, plan = gate(tp_rank=1, tp_size=2).check(*hello(rank=0, tp_size=2))
    assert plan is None and "takes no KV heads from prefill rank 1" in reason


def test_prefill_tp2_writes_its_half_of_the_heads_into_a_tp1_decode_block():
    reason, plan = gate(tp_rank=1, tp_size=2).check(*hello(rank=0, tp_size=1))
    assert reason is None
    (segment,) = plan.segments
    assert segment.block_len == 2 * HEAD_BYTES
    assert segment.remote_base == (2 << 20) + 2 * HEAD_BYTES  # heads 2-3 of decode's block
    assert segment.local_base == 1 << 20


def test_a_flood_of_refusals_is_logged_once_per_kind(caplog, monkeypatch):
    now = [100.0]
    monkeypatch.setattr(admission.time, "monotonic", lambda: now[0])
    warnings = ThrottledWarnings()
    with caplog.at_level(logging.WARNING, logger=admission.__name__):
        for _ in range(50):
            warnings.warn("failed_auth", "peer %s failed", "x")
        warnings.warn("malformed", "bad frame")
        now[0] += admission.WARN_EVERY_S
        warnings.warn("failed_auth", "peer %s failed", "y")
    assert [r.getMessage().split(" (")[0] for r in caplog.records] == ["peer x failed", "bad frame", "peer y failed"]
