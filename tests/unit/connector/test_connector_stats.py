"""Per-interval push stats: what one finished push adds."""
from __future__ import annotations

from kvpush.connector.pushes import SendRecord
from kvpush.connector.stats import PushStats


def test_a_push_records_its_bytes_and_its_write_from_post_to_completion():
    stats = PushStats()
    stats.record_send(SendRecord("t1", "r1", True, 2 << 30, offered=10.0, registered=9.5, posted=10.25, finished=10.254))
    stats.record_send(SendRecord("t2", "r2", False, 0, offered=11.0, registered=11.0, posted=11.1, finished=11.2))
    data = stats.to_dict()
    assert data["send_bytes"] == [2 << 30] and data["sends_failed"] == 1
    assert abs(data["write_s"][0] - 0.004) < 1e-9 and abs(data["prefill_end_to_done_s"][0] - 0.254) < 1e-9
    reduced = PushStats().aggregate(stats).reduce()
    assert reduced["write_p50_ms"] == 4.0 and reduced["send_bytes_total"] == 2 << 30
