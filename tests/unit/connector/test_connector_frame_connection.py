"""A side-channel connection after the handshake, over real loopback sockets with the real
producer and consumer: each frame in must carry its MAC, in sequence; a forged, replayed,
reordered or reflected frame closes the connection at once and is counted as bad_frame_mac, and
a fresh connection works. Decode treats such a close as a lost connection of its own making: what
was pending fails with its blocks fenced (P may still write)."""
from __future__ import annotations

import os
import socket
import time
from types import SimpleNamespace

import pytest

from kvpush.connector import auth, frame_mac, wire
from kvpush.connector.consumer import Consumer, ConsumerConfig
from kvpush.connector.producer import Producer, ProducerConfig
from kvpush.connector.regions import HeadLayout, LayoutIdentity, Region

KEY = b"k" * 32
IDENTITY = LayoutIdentity("m", "bfloat16", 16, ("l0",), 1)
REGIONS = (Region(1 << 20, 4096, 4096, 64),)
LAYOUT = wire.Layout("agent-D", b"meta", IDENTITY, REGIONS, (HeadLayout.whole(4096),))


class Engine:
    regions, device_id = REGIONS, 0

    def add_peer(self, metadata, regions, device_id=0, segments=None):
        return SimpleNamespace(regions=tuple(regions))

    def release(self, write):
        pass


def wait_for(predicate, timeout_s=30.0):  # a bound for what must happen, only to name a hang
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline
        time.sleep(0.01)


class Decode:
    """A raw decode rank with the key: the handshake, then sealed frames; `raw` keeps every byte
    prefill sent after its CHALLENGE, as an eavesdropper would have it."""

    def __init__(self, port: int):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=3)
        self.reader = wire.FrameReader()
        hello = wire.Hello("D", 0, 1, auth.new_nonce())
        self.sock.sendall(wire.encode(hello))
        challenge = wire.decode(self._frame())
        digests = (auth.digest(wire.encode(hello)), auth.digest(wire.encode(LAYOUT)))
        keys = frame_mac.session_keys(KEY, hello.nonce, challenge.nonce)
        self.sealer, self.opener = keys.sealer("decode"), keys.opener("decode")
        self.sock.sendall(wire.encode(wire.Auth(auth.prove(KEY, "decode", challenge.nonce, hello.nonce, "D", 0,
                                                           *digests), digests[1])) + self.sealed(LAYOUT))
        self.raw: list[bytes] = []
        assert isinstance(self.read(), wire.Welcome)

    def sealed(self, msg) -> bytes:
        return self.sealer.seal(wire.encode(msg))

    def _frame(self) -> bytes | None:
        while (frame := self.reader.next_frame()) is None:
            try:
                data = self.sock.recv(65536)
            except ConnectionResetError:
                return None
            if not data:
                return None
            self.reader.add(data)
        return frame

    def read(self):
        """P's next message (its tag checked), or None once P closed the connection."""
        frame = self._frame()
        if frame is None:
            return None
        self.raw.append(wire.LENGTH.pack(len(frame)) + frame)
        return wire.decode(self.opener.open(frame))


@pytest.fixture
def producer():
    p = Producer(ProducerConfig("P", IDENTITY, frozenset({"D"}), "127.0.0.1", 0, side_channel_key=KEY), Engine())
    yield p
    p.close()


def refused(p, d: Decode) -> None:
    """P closed the connection, counted the frame, and a fresh connection is welcomed and answered."""
    assert d.read() is None
    wait_for(lambda: p.take_counts().get("bad_frame_mac") == 1)
    fresh = Decode(p.port)
    fresh.sock.sendall(fresh.sealed(wire.Ping()))
    assert isinstance(fresh.read(), wire.Pong)


def test_prefill_seals_its_frames_and_answers_sealed_pings(producer):
    d = Decode(producer.port)
    for _ in range(3):
        d.sock.sendall(d.sealed(wire.Ping()))
        assert isinstance(d.read(), wire.Pong)
    assert d.raw[0][-frame_mac.TAG_BYTES:] != b"}" * frame_mac.TAG_BYTES  # WELCOME came with its tag
    with pytest.raises(wire.WireError):
        wire.decode(d.raw[1][wire.LENGTH.size:])  # a sealed frame is no plain message


@pytest.mark.parametrize("forged", [wire.Register("t1", (1, 2), 0, 32), wire.Cancel("t1"), wire.Ping()],
                         ids=lambda m: m.type)
def test_a_frame_without_a_tag_closes_the_connection(producer, forged):
    d = Decode(producer.port)
    d.sock.sendall(wire.encode(forged) + d.sealed(wire.Ping()))  # the PING behind it is never answered
    refused(producer, d)
    assert not producer.has_registration("t1")


