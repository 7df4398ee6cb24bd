"""Protocol state: matching in both orders, duplicates, expiry, failures, aborts, cancels."""
from __future__ import annotations

from kvpush.connector.state import ConsumerState, Match, Offer, Pending, ProducerState, Registration, Rejection

D, OTHER = "D.e", "D.x"


def offer(tid="t", blocks=(10, 11, 12), peer=D, at=0.0):
    return Offer(tid, "req-" + tid, tuple(blocks), peer, at)


def reg(tid="t", blocks=(1, 2, 3), first=0, peer=D, at=0.0):
    return Registration(tid, peer, tuple(blocks), first, at)


def test_offer_then_registration_matches():
    s = ProducerState(5.0)
    assert s.offer(offer(at=1.0)) is None
    m = s.register(reg(at=1.5))
    assert isinstance(m, Match) and m.src_blocks == (10, 11, 12) and m.dst_blocks == (1, 2, 3)
    assert m.wait_s == 0.5 and not s.offers and not s.registrations


def test_registration_then_offer_matches_with_local_prefix():
    s = ProducerState(5.0)
    assert s.register(reg(blocks=(7, 8), first=1)) is None
    m = s.offer(offer())
    assert isinstance(m, Match) and m.src_blocks == (11, 12) and m.dst_blocks == (7, 8)


def test_duplicates_are_dropped_and_counted():
    s = ProducerState(5.0)
    s.register(reg())
    assert s.register(reg()) is None
    s.offer(offer())
    assert isinstance(s.register(reg()), Rejection)  # late: transfer already closed
    assert s.dropped["duplicate_registration"] == 1 and s.dropped["late_registration"] == 1


def test_registration_from_wrong_engine_is_rejected_and_frees_blocks():
    s = ProducerState(5.0)
    s.offer(offer(peer=D))
    r = s.register(reg(peer=OTHER))
    assert isinstance(r, Rejection) and r.req_id == "req-t" and "D.e" in r.reason


def test_registration_beyond_prefill_blocks_is_rejected():
    s = ProducerState(5.0)
    s.offer(offer(blocks=(1,)))
    assert isinstance(s.register(reg(blocks=(1, 2))), Rejection)


def test_expiry_of_unmatched_halves():
    s = ProducerState(5.0)
    s.offer(offer("a", at=0.0))
    s.register(reg("b", at=3.0))
    offers, regs = s.expire(now=5.5)
    assert [o.transfer_id for o in offers] == ["a"] and regs == []
    offers, regs = s.expire(now=8.5)
    assert [r.transfer_id for r in regs] == ["b"]
    assert s.next_deadline() is None
    assert isinstance(s.offer(offer("a", at=9.0)), Rejection)  # late offer frees its blocks at once


def test_abort_before_registration_answers_it_with_failure():
    s = ProducerState(5.0)
    assert s.abort("t", "aborted", now=1.0) is None
    r = s.register(reg())
    assert isinstance(r, Rejection) and r.reason == "aborted" and r.req_id is None


def test_abort_after_registration_returns_it():
    s = ProducerState(5.0)
    s.register(reg())
    assert s.abort("t", "aborted", now=1.0).transfer_id == "t"


def test_cancel_frees_unmatched_offer():
    s = ProducerState(5.0)
    s.offer(offer())
    assert s.cancel("t", D, now=1.0).req_id == "req-t"
    assert s.cancel("t", D, now=1.0) is None


def test_cancel_before_offer_makes_late_offer_free_blocks():
    s = ProducerState(5.0)
    s.register(reg())
    assert s.cancel("t", D, now=1.0) is None
    assert isinstance(s.offer(offer()), Rejection)


def test_peer_gone_drops_its_registrations_and_refuses_their_offers_at_once():
    s = ProducerState(5.0)
    s.register(reg("a"))
    s.register(reg("b", peer=OTHER))
    s.peer_gone(D, now=1.0)
    assert list(s.registrations) == ["b"]
    late = s.offer(offer("a", at=1.5))  # not held until it expires: its blocks are freed now
    assert isinstance(late, Rejection) and late.req_id == "req-a" and not s.offers


def test_a_second_request_with_a_pending_transfer_id_is_refused_without_failing_the_first():
    s = ProducerState(5.0)
    assert s.offer(offer("t")) is None
    second = s.offer(Offer("t", "req-other", (20, 21, 22), D, 0.1))
    assert isinstance(second, Rejection) and second.req_id == "req-other" and not second.tell_decode
    assert isinstance(s.register(reg("t")), Match)  # the first request's push goes on
    assert s.dropped["duplicate_offer"] == 1


def test_a_second_request_with_a_sent_transfer_id_is_refused_without_telling_decode():
    s = ProducerState(5.0)
    s.register(reg("t"))
    assert isinstance(s.offer(offer("t")), Match)
    second = s.offer(Offer("t", "req-other", (20,), D, 0.2))
    assert isinstance(second, Rejection) and second.req_id == "req-other" and not second.tell_decode


