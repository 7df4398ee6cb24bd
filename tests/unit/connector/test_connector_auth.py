"""The side channel authenticated with the deployment's key, attacked over real loopback sockets:
who a peer is comes from its proof, a failed proof displaces nobody, reads and sends are bounded."""
from __future__ import annotations

import contextlib
import json
import socket
import time
from types import SimpleNamespace

import pytest

from kvpush.connector import auth, frame_connection, frame_mac, wire
from kvpush.connector.consumer import Consumer, ConsumerConfig
from kvpush.connector.producer import Producer, ProducerConfig
from kvpush.connector.regions import HeadLayout, LayoutIdentity, Region

KEY, OTHER_KEY = b"k" * 32, b"x" * 32
IDENTITY = LayoutIdentity("m", "bfloat16", 16, ("l0",), 1)
REGIONS = (Region(1 << 20, 4096, 4096, 64),)
HEADS = (HeadLayout.whole(4096),)


class Engine:
    regions, device_id = REGIONS, 0

    def __init__(self):
        self.peers = []

    def add_peer(self, metadata, regions, device_id=0, segments=None):
        self.peers.append(metadata)
        return SimpleNamespace(regions=tuple(regions))

    def release(self, write):
        pass


def hello(engine="D", rank=0, nonce=None):
    return wire.Hello(engine, rank, 1, nonce=auth.new_nonce() if nonce is None else nonce)


def layout(engine="D", metadata=b"meta"):
    return wire.Layout("agent-" + engine, metadata, IDENTITY, REGIONS, HEADS)


@pytest.fixture
def producer():
    made = []

    def make(**config):
        p = Producer(ProducerConfig("P", IDENTITY, frozenset({"D", "D2"}), "127.0.0.1", 0, side_channel_key=KEY,
                                    **config), Engine())
        made.append(p)
        return p

    yield make
    for p in made:
        p.close()


class Client:
    """A raw side-channel client, friend or foe."""

    def __init__(self, port: int):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=3)
        self.reader = wire.FrameReader()
        self.got: list = []
        self.sealer: frame_mac.FrameSealer | None = None  # once the handshake made the session keys
        self.opener: frame_mac.FrameOpener | None = None

    def frame(self, msg) -> bytes:
        data = wire.encode(msg)
        return data if self.sealer is None else self.sealer.seal(data)

    def send(self, msg) -> None:
        self.sock.sendall(self.frame(msg))

    def read(self, kind, timeout_s: float = 3.0):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for m in self.got:
                if isinstance(m, kind):
                    self.got.remove(m)
                    return m
            try:
                data = self.sock.recv(65536)
            except ConnectionResetError:  # closed with bytes of ours unread
                return None
            if not data:
                return None  # closed by the other side
            self.reader.add(data)
            while (f := self.reader.next_frame()) is not None:
                self.got.append(wire.decode(f if self.opener is None else self.opener.open(f)))
        raise AssertionError(f"no {kind.__name__} within {timeout_s} s")

    def handshake(self, key: bytes, engine="D", rank=0, lay=None, sent_layout=None):
        """HELLO, CHALLENGE, AUTH, LAYOUT: WELCOME or REFUSE (None: closed). The proof covers `lay`;
        `sent_layout`: a LAYOUT other than the one the proof covers."""
        h, lay = hello(engine, rank), lay or layout(engine)
        self.send(h)
        challenge = self.read(wire.Challenge)
        digest, layout_digest = auth.digest(wire.encode(h)), auth.digest(wire.encode(lay))
        assert auth.verify(key, challenge.proof, "prefill", challenge.nonce, h.nonce, "P", 0, digest)
        keys = frame_mac.session_keys(key, h.nonce, challenge.nonce)
        self.opener = keys.opener("decode")
        proof = wire.encode(wire.Auth(auth.prove(key, "decode", challenge.nonce, h.nonce, engine, rank, digest,
                                                 layout_digest), layout_digest))
        self.sealer = keys.sealer("decode")
        self.sock.sendall(proof + self.frame(sent_layout or lay))  # one write: the LAYOUT may ride with the AUTH
        return self.read((wire.Welcome, wire.Refuse))


def wait_for(predicate, timeout_s=30.0):  # a bound for what must happen, only to name a hang
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_a_decode_that_proves_the_key_is_welcomed(producer):
    p = producer()
    assert isinstance(Client(p.port).handshake(KEY), wire.Welcome)
    assert len(p.engine.peers) == 1


