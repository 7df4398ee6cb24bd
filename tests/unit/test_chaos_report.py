"""tests/chaos_report.py: the numbers and tables of a chaos run, from its JSON rows."""
from __future__ import annotations

import pytest

from chaos_report import causes_table, failure_causes, summarize, summary_table

pytestmark = pytest.mark.unit


def request(**kw) -> dict:
    row = {"topology": "2p2d", "request_id": "r", "streamed": False, "answered": True, "matches_reference": True,
           "healthy_peer": True, "latency_s": 1.0, "error": "", "faults": [], "first_token_s": None}
    return {**row, **kw}


FAULTS = [{"id": "f0001", "kind": "stop", "role": "prefill", "process": "api_server", "up_s": None},
          {"id": "f0002", "kind": "kill", "role": "decode", "process": "worker_tp1", "up_s": 31.5},
          {"id": "f0003", "kind": "kill", "role": "decode", "process": "api_server", "up_s": 22.0}]


def test_failures_count_apart_by_whether_each_role_kept_a_healthy_instance_and_wrong_answers_by_the_reference():
    rows = [request(), request(streamed=True), request(matches_reference=False),
            request(answered=False, matches_reference=None, error="HTTP 502: x", faults=["f0001"]),
            request(answered=False, matches_reference=True, healthy_peer=False, streamed=True, latency_s=31.0),
            request(answered=False, matches_reference=False, streamed=True)]
    s = summarize("2p2d", rows, FAULTS)
    assert (s["requests"], s["streamed"], s["answered"], s["answered_streamed"]) == (6, 3, 3, 1)
    assert (s["wrong"], s["failed_with_peer"], s["failed_without_peer"], s["slow"]) == (2, 2, 1, 1)
    assert (s["stops"], s["kills"], s["up_min_s"], s["up_max_s"], s["latency_max_s"]) == (1, 2, 22.0, 31.5, 31.0)


def test_a_stream_cut_after_its_first_token_while_a_decode_was_killed_counts_apart_from_failures():
    cut = request(streamed=True, answered=False, first_token_s=0.4, faults=["f0002"], error="error event: x")
    before_first_token = request(streamed=True, answered=False, faults=["f0002"], error="HTTP 502: x")
    while_prefill_stopped = request(streamed=True, answered=False, first_token_s=0.4, faults=["f0001"], error="x")
    plain = request(answered=False, faults=["f0003"], error="HTTP 502: x")
    s = summarize("2p2d", [cut, before_first_token, while_prefill_stopped, plain], FAULTS)
    assert (s["cut_by_killed_decode"], s["failed_with_peer"], s["failed_without_peer"]) == (1, 3, 0)


def test_the_summary_table_has_a_row_per_topology_and_one_for_all_under_its_header():
    table = summary_table([summarize("1p1d", [request(topology="1p1d")], []), summarize("2p2d", [request()], FAULTS)])
    lines = table.splitlines()
    assert len(lines) == 5 and lines[0].startswith("| topology |") and lines[1].startswith("| --- |")
    assert lines[2].startswith("| 1p1d | 1 (0) | 1 | 0 | 0 | 0 | 0 | 0 | 1.00 / 1.00 / 1.00 | 0 / 0 | - |")
    assert "| 1 / 2 | 22.0-31.5 |" in lines[3]
    assert lines[4].startswith("| all | 2 (0) | 2 | 0 | 0 | 0 | 0 | 0 | - / - / 1.00 | 1 / 2 | 22.0-31.5 |")


def test_failures_group_by_fault_and_what_the_client_got_without_the_ids_and_numbers_that_differ():
    rows = [request(answered=False, error="HTTP 502: transfer 0123456789abcdef0123 failed after 1.5 s", faults=["f0002"]),
            request(answered=False, error="HTTP 502: transfer fedcba98765432100000 failed after 2 s", faults=["f0002"]),
            request(matches_reference=False, faults=["f0001", "f0003"]),
            request(answered=False, error="HTTP 503: no decode", faults=[]), request()]
    causes = failure_causes(rows, FAULTS)
    assert causes[0] == (2, "2p2d", "kill decode worker_tp1", "HTTP N: transfer <id> failed after N s")
    assert (1, "2p2d", "kill decode api_server, stop prefill api_server", "wrong answer") in causes
    assert (1, "2p2d", "none", "HTTP N: no decode") in causes and len(causes) == 3
    assert causes_table(causes).count("\n") == 4
