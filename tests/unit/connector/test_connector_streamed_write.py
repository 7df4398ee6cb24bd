"""A streamed push part by part against a scripted engine: what decode is told, what is handed
back still copying, that every part not handed back is released, and that a WRITE still copying
is polled with sleeps, not spun on."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvpush.connector import streamed_write, wire
from kvpush.connector.streamed_write import stream_parts, wait_while_copying
from kvpush.connector.transfer import TransferError


class Engine:
    def __init__(self, states):
        self.states = dict(states)  # part name -> state it reports ("DONE", "ERR", "PROC")
        self.posted, self.released = [], []

    def post(self, write, engine_id):
        if self.states.get(write.name) == "POST_FAILS":
            raise TransferError(f"post of {write.name} refused")
        self.posted.append(write.name)

    def state(self, write):
        return self.states.get(write.name, "DONE")

    def release(self, write):
        self.released.append(write.name)


class Conn:
    def __init__(self, gone_after_sends=None):
        self.sent, self._gone_after = [], gone_after_sends

    def send(self, msg):
        self.sent.append(msg)

    def gone(self):
        return self._gone_after is not None and len(self.sent) >= self._gone_after


def wanted_while_open(conn):
    """The producer's check before each part, as far as the connection goes."""
    return lambda: "decode engine D#0 disconnected" if conn.gone() else ""


def parts(n=3):
    return [(SimpleNamespace(name=f"layer{i}", num_bytes=100, num_descriptors=2), (i,)) for i in range(n)]


def test_every_part_landed_is_announced_and_released():
    engine, conn = Engine({}), Conn()
    outcome = stream_parts(engine, conn, "D#0", "t1", parts(), wanted_while_open(conn))
    assert outcome.error == "" and outcome.landed_bytes == 300 and outcome.num_descriptors == 6 and not outcome.copying
    assert conn.sent == [wire.Streaming("t1"), wire.Landed("t1", (0,)), wire.Landed("t1", (1,)), wire.Landed("t1", (2,))]
    assert engine.released == ["layer0", "layer1", "layer2"]


def test_a_part_still_copying_is_handed_back_with_the_rest_posted(monkeypatch):
    monkeypatch.setattr(streamed_write, "STREAM_DRIVE_S", 0.0)
    engine, conn = Engine({"layer1": "PROC"}), Conn()
    outcome = stream_parts(engine, conn, "D#0", "t1", parts(), wanted_while_open(conn))
    assert [w.name for w in outcome.copying] == ["layer1", "layer2"] and outcome.copying_bytes == 200
    assert engine.posted == ["layer0", "layer1", "layer2"] and engine.released == ["layer0"]
    assert outcome.error == "" and outcome.landed_bytes == 100


def test_a_failed_part_fails_the_push_and_releases_what_was_never_posted():
    engine, conn = Engine({"layer0": "ERR"}), Conn()
    outcome = stream_parts(engine, conn, "D#0", "t1", parts(), wanted_while_open(conn))
    assert "failed (layer part 1 of 3)" in outcome.error and not outcome.copying
    assert engine.posted == ["layer0"] and sorted(engine.released) == ["layer0", "layer1", "layer2"]


def test_decode_gone_midway_stops_the_writes_before_its_blocks_are_touched():
    engine, conn = Engine({}), Conn(gone_after_sends=2)  # STREAMING and the first LANDED went out
    outcome = stream_parts(engine, conn, "D#0", "t1", parts(), wanted_while_open(conn))
    assert outcome.error == "decode engine D#0 disconnected during the streamed WRITE (before layer part 2 of 3)"
    assert engine.posted == ["layer0"] and engine.released == ["layer0", "layer1", "layer2"]


def test_a_cancel_midway_stops_the_writes_also_once_parts_go_on_in_flight(monkeypatch):
    monkeypatch.setattr(streamed_write, "STREAM_DRIVE_S", 0.0)
    engine, conn, asked = Engine({"layer0": "PROC"}), Conn(), []

    def unwanted():
        asked.append(len(engine.posted))
        return "cancelled by decode" if len(engine.posted) >= 2 else ""

    outcome = stream_parts(engine, conn, "D#0", "t1", parts(4), unwanted)
    assert engine.posted == ["layer0", "layer1"] and [w.name for w in outcome.copying] == ["layer0", "layer1"]
    assert outcome.error == "cancelled by decode during the streamed WRITE" and asked == [0, 1, 2]
    assert engine.released == ["layer2", "layer3"]  # never posted


def test_a_refused_post_fails_the_push_and_releases_the_later_parts():
    engine, conn = Engine({"layer1": "POST_FAILS"}), Conn()
    outcome = stream_parts(engine, conn, "D#0", "t1", parts(), wanted_while_open(conn))
    assert outcome.error == "post of layer1 refused"
    assert engine.posted == ["layer0"] and engine.released == ["layer0", "layer2"]


class CountingEngine(Engine):
    """Copying until the n-th poll; each poll takes `poll_s` of the fake clock."""

    def __init__(self, clock, done_at_poll, poll_s=0.0001):
        super().__init__({})
        self.clock, self.polls, self.done_at, self.poll_s = clock, 0, done_at_poll, poll_s

    def state(self, write):
        self.polls += 1
        self.clock[0] += self.poll_s
        return "DONE" if self.polls >= self.done_at else "PROC"


@pytest.fixture
def clock(monkeypatch):
    now, sleeps = [0.0], []
    monkeypatch.setattr(streamed_write.time, "monotonic", lambda: now[0])

    def sleep(s):
        sleeps.append(s)
        now[0] += s
    monkeypatch.setattr(streamed_write.time, "sleep", sleep)
    return now, sleeps


def test_a_write_that_keeps_copying_is_polled_back_to_back_briefly_then_with_growing_sleeps(clock):
    now, sleeps = clock
    engine = CountingEngine(now, done_at_poll=40)
    assert wait_while_copying(engine, [SimpleNamespace(name="w")], deadline=10.0) == ["DONE"]
    polls_before_a_sleep = engine.polls - len(sleeps)  # the last poll found it done
    assert 1 < polls_before_a_sleep <= 1 + streamed_write.SPIN_S / engine.poll_s
    assert sleeps == sorted(sleeps) and sleeps[0] == streamed_write.FIRST_SLEEP_S and sleeps[-1] == streamed_write.MAX_SLEEP_S


def test_polling_stops_at_the_deadline_with_the_write_still_copying(clock):
    now, sleeps = clock
    assert wait_while_copying(CountingEngine(now, done_at_poll=10**9), [SimpleNamespace(name="w")], deadline=0.5) == ["PROC"]
    assert now[0] >= 0.5 and max(sleeps) == streamed_write.MAX_SLEEP_S
