"""P's side channel, split between its reactor thread and its transfer thread (producer_channel.py,
transfer_thread.py): over real loopback sockets, a decode rank authenticates, registers before and
after the offer, cancels, pings and hangs up, while a stand-in engine and the producer's lock
record every thread that calls them. The reactor thread must appear in neither: a PONG can then
never wait behind NIXL or behind a compute thread holding the lock."""
from __future__ import annotations

import socket
import threading
import time
from types import SimpleNamespace

import pytest

from kvpush.connector import auth, frame_mac, wire
from kvpush.connector.producer import Producer, ProducerConfig
from kvpush.connector.regions import HeadLayout, LayoutIdentity, Region
from kvpush.connector.transfer import Write

pytestmark = pytest.mark.unit

KEY = b"k" * 32
IDENTITY = LayoutIdentity("m", "bfloat16", 16, ("l0",), 1)
REGIONS = (Region(1 << 20, 4096, 4096, 64),)
HEADS = (HeadLayout.whole(4096),)
REACTOR = "kvpush-p-P"  # the reactor thread's name; the transfer thread's is REACTOR + "-transfer"
HANG_S = 30.0  # only to name a hang


class ThreadRecordingEngine:
    """A stand-in NIXL engine: records which thread makes each call; WRITEs complete at once."""

    regions, device_id = REGIONS, 0

    def __init__(self):
        self.calls: list[tuple[str, str]] = []  # (method, thread name)

    def _record(self, method: str) -> None:
        self.calls.append((method, threading.current_thread().name))

    def add_peer(self, metadata, regions, device_id=0, segments=None):
        self._record("add_peer")
        return SimpleNamespace(regions=tuple(regions))

    def prepare_write(self, peer, src, dst, notif=b""):
        self._record("prepare_write")
        return Write(object(), 4096 * len(src), 1)

    def prepare_parts(self, peer, src, dst):
        self._record("prepare_parts")
        return [(Write(object(), 4096 * len(src), 1), (0,))]

    def post(self, write, agent_name="peer"):
        self._record("post")

    def state(self, write):
        self._record("state")
        return "DONE"

    def release(self, write):
        self._record("release")


class ThreadRecordingLock:
    """The producer's lock, recording every thread that takes it."""

    def __init__(self):
        self._lock = threading.RLock()
        self.takers: set[str] = set()

    def __enter__(self):
        self.takers.add(threading.current_thread().name)
        return self._lock.__enter__()

    def __exit__(self, *exc):
        return self._lock.__exit__(*exc)

    def acquire(self, *args, **kwargs):
        self.takers.add(threading.current_thread().name)
        return self._lock.acquire(*args, **kwargs)

    def release(self):
        self._lock.release()


class Decode:
    """A raw decode rank over TCP, with the deployment's key."""

    def __init__(self, port: int):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=HANG_S)
        self.reader = wire.FrameReader()
        self.got: list = []
        self.sealer = self.opener = None  # the session's frame MAC, once the handshake made its keys

    def send(self, *msgs) -> None:
        self.sock.sendall(b"".join(wire.encode(m) if self.sealer is None else self.sealer.seal(wire.encode(m))
                                   for m in msgs))

    def read(self, kind):
        deadline = time.monotonic() + HANG_S
        while time.monotonic() < deadline:
            for m in self.got:
                if isinstance(m, kind):
                    self.got.remove(m)
                    return m
            self.got += [wire.decode(f if self.opener is None else self.opener.open(f))
                         for f in self.reader.feed(self.sock.recv(65536))]
        raise AssertionError(f"no {kind}")

    def handshake(self) -> None:
        hello = wire.Hello("D", 0, 1, auth.new_nonce())
        layout = wire.Layout("agent-D", b"meta", IDENTITY, REGIONS, HEADS)
        self.send(hello)
        challenge = self.read(wire.Challenge)
        digests = (auth.digest(wire.encode(hello)), auth.digest(wire.encode(layout)))
        keys = frame_mac.session_keys(KEY, hello.nonce, challenge.nonce)
        self.opener = keys.opener("decode")
        self.send(wire.Auth(auth.prove(KEY, "decode", challenge.nonce, hello.nonce, "D", 0, *digests), digests[1]))
        self.sealer = keys.sealer("decode")
        self.send(layout)
        self.read(wire.Welcome)


@pytest.mark.parametrize("stream_writes", [False, True])
def test_the_reactor_thread_never_calls_nixl_nor_takes_the_producer_lock(stream_writes):
    engine, lock = ThreadRecordingEngine(), ThreadRecordingLock()
    producer = Producer(ProducerConfig("P", IDENTITY, frozenset({"D"}), "127.0.0.1", 0, side_channel_key=KEY,
                                       stream_writes=stream_writes), engine)
    producer._lock = producer._pushes._lock = lock
    try:
        d = Decode(producer.port)
        d.handshake()  # add_peer
        d.send(wire.Register("early", (5, 6), 0, 32), wire.Ping())
        assert isinstance(d.read(wire.Pong), wire.Pong)
        wait_until(lambda: producer.has_registration("early"))
        producer.offer("early", "r1", [1, 2], "D")  # the compute thread writes it
        producer.offer("late", "r2", [3], "D")
        d.send(wire.Register("late", (7,), 0, 16))  # its offer came first: the transfer thread writes it
        assert d.read(wire.Done).transfer_id in ("early", "late")
        assert d.read(wire.Done).transfer_id in ("early", "late")
        producer.offer("cancelled", "r3", [4], "D")
        d.send(wire.Cancel("cancelled"), wire.Ping())
        d.read(wire.Pong)
        d.sock.close()  # the lost connection's cleanup
        wait_until(lambda: not producer._peers.conns)
    finally:
        producer.close()
    threads = {name for _, name in engine.calls}
    assert REACTOR not in threads and REACTOR not in lock.takers, (engine.calls, lock.takers)
    on_transfer_thread = {method for method, name in engine.calls if name == REACTOR + "-transfer"}
    assert {"add_peer", "prepare_write", "post"} <= on_transfer_thread  # the handshake's peer, the late WRITE


def wait_until(predicate) -> None:
    deadline = time.monotonic() + HANG_S
    while not predicate():
        assert time.monotonic() < deadline, "hang"
        time.sleep(0.005)


def test_a_ping_is_answered_while_the_compute_thread_holds_the_producer_lock():
    """The lock held (a long offer, a copy that waits on NIXL): PONG comes all the same; the
    REGISTER queued behind it is taken once the lock is free."""
    producer = Producer(ProducerConfig("P", IDENTITY, frozenset({"D"}), "127.0.0.1", 0, side_channel_key=KEY),
                        ThreadRecordingEngine())
    try:
        d = Decode(producer.port)
        d.handshake()
        with producer._lock:
            d.send(wire.Register("t", (5,), 0, 16), wire.Ping())
            assert isinstance(d.read(wire.Pong), wire.Pong)  # before the lock is let go
            assert not producer._state.registrations
        wait_until(lambda: producer.has_registration("t"))
    finally:
        producer.close()