def test_a_frame_with_a_made_up_tag_closes_the_connection(producer):
    d = Decode(producer.port)
    plain = wire.encode(wire.Register("t1", (1, 2), 0, 32))
    d.sock.sendall(wire.LENGTH.pack(len(plain) - wire.LENGTH.size + frame_mac.TAG_BYTES) + plain[wire.LENGTH.size:]
                   + os.urandom(frame_mac.TAG_BYTES))
    refused(producer, d)
    assert not producer.has_registration("t1")


def test_a_replayed_frame_closes_the_connection(producer):
    d = Decode(producer.port)
    register = d.sealed(wire.Register("t1", (1, 2), 0, 32))
    d.sock.sendall(register)
    wait_for(lambda: producer.has_registration("t1"))
    d.sock.sendall(register)
    refused(producer, d)


def test_frames_out_of_order_close_the_connection(producer):
    d = Decode(producer.port)
    first, second = d.sealed(wire.Register("t1", (1, 2), 0, 32)), d.sealed(wire.Ping())
    d.sock.sendall(second + first)
    refused(producer, d)
    assert not producer.has_registration("t1")


def test_prefill_s_own_frame_sent_back_to_it_closes_the_connection(producer):
    d = Decode(producer.port)
    d.sock.sendall(d.sealed(wire.Ping()))
    d.read()
    d.sock.sendall(d.raw[-1])  # P's PONG, reflected
    refused(producer, d)


def test_a_frame_cut_short_closes_the_connection(producer):
    d = Decode(producer.port)
    sealed = d.sealed(wire.Register("t1", (1, 2), 0, 32))
    body = sealed[wire.LENGTH.size:-3]
    d.sock.sendall(wire.LENGTH.pack(len(body)) + body)
    refused(producer, d)


class FakePrefill:
    """A prefill that proves the key to a real consumer, then sends what the test says."""

    def __init__(self, server: socket.socket):
        self.sock, _ = server.accept()
        self.sock.settimeout(5)
        self.reader = wire.FrameReader()
        hello = wire.decode(self.frame())
        nonce = auth.new_nonce()
        proof = auth.prove(KEY, "prefill", hello.nonce, nonce, "P", 0, auth.digest(wire.encode(hello)))
        self.sock.sendall(wire.encode(wire.Challenge("P", 0, nonce, proof)))
        keys = frame_mac.session_keys(KEY, hello.nonce, nonce)
        self.sealer, self.opener = keys.sealer("prefill"), keys.opener("prefill")
        assert isinstance(wire.decode(self.frame()), wire.Auth)
        layout = wire.decode(self.opener.open(self.frame()))  # D's LAYOUT comes sealed
        assert isinstance(layout, wire.Layout)
        self.sock.sendall(self.sealer.seal(wire.encode(wire.Welcome("P"))))

    def frame(self) -> bytes:
        while (frame := self.reader.next_frame()) is None:
            data = self.sock.recv(65536)
            assert data, "decode closed the connection"
            self.reader.add(data)
        return frame

    def next_message(self):
        return wire.decode(self.opener.open(self.frame()))


@pytest.mark.parametrize("attack", ["plain DONE", "DONE with a made-up tag", "replayed ACCEPTED",
                                    "reflected REGISTER"])
def test_decode_closes_a_connection_whose_frame_fails_and_fences_what_was_pending(attack):
    with socket.create_server(("127.0.0.1", 0)) as server:
        consumer = Consumer(ConsumerConfig("D", 0, IDENTITY, frozenset({"P"}), side_channel_key=KEY),
                            "agent-D", b"meta", REGIONS)
        try:
            consumer.expect("r1", "t1", "P", "127.0.0.1", server.getsockname()[1], [1, 2], 0, 32)
            p = FakePrefill(server)
            register = p.frame()  # as it came over the wire (sealed by D)
            assert isinstance(wire.decode(p.opener.open(register)), wire.Register)
            accepted = p.sealer.seal(wire.encode(wire.Accepted("t1")))
            p.sock.sendall(accepted)
            done = wire.encode(wire.Done("t1", 8192))
            forged = {"plain DONE": done,
                      "DONE with a made-up tag": wire.LENGTH.pack(len(done) - 4 + frame_mac.TAG_BYTES) + done[4:]
                      + os.urandom(frame_mac.TAG_BYTES),
                      "replayed ACCEPTED": accepted,
                      "reflected REGISTER": wire.LENGTH.pack(len(register)) + register}[attack]
            p.sock.sendall(forged)
            outcomes: list = []
            wait_for(lambda: outcomes.extend(consumer.take_outcomes()) or outcomes)
            [outcome] = outcomes
            assert not outcome.ok and outcome.may_still_land, outcome  # fenced: no evidence P stopped writing
            assert "MAC" in outcome.reason
            while p.sock.recv(65536):  # its PINGs, until decode closed the connection
                pass
            assert consumer.take_counts()["bad_frame_mac"] == 1
        finally:
            consumer.close()
