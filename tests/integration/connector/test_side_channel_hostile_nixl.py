"""A prefill's side channel under attack, with real NIXL between real processes: strangers hold
hundreds of connections open, send garbage, announce huge frames, and claim a real decode's
identity without the key. Each attack is refused and counted, while the deployment's own decode
keeps pushing byte-exact KV over its established connection and a decode that connects in the
middle of the flood still gets in."""
from __future__ import annotations

import contextlib
import os
import socket
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from peer_proc import DecodeSide, PeerProcess, kv_buffer, wait_outcomes  # noqa: E402

from kvpush.connector import auth, wire

NUM_BLOCKS, BLOCK_SHAPE, SEED = 64, (2, 16, 64), 11
KEY = bytes(range(32))
HELD_CONNECTIONS = 320  # past the cap of 256 strangers per listener
os.environ.update({"UCX_MODULES": "^ib", "UCX_MEM_EVENTS": "no", "NIXL_LOG_LEVEL": "WARN"})


class Decode(DecodeSide):
    def __init__(self, engine_id: str):
        super().__init__(engine_id, "P.h", NUM_BLOCKS, BLOCK_SHAPE, key=KEY)
        self.count = 0

    def push(self, peer: PeerProcess, rng) -> float:
        """One push of random blocks; seconds from registration to the landed outcome."""
        self.count += 1
        tid = f"{self.engine_id}-{self.count}"
        src = [int(b) for b in rng.choice(NUM_BLOCKS, 6, replace=False)]
        dst = [int(b) for b in rng.choice(NUM_BLOCKS, 6, replace=False)]
        self.arr[dst] = 0
        started = time.monotonic()
        self.consumer.expect(f"req-{tid}", tid, "P.h", "127.0.0.1", peer.port, dst, 0, 16 * len(dst))
        peer.send(offer=[tid, f"req-{tid}", src, self.engine_id])
        [outcome] = wait_outcomes(self.consumer, 1, timeout_s=20.0)
        took = time.monotonic() - started
        assert outcome.ok, outcome.reason
        assert np.array_equal(self.arr[dst], kv_buffer(NUM_BLOCKS, BLOCK_SHAPE, SEED)[src])
        return took


def connect(port: int) -> socket.socket | None:
    try:
        return socket.create_connection(("127.0.0.1", port), timeout=5)
    except OSError:
        return None


def forged_hello(decode: Decode) -> bytes:
    """A HELLO in a real decode's name, as a stranger who watched it can make one: everything but
    the key (its engine id and rank are no secret)."""
    return wire.encode(wire.Hello(decode.engine_id, 0, 1, nonce=auth.new_nonce()))


def attack(port: int, stop: threading.Event, held: list) -> None:
    rng = np.random.default_rng(5)
    while len(held) < HELD_CONNECTIONS and not stop.is_set():  # connections that never speak
        sock = connect(port)
        if sock is not None:
            held.append(sock)
    while not stop.is_set():
        for payload in (rng.integers(0, 256, 4096, dtype=np.uint8).tobytes(),  # garbage
                        wire.LENGTH.pack(9) + b"not json!",  # a frame that is no message
                        wire.LENGTH.pack(100 * 1024 * 1024) + b"x" * 1024,  # a huge frame announced
                        wire.encode(wire.Auth("00" * 32, "00" * 32))):  # a proof nobody asked for
            sock = connect(port)
            if sock is None:
                continue
            try:
                sock.sendall(payload)
            except OSError:
                pass
            sock.close()
        time.sleep(0.01)


def test_attacks_on_the_side_channel_are_refused_and_counted_while_real_pushes_go_on():
    peer = PeerProcess("P.h", ["D.h", "D.late"], num_blocks=NUM_BLOCKS, block_shape=BLOCK_SHAPE, seed=SEED,
                       side_channel_key=KEY.hex())
    decode, late, held, stop = Decode("D.h"), None, [], threading.Event()
    attacker = threading.Thread(target=attack, args=(peer.port, stop, held), daemon=True)
    rng = np.random.default_rng(3)
    try:
        calm = [decode.push(peer, rng) for _ in range(8)]  # also establishes D.h's proven connection
        attacker.start()
        while len(held) < HELD_CONNECTIONS and attacker.is_alive():
            time.sleep(0.05)
        under_attack = [decode.push(peer, rng) for _ in range(8)]
        late = Decode("D.late")  # a decode that first connects in the middle of the flood
        late.push(peer, rng)
        stop.set()
        attacker.join(timeout=30)
        counters = peer.status()["counters"]
        print(f"push p50: calm {statistics.median(calm) * 1e3:.1f} ms, "
              f"under attack {statistics.median(under_attack) * 1e3:.1f} ms; counters {counters}")
        assert counters.get("connection_cap", 0) >= HELD_CONNECTIONS - 256  # the oldest strangers made room
        assert counters.get("malformed", 0) >= 1  # frames that are no message
        assert counters.get("oversized_frame", 0) >= 1  # garbage and huge frames, refused on their length
        assert counters.get("unexpected_auth", 0) >= 1  # a proof without a challenge
        assert counters.get("sent") == len(calm) + len(under_attack) + 1
        # An engine thread blocked on a stranger would show as seconds per push, not a slower copy.
        assert statistics.median(under_attack) < 10 * statistics.median(calm) + 0.5
    finally:
        stop.set()
        for sock in held:
            sock.close()
        peer.kill()
        decode.close()
        if late is not None:
            late.close()


def test_a_stranger_claiming_a_real_decode_s_identity_never_displaces_it():
    peer = PeerProcess("P.h", ["D.h"], num_blocks=NUM_BLOCKS, block_shape=BLOCK_SHAPE, seed=SEED,
                       side_channel_key=KEY.hex())
    decode = Decode("D.h")
    rng = np.random.default_rng(4)
    try:
        decode.push(peer, rng)
        for _ in range(5):  # HELLO as D.h, then a proof made without the key
            sock = connect(peer.port)
            sock.settimeout(5)
            sock.sendall(forged_hello(decode))
            assert sock.recv(65536)  # prefill's CHALLENGE
            sock.sendall(wire.encode(wire.Auth("ab" * 32, "cd" * 32)))
            with contextlib.suppress(ConnectionResetError):
                assert sock.recv(65536) == b""  # closed by prefill: no WELCOME
            sock.close()
        decode.push(peer, rng)  # the established, proven connection still carries D.h's pushes
        counters = peer.status()["counters"]
        assert counters.get("failed_auth") == 5, counters
        assert counters.get("sent") == 2
    finally:
        peer.kill()
        decode.close()
