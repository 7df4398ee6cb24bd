"""tests/chaos_logs.py: the log lines that name a request, and decode's failed transfers for silence."""
from __future__ import annotations

import gzip

import pytest

from chaos_logs import evidence, keep_log, silence_failures, transfer_failures

pytestmark = pytest.mark.unit

DECODE_LOG = """INFO cmpl-chaos1-2p2d-000007-0a1b-0 added
WARNING kvpush: 3 transfer(s) from chaos-2p2d.prefill-1 failed: side channel to prefill prefill-1 lost (no answer on the side channel for 1 s; prefill is dead or hung)
WARNING kvpush: transfer t1 (request cmpl-chaos1-2p2d-000012-ff-0) failed: no KV within 30 s
WARNING kvpush: 1 transfer(s) from chaos-2p2d.prefill-0 failed: side channel to prefill prefill-0 rank 0: no answer for 1 s; prefill is dead or hung
WARNING kvpush: 2 transfer(s) from chaos-2p2d.prefill-0 failed: side channel to prefill prefill-0 rank 0 lost (connection error: [Errno 104] Connection reset by peer)
"""


def test_evidence_finds_each_request_in_plain_and_kept_logs_and_only_those_asked_for(tmp_path):
    (tmp_path / "decode-0.log").write_text(DECODE_LOG)
    kept = keep_log(tmp_path / "decode-0.log", tmp_path / "kept", "decode-0.f0001.log")
    assert keep_log(tmp_path / "absent.log", tmp_path / "kept", "x") is None
    (tmp_path / "router.log").write_text("retrying /v1/completions (attempt 2) chaos1-2p2d-000012-abc: KV load failed\n")
    found = evidence({"chaos1-2p2d-000012", "chaos1-2p2d-000099"}, [kept, tmp_path / "router.log"])
    assert list(found) == ["chaos1-2p2d-000012"]
    assert [line.split(":")[0] for line in found["chaos1-2p2d-000012"]] == ["decode-0.f0001.log.gz", "router.log"]


def test_transfers_failed_for_silence_are_counted_by_the_number_each_line_gives(tmp_path):
    with gzip.open(tmp_path / "decode-0.log.gz", "wt") as f:
        f.write(DECODE_LOG)
    (tmp_path / "decode-1.log").write_text("INFO nothing failed\n")
    logs = [tmp_path / "decode-0.log.gz", tmp_path / "decode-1.log"]
    assert silence_failures(logs) == 4
    assert list(transfer_failures(logs)) == ["decode-0.log.gz"] and len(transfer_failures(logs)["decode-0.log.gz"]) == 4
