"""benchmarks/handoff_timeline.py: joining the connector's DEBUG stamps and the figures derived from them."""
from __future__ import annotations

import pytest
from benchmark_scripts import load_benchmark

pytestmark = pytest.mark.unit

ht = load_benchmark("handoff_timeline")

TID = "78b1b6d8f28243709725bab05af26253"
LOG = [
    f"(Worker pid=1) DEBUG 11-29 19:47:58 [producer.py:144] kvpush P offer {TID} req=cmpl-1 blocks=24 t=100.000000 matched=True",
    f"(Worker pid=1) DEBUG 11-29 19:47:58 [producer.py:223] kvpush P post {TID} bytes=1 descs=32 ahead=False wait=1.0 t=100.000500",
    f"(Worker pid=1) DEBUG 11-29 19:47:58 [producer.py:259] kvpush P done {TID} ok=True bytes=1 prefill_end_to_done=0.05 t=100.050000",
    f"(Worker pid=2) DEBUG 11-29 19:47:58 [consumer.py:161] kvpush D accepted {TID} t=90.000000",
    f"(Worker pid=2) DEBUG 11-29 19:47:58 [consumer.py:173] kvpush D outcome {TID} req=cmpl-2 ok=True bytes=1 since_register=2.0 t=100.051000",
    "kvpush D outcome ffffffffffffffffffffffffffffffff req=x ok=True bytes=1 since_register=2.0 t=5.0",  # another request
    "(APIServer pid=3) INFO unrelated line t=1.0",
]


def joined() -> ht.Timeline:
    timeline = ht.Timeline(0, TID, at={"P_answer": 100.065, "D_first": 100.110, "D_end": 100.460}, tokens=8)
    assert ht.join_connector_lines(LOG, {TID: timeline}) == 5
    return timeline


def test_join_takes_each_event_of_this_transfer_only():
    t = joined()
    assert t.at["P_offer"] == 100.0 and t.at["P_done"] == 100.05 and t.at["D_outcome"] == 100.051
    assert t.at["D_accepted"] == 90.0  # a line whose transfer id is directly followed by its stamp


def test_figures_are_relative_to_prefill_step_end():
    t = joined()
    assert t.since_step_end("P_done") == pytest.approx(50.0)
    assert t.handoff_ms == pytest.approx(45.0)
    assert t.decode_path_ms == pytest.approx(59.0)
    assert t.step_ms == pytest.approx(50.0)  # 350 ms for the 7 tokens after the first


def test_missing_stamps_give_no_figure_rather_than_a_wrong_one():
    t = ht.Timeline(1, TID, at={"P_answer": 1.0}, tokens=1)
    assert t.since_step_end("P_answer") is None and t.handoff_ms is None and t.step_ms is None
    assert "-" in ht.format_row(t)


def test_summary_is_the_median_over_requests_that_have_the_figure():
    a, b = joined(), joined()
    b.at["D_first"] = 100.130  # handoff 65 ms
    partial = ht.Timeline(2, "x", at={"P_answer": 1.0})
    medians = ht.summary([a, b, partial])
    assert medians["handoff"] == pytest.approx(55.0)
    assert medians["P_done since step end"] == pytest.approx(50.0)


def test_with_several_ranks_a_push_spans_from_the_first_offer_to_the_last_done():
    t = ht.Timeline(0, TID)
    ranks = [f"kvpush P offer {TID} req=a t=101.0", f"kvpush P offer {TID} req=a t=100.0",
             f"kvpush P done {TID} ok=True t=100.04", f"kvpush P done {TID} ok=True t=100.06"]
    ht.join_connector_lines(ranks, {TID: t})
    assert t.at["P_offer"] == 100.0 and t.at["P_done"] == 100.06
