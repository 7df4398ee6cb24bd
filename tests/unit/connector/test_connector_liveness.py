"""D's ping of the prefill peers it waits on (connector/liveness.py)."""
from __future__ import annotations

from kvpush.connector.liveness import PeerLiveness


def test_a_busy_peer_is_pinged_every_interval_and_an_idle_one_never():
    live = PeerLiveness(interval_s=0.2, silence_s=1.0)
    assert live.due([], 0.0) == ([], [])
    assert live.due(["p"], 0.0) == (["p"], [])
    assert live.due(["p"], 0.1) == ([], [])
    live.heard("p")
    assert live.due(["p"], 0.25) == (["p"], [])


def test_a_peer_silent_past_the_limit_is_reported_once_pinged():
    live = PeerLiveness(interval_s=0.2, silence_s=1.0)
    live.due(["p"], 0.0)
    for t in (0.2, 0.4, 0.6, 0.8, 1.0):
        assert live.due(["p"], t)[1] == []
    assert live.due(["p"], 1.05) == ([], ["p"])


def test_any_answer_restarts_the_clock():
    live = PeerLiveness(interval_s=0.2, silence_s=1.0)
    live.due(["p"], 0.0)
    live.heard("p")
    assert live.due(["p"], 0.9) == (["p"], [])  # pinged again at 0.9, unanswered from then on
    assert live.due(["p"], 1.8)[1] == []
    assert live.due(["p"], 1.95)[1] == ["p"]


def test_silence_while_nothing_is_pending_does_not_count():
    live = PeerLiveness(interval_s=0.2, silence_s=1.0)
    live.due(["p"], 0.0)  # pinged, never answered
    live.due([], 0.5)  # the transfer ended: the peer is idle
    assert live.due(["p"], 10.0) == (["p"], [])  # busy again: a fresh clock


def test_next_deadline_is_the_next_ping_or_the_silence_limit():
    live = PeerLiveness(interval_s=0.2, silence_s=1.0)
    assert live.next_deadline([]) is None
    assert live.next_deadline(["p"]) == float("-inf")  # never pinged: at once
    live.due(["p"], 5.0)
    assert live.next_deadline(["p"]) == 5.2
    live.forget("p")
    assert live.next_deadline(["p"]) == float("-inf")


def test_a_peer_still_admitting_is_not_pinged_nor_silent_until_its_admission_bound():
    live = PeerLiveness(interval_s=0.2, silence_s=1.0, admission_s=10.0)
    live.proven("p", 0.0)
    assert live.due(["p"], 5.0) == ([], [])  # making D a NIXL peer: nothing is asked of it yet
    assert live.unadmitted(["p"], 9.9) == [] and live.next_deadline(["p"]) == 10.0
    assert live.unadmitted(["p"], 10.1) == ["p"] and live.unadmitted([], 10.1) == []  # only while D waits on it
    live.admitted("p")
    assert live.due(["p"], 10.2) == (["p"], [])  # admitted: pinged, and its silence counts from now
    assert live.due(["p"], 11.3)[1] == ["p"]
