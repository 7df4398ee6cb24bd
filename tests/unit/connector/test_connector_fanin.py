"""One transfer from several prefill ranks: vLLM hears of it once, and never while a part runs."""
from __future__ import annotations

from kvpush.connector.fanin import Parts, base_name, rank_key, rank_of
from kvpush.connector.state import Outcome, Pending

WHOLE = Pending("t", "r", "P", (3, 4), 1.0)
KEYS = [rank_key("t", 0), rank_key("t", 1)]


def part(key: str, ok: bool = True, num_bytes: int = 100, may_still_land: bool = False) -> Outcome:
    return Outcome(Pending(key, "r", rank_key("P", rank_of(key)), (3, 4), 1.0), ok, "" if ok else f"{key} broke",
                   num_bytes=num_bytes, may_still_land=may_still_land)


def parts() -> Parts:
    p = Parts()
    p.add(WHOLE, KEYS)
    return p


def test_keys_round_trip_and_never_collide_with_wire_ids():
    assert base_name(rank_key("dep.decode-0", 3)) == "dep.decode-0" and rank_of(rank_key("x", 3)) == 3


def test_the_outcome_comes_when_every_part_has_one_with_bytes_summed():
    p = parts()
    assert p.settle(part(KEYS[0])) == (None, [], None)
    whole, cancel, _ = p.settle(part(KEYS[1], num_bytes=50))
    assert whole == Outcome(WHOLE, True, num_bytes=150) and cancel == []
    assert "t" not in p


def test_the_first_failure_cancels_the_running_parts_and_the_outcome_waits_for_them():
    p = parts()
    whole, cancel, _ = p.settle(part(KEYS[1], ok=False))
    assert whole is None and cancel == [KEYS[0]] and p.failing("t")
    whole, cancel, _ = p.settle(part(KEYS[0], ok=False, may_still_land=True))
    assert not whole.ok and whole.reason == "t#1 broke" and whole.may_still_land and cancel == []


def test_a_transfer_starts_once_every_part_streams_or_is_done_and_only_once():
    p = parts()
    assert p.streaming(KEYS[0]) is None
    _, _, started = p.settle(part(KEYS[1]))  # done without streaming: counts as started
    assert started == WHOLE
    assert p.streaming(KEYS[0]) is None  # already announced


def test_a_transfer_whose_parts_all_end_unstreamed_has_only_an_outcome():
    p = parts()
    assert p.settle(part(KEYS[0]))[2] is None
    whole, _, started = p.settle(part(KEYS[1]))
    assert whole.ok and started is None


def test_a_failed_part_means_no_start():
    p = parts()
    p.settle(part(KEYS[0], ok=False))
    assert p.streaming(KEYS[1]) is None


def test_unknown_and_repeated_part_outcomes_are_ignored():
    p = parts()
    assert p.settle(part(rank_key("other", 0))) == (None, [], None)
    p.settle(part(KEYS[0]))
    assert p.settle(part(KEYS[0], ok=False)) == (None, [], None)
    assert p.running("t") == [KEYS[1]]


def test_a_transfer_is_free_of_writers_once_every_fenced_part_is_unfenced():
    p = parts()
    p.settle(part(KEYS[0], ok=False, may_still_land=True))
    assert p.unfenced(KEYS[0]) is None  # the transfer is not over yet
    whole, _, _ = p.settle(part(KEYS[1], ok=False, may_still_land=True))
    assert whole.may_still_land  # KEYS[1] is still fenced
    assert p.unfenced(KEYS[1]) == "t" and p.unfenced(KEYS[1]) is None


def test_a_transfer_whose_fenced_part_ended_before_the_others_is_not_fenced():
    p = parts()
    p.settle(part(KEYS[0], ok=False, may_still_land=True))
    p.unfenced(KEYS[0])
    whole, _, _ = p.settle(part(KEYS[1], ok=False))
    assert not whole.ok and not whole.may_still_land
    assert p.unfenced(KEYS[0]) is None and p.unfenced(rank_key("other", 0)) is None