def pending(tid="t", peer="P.e", at=0.0):
    return Pending(tid, "req-" + tid, peer, (1, 2), at)


def test_consumer_done_and_fail_outcomes():
    c = ConsumerState(5.0)
    c.add(pending("a"))
    c.add(pending("b"))
    assert c.done("a", "P.e", 100).ok
    out = c.fail("b", "P.e", "why")
    assert not out.may_still_land
    assert not out.ok and out.reason == "why"
    assert c.done("a", "P.e", 100) is None and c.dropped["unknown_done"] == 1


def test_consumer_ignores_outcomes_from_other_engine():
    c = ConsumerState(5.0)
    c.add(pending())
    assert c.done("t", "P.other", 1) is None and "t" in c.pending


def test_consumer_duplicate_registration_dropped():
    c = ConsumerState(5.0)
    assert c.add(pending()) and not c.add(pending())


def test_consumer_peer_gone_fails_its_transfers():
    c = ConsumerState(5.0)
    c.add(pending("a"))
    c.add(pending("b", peer="P.x"))
    assert [o.pending.transfer_id for o in c.peer_gone("P.e", "lost")] == ["a"]


def test_consumer_streamed_transfer_lands_region_by_region_until_its_outcome():
    c = ConsumerState(5.0)
    c.add(pending("a"))
    assert c.has_landed("a", (0, 1)) and c.has_landed("unknown", (0,))  # not streaming: nothing to wait for
    assert c.streaming("a", "P.e") == pending("a")
    assert c.streaming("a", "P.e") is None and c.dropped["duplicate_streaming"] == 1
    assert c.streaming("b", "P.e") is None and c.dropped["unknown_streaming"] == 1
    assert not c.has_landed("a", (0,))
    assert c.landed("a", "P.e", (0,), num_regions=2)
    assert c.has_landed("a", (0,)) and not c.has_landed("a", (0, 1))
    assert not c.landed("a", "P.x", (1,), num_regions=2) and not c.landed("a", "P.e", (2,), num_regions=2)
    assert c.dropped["unknown_landed"] == 1 and c.dropped["bad_landed"] == 1
    assert not c.has_landed("a", (1,))
    c.fail("a", "P.e", "gone")
    assert c.has_landed("a", (1,)) and c.landing == {}  # over: the outcome says how


def test_a_lost_peer_fails_a_stream_unless_every_region_had_landed():
    c = ConsumerState(5.0)
    for tid in ("whole", "half", "plain"):
        c.add(pending(tid))
    c.streaming("whole", "P.e")
    c.streaming("half", "P.e")
    c.landed("whole", "P.e", (0, 1), num_regions=2)
    c.landed("half", "P.e", (0,), num_regions=2)
    outcomes = {o.pending.transfer_id: o.ok for o in c.peer_gone("P.e", "lost", num_regions=2)}
    assert outcomes == {"whole": True, "half": False, "plain": False}


def test_consumer_short_expiry_only_until_accepted():
    c = ConsumerState(5.0, accepted_timeout_s=100.0)
    c.add(pending("a", at=0.0))
    c.add(pending("b", at=0.0))
    assert c.accept("b", "P.e", now=1.0) and not c.accept("zzz", "P.e", now=1.0)
    assert c.next_deadline() == 5.0
    assert [o.pending.transfer_id for o in c.expire(6.0)] == ["a"]
    assert c.next_deadline() == 101.0 and "b" in c.pending
    [late] = c.expire(102.0)
    assert not late.ok and "accepted" in late.reason and not c.pending


def test_accepted_registration_waits_past_the_timeout():
    s = ProducerState(5.0)
    s.register(reg("a", at=0.0))
    assert s.accept("a").transfer_id == "a"
    assert s.accept("b") is None  # accepted before D registered
    s.register(reg("b", at=0.0))
    assert s.expire(now=60.0) == ([], []) and s.next_deadline() is None
    assert isinstance(s.offer(offer("a", at=61.0)), Match)
    assert "a" not in s.accepted


def sent(tid="t", peer="P.e", at=0.0, generation=1):
    """A pending part whose REGISTER went out on connection `generation`."""
    return Pending(tid, "req-" + tid, peer, (1, 2), at, generation=generation)


def test_failures_d_declares_while_p_may_still_write_fence_the_part():
    c = ConsumerState(timeout_s=1.0, accepted_timeout_s=5.0)
    for tid in ("silent", "unsent"):
        c.add(sent(tid, generation=1 if tid == "silent" else 0))
    outcomes = {o.pending.transfer_id: o for o in c.peer_gone("P.e", "no answer", may_still_land=True, now=2.0)}
    assert outcomes["silent"].may_still_land and list(c.fences.held) == ["silent"]
    assert not outcomes["unsent"].may_still_land  # its REGISTER never went out: P cannot write it
    for tid in ("late", "unaccepted"):
        c.add(sent(tid))
    c.accept("late", "P.e", now=0.0, generation=1)
    assert all(o.may_still_land for o in c.expire(now=10.0)) and set(c.fences.held) == {"silent", "late", "unaccepted"}
    c.add(sent("told"))
    assert not c.fail("told", "P.e", "WRITE failed", generation=1).may_still_land and "told" not in c.fences
    c.add(sent("gone"))
    assert not c.peer_gone("P.e", "connection closed by peer", generation=1)[0].may_still_land
    assert not c.fences.held and sorted(c.fences.take_ended()) == ["late", "silent", "unaccepted"]  # P's process is gone