def test_a_peer_with_another_key_is_dropped_and_counted_and_displaces_nobody(producer):
    p = producer()
    real = Client(p.port)
    assert isinstance(real.handshake(KEY), wire.Welcome)
    impostor = Client(p.port)
    h = hello()  # the same, predictable engine id: "D"
    impostor.send(h)
    challenge = impostor.read(wire.Challenge)
    lay = auth.digest(wire.encode(layout()))
    impostor.send(wire.Auth(auth.prove(OTHER_KEY, "decode", challenge.nonce, h.nonce, "D", 0, auth.digest(wire.encode(h)),
                                       lay), lay))
    assert impostor.read(wire.Welcome) is None  # closed, nothing said
    real.send(wire.Ping())
    assert isinstance(real.read(wire.Pong), wire.Pong)  # the established peer still speaks for D
    assert len(p.engine.peers) == 1 and p.take_counts()["failed_auth"] == 1


def test_a_proof_recorded_from_one_handshake_fails_in_another(producer):
    p = producer()
    first = Client(p.port)
    h = hello()
    first.send(h)
    challenge = first.read(wire.Challenge)
    lay = auth.digest(wire.encode(layout()))
    stolen = wire.Auth(auth.prove(KEY, "decode", challenge.nonce, h.nonce, "D", 0, auth.digest(wire.encode(h)), lay), lay)
    replay = Client(p.port)
    replay.send(h)  # the same HELLO, and the proof made for the first connection's nonce
    replay.read(wire.Challenge)
    replay.send(stolen)
    assert replay.read(wire.Welcome) is None and p.take_counts()["failed_auth"] == 1


@pytest.mark.parametrize("first", [wire.Register("t1", (1, 2), 0, 32), wire.Ping(), wire.Cancel("t1"),
                                   wire.Auth("00" * 32, "00" * 32), layout()], ids=lambda m: m.type)
def test_anything_but_hello_before_the_proof_closes_the_connection(producer, first):
    p = producer()
    c = Client(p.port)
    c.send(first)
    assert c.read(wire.Challenge) is None  # closed: nothing behind it is read
    kind = {"auth": "unexpected_auth"}.get(first.type, "before_handshake")
    wait_for(lambda: p.take_counts().get(kind) == 1)
    assert p.engine.peers == [] and not p._peers.conns


@pytest.mark.parametrize("second", [hello(), wire.Register("t2", (1, 2), 0, 32), layout()], ids=lambda m: m.type)
def test_a_second_frame_other_than_auth_before_the_proof_closes_the_connection(producer, second):
    p = producer()
    c = Client(p.port)
    c.send(hello())
    c.read(wire.Challenge)
    c.send(second)
    assert c.read(wire.Welcome) is None
    kind = {"hello": "repeated_hello"}.get(second.type, "before_handshake")
    wait_for(lambda: p.take_counts().get(kind) == 1)
    assert p.engine.peers == []  # no NIXL peer from an unproven connection


def test_a_malformed_frame_before_the_proof_closes_the_connection(producer):
    p = producer()
    c = Client(p.port)
    c.sock.sendall(wire.LENGTH.pack(7) + b"garbage" + wire.encode(hello()))
    assert c.read(wire.Challenge) is None  # the valid HELLO behind it is never read
    assert p.take_counts()["malformed"] == 1


def test_a_layout_other_than_the_one_the_proof_covers_is_refused(producer):
    p = producer()
    c = Client(p.port)
    assert c.handshake(KEY, sent_layout=layout(metadata=b"swapped on the way")) is None
    wait_for(lambda: p.take_counts().get("failed_auth") == 1)
    assert p.engine.peers == []


def test_a_proven_peer_may_send_its_layout_in_the_same_read_as_its_proof(producer):
    """The LAYOUT (larger than an unproven peer's limit here) rides with the AUTH that proves D."""
    p = producer()
    c = Client(p.port)
    big = layout(metadata=bytes(3 * wire.MAX_UNAUTHENTICATED_FRAME_BYTES))
    assert isinstance(c.handshake(KEY, lay=big), wire.Welcome)
    assert p.engine.peers == [big.agent_metadata]
def test_a_hello_without_a_nonce_is_refused(producer):
    p = producer()
    c = Client(p.port)
    c.send(hello(nonce=""))
    refused = c.read(wire.Refuse)
    assert refused is not None and "no nonce" in refused.reason and "secret_file" in refused.reason


