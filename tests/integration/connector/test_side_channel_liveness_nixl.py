"""A prefill's side channel keeps answering its proven decodes while strangers flood it, with
real NIXL between real processes: frames from peers that have not proven the key are refused on
their length prefix or their first wrong step, so a flood costs the reactor microseconds per
connection and a decode's PING is answered within 50 ms throughout (before the HELLO was split, one
1 MiB HELLO held the reactor for seconds)."""
from __future__ import annotations

import contextlib
import json
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from peer_proc import DecodeSide, PeerProcess, identity, kv_buffer, view_of, wait_outcomes  # noqa: E402

from kvpush.connector import auth, frame_mac, wire
from kvpush.connector.layout import kv_regions
from kvpush.connector.regions import HeadLayout
from kvpush.connector.transfer import NixlEngine

NUM_BLOCKS, BLOCK_SHAPE, SEED = 64, (2, 16, 64), 13
KEY = bytes(range(32))
FLOOD_S, FLOODERS = 8.0, 2
PONG_BOUND_S = 0.05
HERE = Path(__file__).parent


class ProvenDecode:
    """A decode rank on a raw socket: the whole handshake with the key and a real NIXL agent's
    LAYOUT, then PINGs timed one by one."""

    def __init__(self, port: int, engine_id: str = "D.ping"):
        self.arr = kv_buffer(NUM_BLOCKS, BLOCK_SHAPE, None)
        regions = tuple(kv_regions([view_of(self.arr)], NUM_BLOCKS))
        self.engine = NixlEngine(engine_id, regions)
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.reader = wire.FrameReader()
        self.opener: frame_mac.FrameOpener | None = None
        hello = wire.Hello(engine_id, 0, 1, auth.new_nonce())
        layout = wire.Layout(self.engine.name, self.engine.metadata, identity(self.arr), regions,
                             tuple(HeadLayout.whole(r.block_len) for r in regions))
        self.sock.sendall(wire.encode(hello))
        challenge = self.read()
        assert isinstance(challenge, wire.Challenge), challenge
        digests = (auth.digest(wire.encode(hello)), auth.digest(wire.encode(layout)))
        keys = frame_mac.session_keys(KEY, hello.nonce, challenge.nonce)  # every frame after AUTH carries its MAC
        self.sealer, self.opener = keys.sealer("decode"), keys.opener("decode")
        self.sock.sendall(wire.encode(wire.Auth(auth.prove(KEY, "decode", challenge.nonce, hello.nonce, engine_id, 0,
                                                           *digests), digests[1])) + self.sealer.seal(wire.encode(layout)))
        assert isinstance(self.read(), wire.Welcome)

    def read(self) -> wire.Message:
        while True:
            frame = self.reader.next_frame()
            if frame is not None:
                return wire.decode(frame if self.opener is None else self.opener.open(frame))
            data = self.sock.recv(65536)
            assert data, "prefill closed the proven decode's connection"
            self.reader.add(data)

    def ping(self) -> float:
        started = time.monotonic()
        self.sock.sendall(self.sealer.seal(wire.encode(wire.Ping())))
        assert isinstance(self.read(), wire.Pong)
        return time.monotonic() - started

    def close(self) -> None:
        self.sock.close()
        self.engine.close()


def push_once(decode: DecodeSide, peer: PeerProcess, tid: str) -> None:
    decode.consumer.expect(f"req-{tid}", tid, "P.l", "127.0.0.1", peer.port, [3, 4], 0, 32)
    peer.wait_registered(tid)
    peer.send(offer=[tid, f"req-{tid}", [10, 11], decode.engine_id])
    [outcome] = wait_outcomes(decode.consumer, 1)
    assert outcome.ok, outcome.reason
    assert np.array_equal(decode.arr[[3, 4]], kv_buffer(NUM_BLOCKS, BLOCK_SHAPE, SEED)[[10, 11]])


def test_pings_are_answered_within_50_ms_while_strangers_flood_the_side_channel():
    peer = PeerProcess("P.l", ["D.ping", "D.l"], num_blocks=NUM_BLOCKS, block_shape=BLOCK_SHAPE, seed=SEED,
                       side_channel_key=KEY.hex())
    pinger, decode, flooders = None, None, []
    try:
        pinger = ProvenDecode(peer.port)
        decode = DecodeSide("D.l", "P.l", NUM_BLOCKS, BLOCK_SHAPE, key=KEY)
        push_once(decode, peer, "before")
        calm = [pinger.ping() for _ in range(20)]
        flooders = [subprocess.Popen([sys.executable, str(HERE / "flood_proc.py"), str(peer.port), str(FLOOD_S)],
                                     stdout=subprocess.PIPE, text=True) for _ in range(FLOODERS)]
        time.sleep(0.5)  # the flood is under way
        flooded = []
        while all(f.poll() is None for f in flooders):
            flooded.append(pinger.ping())
            time.sleep(0.02)
        connections = sum(json.loads(f.communicate(timeout=30)[0])["connections"] for f in flooders)
        push_once(decode, peer, "after")  # real traffic unharmed
        counters = peer.status()["counters"]
        print(f"PONG: calm max {max(calm) * 1e3:.1f} ms; during a flood of {connections} connections "
              f"p50 {statistics.median(flooded) * 1e3:.1f} ms, max {max(flooded) * 1e3:.1f} ms over {len(flooded)} "
              f"pings; counters {counters}")
        assert connections >= 200 and len(flooded) >= 50, (connections, len(flooded))
        assert counters.get("oversized_frame", 0) >= connections // 6 - 1  # each 1 MiB HELLO, refused on its prefix
        assert counters.get("repeated_hello", 0) >= 1 and counters.get("failed_auth", 0) >= 1
        assert counters.get("malformed", 0) >= 1
        assert max(flooded) < PONG_BOUND_S, f"slowest PONG {max(flooded) * 1e3:.1f} ms during the flood"
    finally:
        for f in flooders:
            with contextlib.suppress(OSError):
                f.kill()
            f.wait(timeout=10)
        if pinger is not None:
            pinger.close()
        if decode is not None:
            decode.close()
        peer.kill()


def test_a_frame_over_the_cap_from_an_unproven_peer_is_refused_on_its_prefix():
    """A stranger announces 64 MiB and starts sending it: the connection is closed after the
    first read, counted, and the HELLO it puts behind is never answered."""
    peer = PeerProcess("P.l", ["D.ping"], num_blocks=NUM_BLOCKS, block_shape=BLOCK_SHAPE, seed=SEED,
                       side_channel_key=KEY.hex())
    try:
        sock = socket.create_connection(("127.0.0.1", peer.port), timeout=10)
        sent = 0
        with contextlib.suppress(OSError):  # reset by the prefill while still sending
            sock.sendall(wire.LENGTH.pack(64 << 20) + b"{" + wire.encode(wire.Hello("D.ping", 0, 1, auth.new_nonce())))
            for _ in range(64):
                sent += sock.send(b"x" * (1 << 20))
        with contextlib.suppress(ConnectionResetError):
            assert sock.recv(65536) == b""  # closed, no CHALLENGE
        sock.close()
        assert sent < 64 << 20  # the body was never read through
        assert peer.status()["counters"].get("oversized_frame") == 1
        pinger = ProvenDecode(peer.port)  # and a real decode still gets in
        pinger.ping()
        pinger.close()
    finally:
        peer.kill()