def test_quiesced_ends_a_fence_and_only_from_the_parts_connection():
    c = ConsumerState(5.0)
    c.add(sent("t", generation=2))
    [still_copying] = [c.fail("t", "P.e", "WRITE overdue", may_still_land=True, generation=2, now=1.0)]
    assert still_copying.may_still_land and "t" in c.fences
    assert c.fail("t", "P.e", "again", may_still_land=True, generation=2) is None and "t" in c.fences
    assert not c.quiesced("t", "P.e", generation=1) and "t" in c.fences  # another connection's word counts for nothing
    assert c.dropped["unknown_quiesced"] == 1
    assert c.quiesced("t", "P.e", generation=2) and c.fences.take_ended() == ["t"]
    assert not c.quiesced("t", "P.e", generation=2)


def test_a_done_or_a_fail_that_nothing_can_land_ends_a_fence_d_set_itself():
    c = ConsumerState(5.0)
    for tid in ("a", "b", "c"):
        c.add(sent(tid))
    for tid in ("a", "b", "c"):
        assert c.give_up(tid, "landing overdue", now=1.0).may_still_land
    assert c.done("a", "P.e", 4096, generation=1) is None  # the late DONE: no second outcome
    assert c.fail("b", "P.e", "cancelled by decode", generation=1) is None
    assert c.fail("c", "P.e", "still copying", may_still_land=True, generation=1) is None
    assert sorted(c.fences.take_ended()) == ["a", "b"] and list(c.fences.held) == ["c"]
    assert not c.dropped  # none of them is unknown


def test_messages_from_another_connection_than_the_registrations_are_refused():
    c = ConsumerState(5.0)
    c.add(sent("t", generation=1))
    assert c.done("t", "P.e", 4096, generation=2) is None and c.fail("t", "P.e", "x", generation=2) is None
    assert not c.accept("t", "P.e", now=0.0, generation=2) and c.streaming("t", "P.e", generation=2) is None
    assert c.dropped["stale_generation"] == 4 and "t" in c.pending
    assert c.done("t", "P.e", 4096, generation=1).ok


def test_a_transfer_that_ended_is_never_registered():
    c = ConsumerState(5.0)
    c.add(pending("t"))
    assert c.sent("t", 3) and c.pending["t"].generation == 3
    c.fail("t", "P.e", "refused", generation=3)
    assert not c.sent("t", 3)


def test_the_backstop_ends_every_fence_of_an_overdue_connection_and_names_it():
    c = ConsumerState(5.0)
    for tid, gen, at in (("a", 1, 0.0), ("b", 1, 8.0), ("c", 2, 9.0)):
        c.add(sent(tid, generation=gen))
        c.give_up(tid, "silent", now=at)
    assert c.fences.next_deadline(10.0) == 10.0 and c.fences.overdue(9.9, 10.0) == {}
    due = c.fences.overdue(10.0, 10.0)
    assert list(due) == [("P.e", 1)]  # b is younger, but its connection is dropped with a's
    assert sorted(c.fences.held) == ["a", "b", "c"] and c.fences.take_ended() == []  # nothing ends before the drop
    assert c.fences.end_by_backstop(due[("P.e", 1)]) == 2
    assert sorted(c.fences.take_ended()) == ["a", "b"] and list(c.fences.held) == ["c"]
    assert c.fences.counts["ended_by_backstop"] == 2
    assert c.fences.overdue(1e9, 0.0) == {} and c.fences.next_deadline(0.0) is None  # 0: no backstop


def test_a_fence_that_ended_or_was_made_anew_while_its_connection_was_dropped_is_left_alone():
    c = ConsumerState(5.0)
    for tid in ("a", "b"):
        c.add(sent(tid, generation=1))
        c.give_up(tid, "silent", now=0.0)
    due = c.fences.overdue(10.0, 10.0)[("P.e", 1)]
    assert c.fences.word("a", "P.e", 1)  # prefill's word came while the connection was being dropped
    c.fences.take_ended()
    c.fences.hold("b", "P.e", 1, 10.0)  # made anew: not the fence the backstop found overdue
    assert c.fences.end_by_backstop(due) == 0 and list(c.fences.held) == ["b"]


def test_a_lost_connection_fails_only_what_was_registered_on_it():
    c = ConsumerState(5.0)
    c.add(sent("on-it", generation=2))
    c.add(sent("not-yet", generation=0))  # its REGISTER goes out on the next connection
    assert [o.pending.transfer_id for o in c.peer_gone("P.e", "lost", generation=2)] == ["on-it"]
    assert [o.pending.transfer_id for o in c.peer_gone("P.e", "unreachable")] == ["not-yet"]