def test_a_connection_that_never_proves_itself_is_closed_at_the_deadline(producer):
    p = producer(auth_deadline_s=0.3)
    idle = Client(p.port)
    idle.send(hello())
    idle.read(wire.Challenge)
    assert idle.read(wire.Welcome, timeout_s=3.0) is None  # closed, not kept forever


@pytest.mark.parametrize("body", [b"{", json.dumps({"type": "hello", "engine_id": "D", "tp_rank": 0, "tp_size": 1,
                                                   "nonce": "", "pad": "x" * 8192}).encode()], ids=["cut", "whole"])
def test_a_frame_over_the_unproven_limit_is_refused_without_being_parsed(producer, monkeypatch, body):
    """Its length prefix alone closes the connection: the body is never decoded, however much
    of it was sent, and nothing behind it is read."""
    decoded = []
    real_decode = wire.decode
    monkeypatch.setattr(wire, "decode", lambda data: decoded.append(len(data)) or real_decode(data))
    p = producer()
    c = Client(p.port)
    with contextlib.suppress(OSError):  # the prefill may close while the rest is still being sent
        c.sock.sendall(wire.LENGTH.pack(max(len(body), wire.MAX_UNAUTHENTICATED_FRAME_BYTES + 1)) + body
                       + wire.encode(hello()))
    assert c.read(wire.Challenge) is None  # closed; the HELLO behind it never answered
    wait_for(lambda: p.take_counts().get("oversized_frame") == 1)
    assert decoded == []


def test_past_the_cap_the_oldest_stranger_makes_room_and_a_proven_peer_stays(producer):
    p = producer(max_connections=3)
    proven = Client(p.port)
    assert isinstance(proven.handshake(KEY), wire.Welcome)
    strangers = [Client(p.port) for _ in range(3)]  # the cap counts only these
    strangers[0].sock.settimeout(5.0)
    newcomer = Client(p.port)
    assert strangers[0].sock.recv(1) == b""  # the oldest stranger was closed for the newcomer
    assert isinstance(newcomer.handshake(KEY, engine="D2"), wire.Welcome)
    assert p.take_counts()["connection_cap"] == 1
    assert len(p._peers.conns) == 2  # the first proven peer was never displaced


def test_a_peer_that_never_reads_is_cut_off_and_sending_never_waits(producer, monkeypatch):
    monkeypatch.setattr(frame_connection, "MAX_QUEUED_BYTES", 1 << 20)
    p = producer()
    c = Client(p.port)
    assert isinstance(c.handshake(KEY), wire.Welcome)
    c.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    conn = next(iter(p._peers.conns.values()))
    sent = 0
    # a send that waited for the peer would hang here: the peer never reads
    while conn.send(wire.Fail("t" * 200, "x" * 4000)) and sent < 10_000:
        sent += 1
    assert sent < 10_000  # cut off at the queue's bound, not let through
    wait_for(lambda: conn.closed, 3.0)


def test_decode_refuses_a_prefill_that_cannot_prove_the_key():
    with socket.create_server(("127.0.0.1", 0)) as server:
        consumer = Consumer(ConsumerConfig("D", 0, IDENTITY, frozenset({"P"}), side_channel_key=KEY),
                            "agent-D", b"meta", REGIONS)
        try:
            consumer.expect("r", "t", "P", "127.0.0.1", server.getsockname()[1], [1], 0, 16)
            sock, _ = server.accept()
            reader = wire.FrameReader()
            got = []
            while not got:
                got = [wire.decode(f) for f in reader.feed(sock.recv(65536))]
            h = got[0]
            assert isinstance(h, wire.Hello) and h.nonce
            nonce = auth.new_nonce()
            forged = auth.prove(OTHER_KEY, "prefill", h.nonce, nonce, "P", 0, auth.digest(wire.encode(h)))
            sock.sendall(wire.encode(wire.Challenge("P", 0, nonce, forged)))
            # nothing may reach a prefill that failed its proof: only the HELLO was ever sent (no AUTH,
            # no LAYOUT with decode's NIXL metadata and memory regions, no REGISTER)
            outcomes: list = []
            wait_for(lambda: outcomes.extend(consumer.take_outcomes()) or outcomes)
            assert not outcomes[0].ok and "failed to prove it is P rank 0" in outcomes[0].reason
            sock.settimeout(0.5)
            rest = b""
            try:
                rest = sock.recv(65536)
            except TimeoutError:
                pass
            assert rest == b"", rest[:200]
            sock.close()
        finally:
            consumer.close()
