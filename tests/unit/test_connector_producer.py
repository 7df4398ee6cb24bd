"""The prefill-side push service with a stand-in engine: WRITEs made ahead by prepare() are the
ones offer() posts, made at prefill end otherwise, released when their registration goes away;
the compute thread drives WRITEs on DRAM only; the peer's device id reaches the engine."""
from __future__ import annotations

import socket
import threading
import time
from collections import Counter
from types import SimpleNamespace

import pytest

from kvpush.connector import wire
from kvpush.connector.producer import Producer, ProducerConfig
from kvpush.connector.regions import HeadLayout, LayoutIdentity, Region
from kvpush.connector.sharding import HeadSharding
from kvpush.connector.transfer import TransferError, Write

pytestmark = pytest.mark.unit

IDENTITY = LayoutIdentity("m", "bfloat16", 16, ("l0",), 1)
REGIONS = (Region(1 << 20, 4096, 4096, 64),)
HEADS = (HeadLayout.whole(4096),)


class FakeEngine:
    """Records what the producer asks of NIXL; a WRITE completes `latency_s` after its post, and
    never while `writes_held` is set (a test then decides when copies end); `posted_one` is set at
    the first post."""

    def __init__(self, latency_s: float = 0.0):
        self.latency_s = latency_s
        self.writes_held = threading.Event()
        self.posted_one = threading.Event()
        self.peers: list[tuple] = []
        self.prepared: list[tuple] = []
        self.posted: list[Write] = []
        self.released: list[Write] = []
        self.state_calls = 0
        self.failing: Write | None = None
        self._posted_at: dict[int, float] = {}
        self.regions = REGIONS
        self.device_id = 0

    def add_peer(self, metadata, regions, device_id=0, segments=None):
        self.peers.append((metadata, tuple(regions), device_id))
        return SimpleNamespace(regions=tuple(regions))

    def prepare_write(self, peer, src, dst, notif=b""):
        write = Write(object(), 4096 * len(src), 1 + len(src) // 4)
        self.prepared.append((tuple(src), tuple(dst), write))
        return write

    def post(self, write, agent_name="peer"):
        self.posted.append(write)
        self._posted_at[id(write)] = time.monotonic()
        self.posted_one.set()

    def state(self, write):
        self.state_calls += 1
        if write is self.failing:
            return "ERR"
        if self.writes_held.is_set():
            return "PROC"
        done = time.monotonic() - self._posted_at[id(write)] >= self.latency_s
        return "DONE" if done else "PROC"

    def release(self, write):
        self.released.append(write)

    def prepare_parts(self, peer, src, dst):
        """Two layer parts, regions (0,) and (1,); `fail_part` makes that part's WRITE end in ERR."""
        parts = [(Write(object(), 2048 * len(src), 1), (i,)) for i in range(2)]
        self.prepared.append((tuple(src), tuple(dst), parts))
        return parts


class FakeConn:
    def __init__(self):
        self.closed = False
        self.engine_id = None
        self.auth_state = None
        self.authenticated = False
        self.peer = "127.0.0.1:1"
        self.sent: list = []
        self.sock = socket.socket()  # never connected: only for the reactor to close on a refusal
        self._send_lock = threading.Lock()

    def send(self, msg):
        self.sent.append(msg)

    def gone(self):
        return self.closed

    def trust(self):
        self.authenticated = True


@pytest.fixture
def setup():
    made = []

    def make(latency_s: float = 0.0, drive_writes: bool = True, stream_writes: bool = False, timeout_s: float = 5.0):
        engine = FakeEngine(latency_s)
        producer = Producer(ProducerConfig("P", IDENTITY, frozenset({"D", "D2"}), "127.0.0.1", 0, timeout_s,
                                           drive_writes=drive_writes, stream_writes=stream_writes), engine)
        made.append(producer)
        conn = FakeConn()
        shake(producer, conn, "D", device_id=5)
        return producer, engine, conn

    yield make
    for p in made:
        p.close()


def deliver(producer, conn, msg):
    """A frame as the reactor thread hands it over, and whatever it queued for the transfer thread done."""
    producer._channel.on_message(conn, msg)
    assert producer._jobs.drain()


def shake(producer, conn, engine, rank=0, tp_size=1, identity=IDENTITY, regions=REGIONS, heads=HEADS, device_id=0):
    """The handshake of an unauthenticated side channel (no key): HELLO, then LAYOUT."""
    deliver(producer, conn, wire.Hello(engine, rank, tp_size))
    deliver(producer, conn, wire.Layout(f"agent-{engine}{rank}", b"meta", identity, regions, heads, device_id))


def register(producer, conn, tid, blocks, first=0):
    deliver(producer, conn, wire.Register(tid, tuple(blocks), first, 16 * len(blocks)))


HANG_S = 30.0  # how long to wait for something that must happen before calling it a hang


def wait_record(producer, timeout_s=HANG_S):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        records = producer.take_records()
        if records:
            return records[0]
        time.sleep(0.0005)
    raise AssertionError("no send record")


def test_handshake_hands_the_peer_device_id_to_the_engine(setup):
    _, engine, conn = setup()
    assert engine.peers == [(b"meta", REGIONS, 5)]
    assert isinstance(conn.sent[-1], wire.Welcome)


def test_write_made_ahead_is_the_one_posted_at_prefill_end(setup):
    producer, engine, conn = setup()
    register(producer, conn, "t1", [7, 8, 9], first=1)
    assert producer.prepare("t1", [1, 2, 3, 4], "D")
    [(src, dst, made)] = engine.prepared
    assert (src, dst) == ((2, 3, 4), (7, 8, 9)) and not engine.posted
    producer.offer("t1", "r1", [1, 2, 3, 4], "D")
    assert engine.posted == [made] and len(engine.prepared) == 1
    record = wait_record(producer)
    assert record.ok and record.prepared_ahead and record.num_descriptors == made.num_descriptors
    assert record.offered <= record.posted <= record.finished
    assert any(isinstance(m, wire.Done) and m.transfer_id == "t1" for m in conn.sent)


def test_side_channel_tick_between_match_and_post_keeps_the_write_made_ahead(setup, monkeypatch):
    # The match takes the registration away; the reactor's tick may run before the compute
    # thread posts, and must not take that push's WRITE for a stale one.
    producer, engine, conn = setup()
    register(producer, conn, "t1", [7, 8])
    assert producer.prepare("t1", [1, 2], "D")
    [(_, _, made)] = engine.prepared
    drive = producer._pushes.drive

    def tick_then_drive(match):
        producer._tick()  # the transfer thread's tick, come between the match and the post
        drive(match)

    monkeypatch.setattr(producer._pushes, "drive", tick_then_drive)
    producer.offer("t1", "r1", [1, 2], "D")
    record = wait_record(producer)
    assert record.ok and record.prepared_ahead
    assert engine.posted == [made] and len(engine.prepared) == 1


def test_without_registration_nothing_is_made_ahead_and_offer_makes_it(setup):
    producer, engine, conn = setup()
    assert not producer.prepare("t2", [1, 2], "D")
    producer.offer("t2", "r2", [1, 2], "D")
    assert not engine.posted  # waits for D
    register(producer, conn, "t2", [5, 6])
    record = wait_record(producer)
    assert record.ok and not record.prepared_ahead
    assert [p[:2] for p in engine.prepared] == [((1, 2), (5, 6))] and len(engine.posted) == 1


def test_prepare_is_refused_for_another_engine_or_too_few_blocks(setup):
    producer, engine, conn = setup()
    register(producer, conn, "t3", [5, 6, 7])
    assert not producer.prepare("t3", [1, 2, 3], "E")
    assert not producer.prepare("t3", [1, 2], "D")  # offer() will answer FAIL without a WRITE
    assert not engine.prepared


def test_write_made_ahead_is_released_when_decode_cancels(setup):
    producer, engine, conn = setup()
    register(producer, conn, "t4", [5])
    assert producer.prepare("t4", [1], "D")
    made = engine.prepared[0][2]
    deliver(producer, conn, wire.Cancel("t4"))
    deadline = time.monotonic() + HANG_S
    while made not in engine.released and time.monotonic() < deadline:
        time.sleep(0.001)
    assert made in engine.released and not engine.posted


def test_a_failed_prepare_falls_back_to_making_it_at_prefill_end(setup):
    producer, engine, conn = setup()
    register(producer, conn, "t5", [5])
    original = engine.prepare_write
    engine.prepare_write = lambda *a, **k: (_ for _ in ()).throw(TransferError("busy"))
    assert not producer.prepare("t5", [1], "D")
    engine.prepare_write = original
    producer.offer("t5", "r5", [1], "D")
    assert wait_record(producer).ok and len(engine.posted) == 1


def test_dram_offer_completes_the_write_on_the_calling_thread(setup):
    producer, engine, conn = setup(latency_s=0.02, drive_writes=True)
    register(producer, conn, "t6", [5])
    producer.offer("t6", "r6", [1], "D")
    assert producer.take_freed() == ["r6"]  # done before offer returned


def test_gpu_offer_returns_at_once_and_the_side_channel_thread_completes_it(setup):
    producer, engine, conn = setup(drive_writes=False)
    engine.writes_held.set()
    register(producer, conn, "t7", [5])
    producer.offer("t7", "r7", [1], "D")  # returns although the WRITE cannot end yet
    assert len(engine.posted) == 1 and not producer.take_records() and not producer.take_freed()
    engine.writes_held.clear()
    producer._jobs.wake()
    record = wait_record(producer)
    assert record.ok and producer.take_freed() == ["r7"]


def test_short_poll_waits_are_not_rounded_up_to_a_millisecond(monkeypatch):
    """The side-channel thread polls in-flight WRITEs every 0.2 ms; epoll rounds a timeout up to
    whole milliseconds, which made every GPU push ~1 ms longer. Short waits sleep instead."""
    from kvpush.connector import channel

    asked, slept = [], []

    class Selector:
        def select(self, timeout=None):
            asked.append(timeout)
            return []

    reactor = channel.Reactor.__new__(channel.Reactor)
    reactor._sel = Selector()
    monkeypatch.setattr(channel.time, "sleep", slept.append)
    reactor._wait(0.0002)
    assert slept == [0.0002] and all(t == 0 for t in asked)
    asked.clear()
    reactor._wait(0.5)
    reactor._wait(None)
    assert asked == [0.5, None] and slept == [0.0002]


def sent_after_handshake(conn) -> list[tuple]:
    return [(type(m).__name__, getattr(m, "regions", None)) for m in conn.sent[1:]]


def test_streamed_write_tells_decode_before_the_first_layer_and_after_each(setup):
    producer, engine, conn = setup(stream_writes=True)
    register(producer, conn, "s1", [5, 6])
    producer.offer("s1", "q1", [1, 2], "D")
    assert sent_after_handshake(conn) == [("Streaming", None), ("Landed", (0,)), ("Landed", (1,)), ("Done", None)]
    [(_, _, parts)] = engine.prepared
    assert engine.posted == [w for w, _ in parts] and engine.released == engine.posted
    assert producer.take_freed() == ["q1"]
    record = producer.take_records()[0]
    assert record.ok and record.num_bytes == conn.sent[-1].num_bytes == 2 * 2048 * 2


def test_a_failed_layer_part_stops_the_stream_with_fail_and_releases_the_rest(setup):
    producer, engine, conn = setup(stream_writes=True)
    register(producer, conn, "s2", [5, 6])
    original = engine.prepare_parts

    def failing_first(*args):
        parts = original(*args)
        engine.failing = parts[0][0]
        return parts

    engine.prepare_parts = failing_first
    producer.offer("s2", "q2", [1, 2], "D")
    assert sent_after_handshake(conn) == [("Streaming", None), ("Fail", None)]
    [(_, _, parts)] = engine.prepared
    assert engine.posted == [parts[0][0]] and set(map(id, engine.released)) == {id(w) for w, _ in parts}
    assert producer.take_freed() == ["q2"] and not producer.take_records()[0].ok


def lose_decode_at_first_post(engine, conn):
    """D closes the side channel while the first layer part copies."""
    post = engine.post

    def post_then_lose_decode(write, agent_name="peer"):
        post(write, agent_name)
        conn.closed = True

    engine.post = post_then_lose_decode


def test_a_stream_whose_decode_disconnects_posts_no_further_layer(setup):
    producer, engine, conn = setup(stream_writes=True)
    register(producer, conn, "s5", [5, 6])
    lose_decode_at_first_post(engine, conn)
    producer.offer("s5", "q5", [1, 2], "D")
    [(_, _, parts)] = engine.prepared
    assert engine.posted == [parts[0][0]]  # the second layer is never written into D's blocks
    assert set(map(id, engine.released)) == {id(w) for w, _ in parts}
    record = producer.take_records()[0]
    assert not record.ok and "disconnected during the streamed WRITE" in record.reason
    assert producer.take_freed() == ["q5"]


def test_a_stream_past_its_deadline_posts_nothing_more_once_decode_disconnected(setup, monkeypatch):
    monkeypatch.setattr("kvpush.connector.streamed_write.STREAM_DRIVE_S", 0.0)
    producer, engine, conn = setup(latency_s=0.05, stream_writes=True)
    register(producer, conn, "s6", [5, 6])
    lose_decode_at_first_post(engine, conn)
    producer.offer("s6", "q6", [1, 2], "D")
    record = wait_record(producer)
    [(_, _, parts)] = engine.prepared
    assert engine.posted == [parts[0][0]] and not record.ok and "disconnected" in record.reason
    assert set(map(id, engine.released)) == {id(w) for w, _ in parts}


def test_a_stream_still_copying_at_the_deadline_goes_on_in_flight_and_ends_with_done(setup, monkeypatch):
    monkeypatch.setattr("kvpush.connector.streamed_write.STREAM_DRIVE_S", 0.0)
    producer, engine, conn = setup(stream_writes=True)
    engine.writes_held.set()  # the copies last until the check below: else the reactor may send DONE first
    register(producer, conn, "s3", [5, 6])
    producer.offer("s3", "q3", [1, 2], "D")
    assert sent_after_handshake(conn) == [("Streaming", None)]  # both parts posted, nothing landed yet
    engine.writes_held.clear()
    producer._jobs.wake()
    record = wait_record(producer)
    assert record.ok and record.num_bytes == 2 * 2048 * 2
    assert sent_after_handshake(conn)[-1] == ("Done", None) and len(engine.posted) == 2


def test_without_streaming_decode_hears_only_done(setup):
    producer, engine, conn = setup(stream_writes=False)
    register(producer, conn, "s4", [5])
    producer.offer("s4", "q4", [1], "D")
    assert sent_after_handshake(conn) == [("Done", None)]


class SlowParts(FakeEngine):
    """Each layer part copies for `latency_s`; records the posts' times."""

    def prepare_parts(self, peer, src, dst):
        parts = [(Write(object(), 2048 * len(src), 1), (i,)) for i in range(2)]
        self.prepared.append((tuple(src), tuple(dst), parts))
        return parts


def stream_in_background(producer, tid, req_id):
    thread = threading.Thread(target=producer.offer, args=(tid, req_id, [1, 2], "D"))
    thread.start()
    return thread


@pytest.mark.parametrize("stream_writes", [True, False])
def test_the_side_channel_thread_is_never_held_up_by_a_write_the_compute_thread_copies(setup, stream_writes):
    """The compute thread copies without the producer's lock: meanwhile the side-channel thread's
    own calls, and another decode's registration, return at once: were they to wait for the whole
    copy, a second decode's PING could go unanswered past its 1 s silence limit."""
    producer, engine, conn = setup(stream_writes=stream_writes)
    engine.writes_held.set()  # the copy lasts until the calls below have returned
    register(producer, conn, "s7", [5, 6])
    thread = stream_in_background(producer, "s7", "q7")
    assert engine.posted_one.wait(HANG_S)  # the first part is copying
    calls_done = threading.Event()

    def side_channel_calls():
        producer._next_wait()
        producer._tick()
        register(producer, conn, "other", [9])
        calls_done.set()

    threading.Thread(target=side_channel_calls, daemon=True).start()
    returned = calls_done.wait(HANG_S)  # they cannot return in time if they wait for the copy
    engine.writes_held.clear()
    thread.join()
    assert returned, "a side-channel call waited for the compute thread's copy"
    assert sent_after_handshake(conn)[-1] == ("Done", None)


@pytest.mark.parametrize("stream_writes", [True, False])
def test_a_cancel_crossing_a_write_the_compute_thread_copies_is_answered_by_the_write_itself(setup, stream_writes):
    producer, engine, conn = setup(stream_writes=stream_writes)
    engine.writes_held.set()
    register(producer, conn, "s8", [5, 6])
    thread = stream_in_background(producer, "s8", "q8")
    assert engine.posted_one.wait(HANG_S)  # the first part is copying
    deliver(producer, conn, wire.Cancel("s8"))
    engine.writes_held.clear()
    thread.join()
    # no FAIL "cancelled" ahead of bytes still landing: D keeps its blocks until the WRITE's own
    # answer, which a stream gives before its next part (nothing more is posted once cancelled)
    if stream_writes:
        assert sent_after_handshake(conn) == [("Streaming", None), ("Landed", (0,)), ("Fail", None)]
        assert not conn.sent[-1].may_still_land and "cancelled by decode" in conn.sent[-1].reason
        assert len(engine.posted) == 1
    else:
        assert sent_after_handshake(conn) == [("Done", None)]


def test_a_write_that_never_ends_fails_at_the_timeout_and_frees_the_blocks(setup):
    producer, engine, conn = setup(latency_s=60.0, drive_writes=False, timeout_s=0.2)
    register(producer, conn, "t9", [5])
    producer.offer("t9", "r9", [1], "D")
    record = wait_record(producer, timeout_s=3.0)
    assert not record.ok and "still copying 0.2 s after it was posted" in record.reason
    assert producer.take_freed() == ["r9"] and engine.released == []  # a posted WRITE cannot be called back
    assert isinstance(conn.sent[-1], wire.Fail) and conn.sent[-1].may_still_land  # D holds the blocks back
    engine.latency_s = 0.0  # the WRITE ends at last: D hears that nothing of it is left in flight
    deadline = time.monotonic() + HANG_S
    while not isinstance(conn.sent[-1], wire.Quiesced) and time.monotonic() < deadline:
        time.sleep(0.001)
    assert conn.sent[-1] == wire.Quiesced("t9") and engine.released == engine.posted


def test_decode_disconnecting_fails_its_writes_in_flight_at_once(setup):
    producer, engine, conn = setup(latency_s=60.0, drive_writes=False)
    register(producer, conn, "t10", [5])
    producer.offer("t10", "r10", [1], "D")
    producer._channel.on_closed(conn, "connection reset")
    assert producer._jobs.drain()
    record = producer.take_records()[0]
    assert not record.ok and "disconnected during the WRITE (connection reset)" in record.reason
    assert producer.take_freed() == ["r10"] and engine.released == []  # polled until it ends, then released


def test_a_registration_beyond_decodes_blocks_is_refused_on_arrival(setup):
    producer, engine, conn = setup()
    register(producer, conn, "t11", [3, REGIONS[0].num_blocks])
    assert isinstance(conn.sent[-1], wire.Fail) and "registered 64 blocks" in conn.sent[-1].reason
    producer.offer("t11", "r11", [1, 2], "D")  # its request's blocks are freed at once, nothing written
    assert producer.take_freed() == ["r11"] and not engine.posted
    assert producer.take_counts()["bad_registration"] == 1


def test_a_second_request_with_the_same_transfer_id_is_freed_and_decode_is_not_told(setup):
    producer, engine, conn = setup()
    producer.offer("t12", "r12", [1], "D")
    producer.offer("t12", "r12-bis", [2], "D")
    assert producer.take_freed() == ["r12-bis"] and len(conn.sent) == 1  # only the WELCOME
    register(producer, conn, "t12", [5])
    assert wait_record(producer).req_id == "r12" and isinstance(conn.sent[-1], wire.Done)


def test_a_second_hello_on_a_connection_does_not_change_whom_it_speaks_for(setup):
    producer, engine, conn = setup()
    deliver(producer, conn, wire.Hello("D2", 0, 1))
    deliver(producer, conn, wire.Layout("agent-D2", b"meta", IDENTITY, REGIONS, HEADS))
    assert conn.engine_id == "D#0" and len(engine.peers) == 1
    assert producer.take_counts() == {"repeated_hello": 1, "repeated_layout": 1}
    assert producer.take_counts() == {}  # each count is handed out once


def test_a_decode_rank_reaching_a_prefill_rank_without_its_heads_is_refused():
    """P TP2 rank 0 holds KV head 0 of 2; decode TP2 rank 1 holds head 1, which P rank 1 writes."""
    engine = FakeEngine()
    producer = Producer(ProducerConfig("P", LayoutIdentity("m", "bfloat16", 16, ("l0",), 2), frozenset({"D2"}),
                                       "127.0.0.1", 0, tp_rank=0, sharding=HeadSharding(2, 2)), engine)
    try:
        conn = FakeConn()
        shake(producer, conn, "D2", 1, 2, producer.config.identity)
        assert isinstance(conn.sent[-1], wire.Refuse)
        assert "decode rank 1 (TP 2) takes no KV heads from prefill rank 0 (TP 2, 2 KV heads)" in conn.sent[-1].reason
        assert engine.peers == []
    finally:
        producer.close()


def read_until(sock, reader, kind, timeout_s=2.0):
    sock.settimeout(timeout_s)
    got = []
    while not any(isinstance(m, kind) for m in got):
        got += [wire.decode(f) for f in reader.feed(sock.recv(65536))]
    return got


def frame(body: bytes) -> bytes:
    return wire.LENGTH.pack(len(body)) + body


def test_over_tcp_bad_frames_are_counted_and_the_frames_behind_them_still_served(setup):
    """A real socket to the producer's side channel: a frame that is not a valid message, in the
    same packet as valid ones, is counted and dropped; the PING behind it is still answered, and a
    block id past int64 is refused on the wire, not inside NumPy on the compute thread."""
    producer, engine, _ = setup()
    with socket.create_connection(("127.0.0.1", producer.port)) as sock:
        reader = wire.FrameReader()
        sock.sendall(wire.encode(wire.Hello("D2", 0, 1)) + wire.encode(wire.Layout("agent-D2", b"meta", IDENTITY, REGIONS, HEADS)))
        assert isinstance(read_until(sock, reader, wire.Welcome)[-1], wire.Welcome)
        nested = b"[" * 100_000 + b"]" * 100_000
        huge = b'{"type":"register","transfer_id":"x","block_ids":[%d],"first_block":0,"num_tokens":1}' % 2 ** 70
        sock.sendall(frame(b'{"type":[]}') + frame(nested) + frame(huge) + wire.encode(wire.Ping()))
        assert isinstance(read_until(sock, reader, wire.Pong)[-1], wire.Pong)
    counts, deadline = Counter(), time.monotonic() + HANG_S
    while counts["malformed"] < 3 and time.monotonic() < deadline:
        counts += producer.take_counts()
        time.sleep(0.01)
    assert counts["malformed"] == 3 and not producer._state.registrations


@pytest.mark.parametrize("stream_writes", [True, False])
def test_an_unexpected_error_in_a_write_costs_that_push_not_the_compute_thread(setup, stream_writes):
    producer, engine, conn = setup(stream_writes=stream_writes)

    def broken(*args, **kwargs):
        raise RuntimeError("engine bug")

    engine.prepare_parts = engine.post = broken
    register(producer, conn, "t13", [5, 6])
    producer.offer("t13", "r13", [1, 2], "D")  # returns: vLLM's engine goes on
    record = producer.take_records()[0]
    assert not record.ok and "prefill error during the WRITE: RuntimeError('engine bug')" in record.reason
    assert producer.take_freed() == ["r13"] and isinstance(conn.sent[-1], wire.Fail)
    assert not producer._writing


def test_a_withdrawn_push_fails_decode_frees_its_blocks_and_releases_the_write_made_ahead(setup):
    producer, engine, conn = setup(drive_writes=False)
    register(producer, conn, "t20", [5, 6])
    assert producer.prepare("t20", [1, 2], "D")
    made = engine.prepared[0][2]
    producer.withdraw("t20", "r20", "forward pass failed")
    assert producer.take_freed() == ["r20"] and made in engine.released and not engine.posted
    [fail] = [m for m in conn.sent if isinstance(m, wire.Fail)]
    assert fail.transfer_id == "t20" and "forward pass failed" in fail.reason


def test_a_push_withdrawn_before_decode_registered_is_failed_when_it_registers(setup):
    producer, engine, conn = setup(drive_writes=False)
    producer.withdraw("t21", "r21", "forward pass failed")
    assert producer.take_freed() == ["r21"]
    register(producer, conn, "t21", [5])
    [fail] = [m for m in conn.sent if isinstance(m, wire.Fail)]
    assert fail.transfer_id == "t21" and not engine.prepared and not engine.posted


def test_a_prefill_rank_writing_into_several_decode_ranks_does_not_stream():
    """P TP1 holds both KV heads; decode TP2's ranks take one each. Each gets the whole WRITE and
    DONE, never STREAMING: streamed one after the other, decode's ranks would wait for each
    other's layers in a spinning all-reduce."""
    identity = LayoutIdentity("m", "bfloat16", 16, ("l0", "l1"), 2)
    engine = FakeEngine()
    producer = Producer(ProducerConfig("P", identity, frozenset({"D"}), "127.0.0.1", 0, stream_writes=True,
                                       sharding=HeadSharding(2, 1), head_layouts=(HeadLayout(2, 2048, (0,)),)), engine)
    try:
        conns = [FakeConn(), FakeConn()]
        for rank, conn in enumerate(conns):
            shake(producer, conn, "D", rank, 2, identity, (Region(1 << 20, 2048, 2048, 64),), (HeadLayout.whole(2048),))
            assert isinstance(conn.sent[-1], wire.Welcome), conn.sent[-1]
            register(producer, conn, "t20", [5, 6])
        producer.offer("t20", "r20", [1, 2], "D", peer_tp_size=2)
        assert len(engine.posted) == 2 and all(isinstance(w, Write) for _, _, w in engine.prepared)  # whole WRITEs
        assert [type(m).__name__ for c in conns for m in c.sent[1:]] == ["Done", "Done"]
    finally:
        producer.close()


def test_a_prefill_rank_writing_into_one_decode_rank_of_a_tp_instance_streams():
    """P TP2 rank 0 and decode TP2 rank 0 hold KV head 0 of 2: one decode rank, streamed into."""
    identity = LayoutIdentity("m", "bfloat16", 16, ("l0", "l1"), 2)
    engine = FakeEngine()
    producer = Producer(ProducerConfig("P", identity, frozenset({"D"}), "127.0.0.1", 0, stream_writes=True,
                                       tp_rank=0, sharding=HeadSharding(2, 2)), engine)
    try:
        conn = FakeConn()
        shake(producer, conn, "D", 0, 2, identity)
        assert isinstance(conn.sent[-1], wire.Welcome), conn.sent[-1]
        register(producer, conn, "t21", [5, 6])
        producer.offer("t21", "r21", [1, 2], "D", peer_tp_size=2)
        assert [type(m).__name__ for m in conn.sent[1:]] == ["Streaming", "Landed", "Landed", "Done"]
    finally:
        producer.close()


@pytest.mark.parametrize("drive_writes", [True, False])
def test_writes_in_flight_long_are_polled_less_often_on_a_cpu_host_only(setup, drive_writes):
    from kvpush.connector.pushes import POLL_S
    from kvpush.connector.streamed_write import MAX_SLEEP_S
    producer, _, _ = setup(drive_writes=drive_writes)
    now = time.monotonic()
    producer._pushes.inflight = [SimpleNamespace(posted=now - 5.0)]
    assert producer._next_wait() == (MAX_SLEEP_S if drive_writes else POLL_S)
    producer._pushes.inflight.append(SimpleNamespace(posted=now + 1.0))  # a WRITE just posted sets the pace
    assert producer._next_wait() == POLL_S
    producer._pushes.inflight = []


def test_a_lost_sibling_rank_fails_every_waiting_registration_and_every_later_one_on_arrival(setup):
    producer, engine, conn = setup()
    register(producer, conn, "t30", [5])
    register(producer, conn, "t31", [6])
    producer.lose_instance("its rank process VLLM::Worker_TP1 (pid 7) ended")
    fails = [m for m in conn.sent if isinstance(m, wire.Fail)]
    assert sorted(f.transfer_id for f in fails) == ["t30", "t31"]
    assert all("can no longer prefill: its rank process VLLM::Worker_TP1 (pid 7) ended" in f.reason for f in fails)
    register(producer, conn, "t32", [7])
    assert isinstance(conn.sent[-1], wire.Fail) and conn.sent[-1].transfer_id == "t32"
    assert producer.take_counts().get("bad_registration", 0) == 0  # decode did nothing wrong
    producer.lose_instance("a second sibling ended")  # told once
    assert len([m for m in conn.sent if isinstance(m, wire.Fail)]) == 3


def test_after_a_lost_sibling_an_offer_writes_nothing_and_frees_its_blocks(setup):
    producer, engine, conn = setup()
    producer.lose_instance("its rank process VLLM::Worker_TP1 (pid 7) ended")
    register(producer, conn, "t33", [5])
    producer.offer("t33", "r33", [1], "D")
    producer.offer("t34", "r34", [2], "D")  # decode has not registered: failed when it does
    assert producer.take_freed() == ["r33", "r34"] and not engine.posted
    register(producer, conn, "t34", [6])
    assert [m.transfer_id for m in conn.sent if isinstance(m, wire.Fail)] == ["t33", "t34"]


def test_a_sibling_already_gone_when_watched_loses_the_instance_at_once(setup):
    producer, engine, conn = setup()
    register(producer, conn, "t35", [5])
    lost = threading.Event()
    producer.watch_siblings({}, ["VLLM::Worker_TP1 (pid 7)"], on_lost=lost.set)
    assert lost.wait(HANG_S)  # on the side channel thread, after decode was told
    [fail] = [m for m in conn.sent if isinstance(m, wire.Fail)]
    assert fail.transfer_id == "t35" and "VLLM::Worker_TP1 (pid 7) ended" in fail.reason


def test_after_a_lost_sibling_on_lost_waits_for_the_push_already_being_written(setup):
    producer, engine, conn = setup(drive_writes=False)
    engine.writes_held.set()
    register(producer, conn, "t36", [5])
    producer.offer("t36", "r36", [1], "D")  # matched: its WRITE is in flight
    lost = threading.Event()
    producer.watch_siblings({}, ["VLLM::Worker_TP1 (pid 7)"], on_lost=lost.set)
    time.sleep(0.05)  # the side channel thread has ticked meanwhile (it polls the WRITE in flight)
    assert not lost.is_set() and not [m for m in conn.sent if isinstance(m, wire.Fail)]
    engine.writes_held.clear()
    assert lost.wait(HANG_S)
    assert isinstance(conn.sent[-1], wire.Done)  # a push already matched still ends as it would have


@pytest.mark.parametrize("stream_writes", [True, False])
def test_a_match_from_a_connection_decode_has_since_replaced_is_refused_and_never_written(setup, monkeypatch, stream_writes):
    """Decode re-connects (a new handshake) between the match and the post: the registration came
    on the old connection, whose blocks decode has given up on. Neither written nor answered on the
    new connection; counted."""
    producer, engine, conn = setup(stream_writes=stream_writes)
    register(producer, conn, "t37", [5])
    write = producer._pushes.stream if stream_writes else producer._pushes.drive
    newer = FakeConn()

    def reconnect_then_write(match):
        shake(producer, newer, "D")  # admitted: the registration's connection is no longer the live one
        write(match)

    monkeypatch.setattr(producer._pushes, "stream" if stream_writes else "drive", reconnect_then_write)
    producer.offer("t37", "r37", [1], "D")
    record = wait_record(producer)
    assert not record.ok and "replaced the connection it registered this transfer on" in record.reason
    assert not engine.posted and producer.take_freed() == ["r37"]
    assert not [m for m in newer.sent if isinstance(m, (wire.Done, wire.Fail, wire.Streaming))]
    assert producer.take_counts()["stale_generation"] == 1


def test_a_cancel_that_arrives_after_the_match_stops_the_post(setup, monkeypatch):
    producer, engine, conn = setup()
    register(producer, conn, "t38", [5])
    drive = producer._pushes.drive

    def cancelled_then_drive(match):
        deliver(producer, conn, wire.Cancel("t38"))  # while the compute thread holds the match
        drive(match)

    monkeypatch.setattr(producer._pushes, "drive", cancelled_then_drive)
    producer.offer("t38", "r38", [1], "D")
    assert not engine.posted and producer.take_freed() == ["r38"]
    [fail] = [m for m in conn.sent if isinstance(m, wire.Fail)]  # one answer, after the compute thread's check
    assert fail.reason == "cancelled by decode before the WRITE" and not fail.may_still_land
