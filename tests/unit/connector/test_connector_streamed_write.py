"""A streamed push part by part against a scripted engine: what decode is told, what is handed
back still copying, and that every part not handed back is released."""
from __future__ import annotations

from types import SimpleNamespace

from kvpush.connector import streamed_write, wire
from kvpush.connector.streamed_write import stream_parts
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


def parts(n=3):
    return [(SimpleNamespace(name=f"layer{i}", num_bytes=100, num_descriptors=2), (i,)) for i in range(n)]


def test_every_part_landed_is_announced_and_released():
    engine, conn = Engine({}), Conn()
    outcome = stream_parts(engine, conn, "D#0", "t1", parts())
    assert outcome.error == "" and outcome.landed_bytes == 300 and outcome.num_descriptors == 6 and not outcome.copying
    assert conn.sent == [wire.Streaming("t1"), wire.Landed("t1", (0,)), wire.Landed("t1", (1,)), wire.Landed("t1", (2,))]
    assert engine.released == ["layer0", "layer1", "layer2"]


def test_a_part_still_copying_is_handed_back_with_the_rest_posted(monkeypatch):
    monkeypatch.setattr(streamed_write, "STREAM_DRIVE_S", 0.0)
    engine, conn = Engine({"layer1": "PROC"}), Conn()
    outcome = stream_parts(engine, conn, "D#0", "t1", parts())
    assert [w.name for w in outcome.copying] == ["layer1", "layer2"] and outcome.copying_bytes == 200
    assert engine.posted == ["layer0", "layer1", "layer2"] and engine.released == ["layer0"]
    assert outcome.error == "" and outcome.landed_bytes == 100


def test_a_failed_part_fails_the_push_and_releases_what_was_never_posted():
    engine, conn = Engine({"layer0": "ERR"}), Conn()
    outcome = stream_parts(engine, conn, "D#0", "t1", parts())
    assert "failed (layer part 1 of 3)" in outcome.error and not outcome.copying
    assert engine.posted == ["layer0"] and sorted(engine.released) == ["layer0", "layer1", "layer2"]


def test_decode_gone_midway_stops_the_writes_before_its_blocks_are_touched():
    engine, conn = Engine({}), Conn(gone_after_sends=2)  # STREAMING and the first LANDED went out
    outcome = stream_parts(engine, conn, "D#0", "t1", parts())
    assert "disconnected during the streamed WRITE (before layer part 2 of 3)" in outcome.error
    assert engine.posted == ["layer0"] and engine.released == ["layer0", "layer1", "layer2"]


def test_a_refused_post_fails_the_push_and_releases_the_later_parts():
    engine, conn = Engine({"layer1": "POST_FAILS"}), Conn()
    outcome = stream_parts(engine, conn, "D#0", "t1", parts())
    assert outcome.error == "post of layer1 refused"
    assert engine.posted == ["layer0"] and engine.released == ["layer0", "layer2"]
