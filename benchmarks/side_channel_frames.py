"""What the side channel's per-frame MAC (connector/frame_mac.py) costs: frames/s and added
latency per frame, with and without it.

Two measures, each with the MAC (a side channel with the deployment's key: every frame after the
handshake sealed and checked) and without (no key: plain frames, the reactor path otherwise the
same):

1. `seal`: the CPU cost of sealing and opening one frame of each kind decode and prefill exchange
   (PING, DONE, a REGISTER of 16 and of 1,024 blocks), in one thread, no sockets.
2. `pingpong`: a real prefill side channel (Producer with a stand-in NIXL engine, its reactor
   thread) in a process of its own, and a decode client here over loopback TCP: PINGs one at a
   time (round-trip latency, median and p99), then `--burst` PINGs sent at once with their PONGs
   read back (frames/s through the reactor, each PING opened and its PONG sealed there).

Runs alternate MAC on and off `--rounds` times so load drift hits both alike.

    python benchmarks/side_channel_frames.py --rounds 5 --pings 2000 --burst 20000 --out FILE.json
"""
from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

from kvpush.connector import auth, frame_mac, wire
from kvpush.connector.regions import HeadLayout, LayoutIdentity, Region

KEY = bytes(range(32))
IDENTITY = LayoutIdentity("bench-model", "float32", 16, ("layer0",), 1)
REGIONS = (Region(1 << 20, 4096, 4096, 1 << 16),)
LAYOUT = wire.Layout("agent-D", b"meta", IDENTITY, REGIONS, (HeadLayout.whole(4096),))
FRAMES = {"ping": wire.Ping(), "done": wire.Done("cmpl-0123456789abcdef-0", 1 << 24),
          "register_16": wire.Register("cmpl-0123456789abcdef-0", tuple(range(1000, 1016)), 0, 256),
          "register_1024": wire.Register("cmpl-0123456789abcdef-0", tuple(range(10000, 11024)), 0, 16384)}


def seal_cost(repeats: int) -> dict:
    """Seconds per frame to encode, and to seal + open on top, by frame kind."""
    out = {}
    for name, msg in FRAMES.items():
        keys = frame_mac.session_keys(KEY, auth.new_nonce(), auth.new_nonce())
        sealer, opener = keys.sealer("decode"), keys.opener("prefill")
        plain = wire.encode(msg)
        started = time.perf_counter()
        for _ in range(repeats):
            wire.encode(msg)
        encode_s = (time.perf_counter() - started) / repeats
        started = time.perf_counter()
        for _ in range(repeats):
            opener.open(sealer.seal(plain)[wire.LENGTH.size:])
        out[name] = {"bytes": len(plain), "encode_us": encode_s * 1e6,
                     "seal_and_open_us": (time.perf_counter() - started) / repeats * 1e6}
    return out


def serve(key_hex: str) -> None:
    """The prefill side, in its own process: a Producer whose engine is a stand-in (no NIXL)."""
    from kvpush.connector.producer import Producer, ProducerConfig

    class Engine:
        regions, device_id = REGIONS, 0

        def add_peer(self, metadata, regions, device_id=0, segments=None):
            return SimpleNamespace(regions=tuple(regions))

        def release(self, write):
            pass

    producer = Producer(ProducerConfig("P.bench", IDENTITY, frozenset({"D.bench"}), "127.0.0.1", 0,
                                       side_channel_key=bytes.fromhex(key_hex)), Engine())
    print(json.dumps({"port": producer.port}), flush=True)
    sys.stdin.readline()
    producer.close()


class Client:
    """A decode rank on a raw socket: the handshake (with the key when given), then PINGs."""

    def __init__(self, port: int, key: bytes):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=30)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.reader = wire.FrameReader()
        self.sealer = self.opener = None
        hello = wire.Hello("D.bench", 0, 1, auth.new_nonce() if key else "")
        self.sock.sendall(wire.encode(hello))
        if key:
            challenge = self.read()
            digests = (auth.digest(wire.encode(hello)), auth.digest(wire.encode(LAYOUT)))
            keys = frame_mac.session_keys(key, hello.nonce, challenge.nonce)
            self.opener = keys.opener("decode")
            proof = auth.prove(key, "decode", challenge.nonce, hello.nonce, "D.bench", 0, *digests)
            self.sock.sendall(wire.encode(wire.Auth(proof, digests[1])))
            self.sealer = keys.sealer("decode")
        self.sock.sendall(self.frame(LAYOUT))
        assert isinstance(self.read(), wire.Welcome)

    def frame(self, msg) -> bytes:
        data = wire.encode(msg)
        return data if self.sealer is None else self.sealer.seal(data)

    def read(self) -> wire.Message:
        while (frame := self.reader.next_frame()) is None:
            data = self.sock.recv(1 << 16)
            if not data:
                raise ConnectionError("closed by prefill")
            self.reader.add(data)
        return wire.decode(frame if self.opener is None else self.opener.open(frame))

    def rtts(self, n: int) -> list[float]:
        out = []
        for _ in range(n):
            started = time.perf_counter()
            self.sock.sendall(self.frame(wire.Ping()))
            assert isinstance(self.read(), wire.Pong)
            out.append(time.perf_counter() - started)
        return out

    def burst(self, n: int) -> float:
        """Seconds for n PINGs sent at once and their n PONGs read back."""
        pings = [self.frame(wire.Ping()) for _ in range(n)]  # sealed in order, before the clock starts
        started = time.perf_counter()
        self.sock.sendall(b"".join(pings))
        for _ in range(n):
            assert isinstance(self.read(), wire.Pong)
        return time.perf_counter() - started


def pingpong(mac: bool, pings: int, burst: int) -> dict:
    key = KEY if mac else b""
    server = subprocess.Popen([sys.executable, __file__, "--serve", key.hex()], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        client = Client(json.loads(server.stdout.readline())["port"], key)
        client.rtts(200)  # warm
        rtts = sorted(client.rtts(pings))
        burst_s = client.burst(burst)
        client.sock.close()
    finally:
        server.stdin.close()
        server.wait(timeout=30)
    return {"mac": mac, "rtt_p50_us": statistics.median(rtts) * 1e6, "rtt_p99_us": rtts[int(len(rtts) * 0.99)] * 1e6,
            "rtt_max_us": rtts[-1] * 1e6, "burst_frames_per_s": 2 * burst / burst_s, "burst_pings": burst}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--pings", type=int, default=2000)
    parser.add_argument("--burst", type=int, default=20000)
    parser.add_argument("--seal-repeats", type=int, default=20000)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve is not None:
        serve(args.serve)
        return
    if args.out is None:
        parser.error("--out FILE.json is required")
    runs = [pingpong(mac, args.pings, args.burst) for _ in range(args.rounds) for mac in (False, True)]
    summary = {}
    for mac in (False, True):
        mine = [r for r in runs if r["mac"] is mac]
        summary["mac" if mac else "plain"] = {k: statistics.median(r[k] for r in mine)
                                              for k in ("rtt_p50_us", "rtt_p99_us", "burst_frames_per_s")}
    result = {"seal": seal_cost(args.seal_repeats), "pingpong_median_of_rounds": summary, "runs": runs,
              "args": {k: v for k, v in vars(args).items() if k not in ("out", "serve")}}
    args.out.write_text(json.dumps(result, indent=1, default=str))
    print(json.dumps({"seal": result["seal"], "pingpong": summary}, indent=1))


if __name__ == "__main__":
    main()
