"""How long a prefill rank takes to admit a decode rank on a saturated host: the figure decode's
admission bound (liveness.DEFAULT_ADMISSION_S) is checked against.

A prefill side (NixlEngine + Producer with a side-channel key) runs in its own process with a
compute thread that keeps one core busy as vLLM's does (NumPy matmuls, which let the GIL go, between
stretches of Python, which hold it); `--busy-loops` processes spin beside it (`while 1: pass`).
Then, `--rounds` times, a new decode NIXL agent connects and does the whole handshake: HELLO ->
CHALLENGE timed, then AUTH and LAYOUT -> WELCOME timed (prefill makes the decode agent a NIXL peer
in between), and PINGs are timed on the admitted connection meanwhile.

    python benchmarks/side_channel_admission.py --rounds 30 --busy-loops 2 --out FILE.json
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

os.environ.setdefault("UCX_MODULES", "^ib")
os.environ.setdefault("UCX_MEM_EVENTS", "no")

from kvpush.connector import auth, frame_mac, wire  # noqa: E402
from kvpush.connector.regions import HeadLayout, LayoutIdentity, Region  # noqa: E402
from kvpush.connector.transfer import NixlEngine  # noqa: E402

KEY = bytes(range(32))
BLOCKS, BLOCK_BYTES, LAYERS = 256, 16384, 8
IDENTITY = LayoutIdentity("bench-model", "float32", 16, tuple(f"layer{i}" for i in range(LAYERS)), 2)


def regions_of(arr: np.ndarray) -> tuple[Region, ...]:
    """One region per layer of a layer-major [layers, blocks, bytes] buffer, as vLLM's CPU cache."""
    return tuple(Region(arr[i].ctypes.data, BLOCK_BYTES, BLOCK_BYTES, BLOCKS) for i in range(LAYERS))


def prefill() -> None:
    from kvpush.connector.producer import Producer, ProducerConfig

    arr = np.zeros((LAYERS, BLOCKS, BLOCK_BYTES), dtype=np.uint8)
    engine = NixlEngine("bench-prefill", regions_of(arr))
    producer = Producer(ProducerConfig("P.bench", IDENTITY, frozenset({"D.bench"}), "127.0.0.1", 0,
                                       side_channel_key=KEY), engine)

    def compute() -> None:  # the engine's compute thread: one core, the GIL now and then
        a = np.random.default_rng(0).random((256, 256))
        while True:
            a = np.tanh(a @ a)
            sum(i * i for i in range(2000))

    threading.Thread(target=compute, daemon=True).start()
    print(json.dumps({"port": producer.port}), flush=True)
    sys.stdin.readline()
    os._exit(0)


def read(sock: socket.socket, reader: wire.FrameReader, opener: frame_mac.FrameOpener | None = None) -> wire.Message:
    while (frame := reader.next_frame()) is None:
        data = sock.recv(65536)
        if not data:
            raise ConnectionError("closed by prefill")
        reader.add(data)
    return wire.decode(frame if opener is None else opener.open(frame))


def admit_once(port: int, round_: int) -> dict:
    arr = np.zeros((LAYERS, BLOCKS, BLOCK_BYTES), dtype=np.uint8)
    regions = regions_of(arr)
    engine = NixlEngine(f"bench-decode-{round_}", regions)
    try:
        sock = socket.create_connection(("127.0.0.1", port), timeout=120)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        reader = wire.FrameReader()
        hello = wire.Hello("D.bench", 0, 1, auth.new_nonce())
        layout = wire.Layout(engine.name, engine.metadata, IDENTITY, regions, tuple(HeadLayout.whole(BLOCK_BYTES)
                                                                                    for _ in regions))
        started = time.monotonic()
        sock.sendall(wire.encode(hello))
        challenge = read(sock, reader)
        challenged = time.monotonic()
        digests = (auth.digest(wire.encode(hello)), auth.digest(wire.encode(layout)))
        keys = frame_mac.session_keys(KEY, hello.nonce, challenge.nonce)  # every frame after AUTH carries its MAC
        sealer, opener = keys.sealer("decode"), keys.opener("decode")
        sock.sendall(wire.encode(wire.Auth(auth.prove(KEY, "decode", challenge.nonce, hello.nonce, "D.bench", 0, *digests),
                                           digests[1])) + sealer.seal(wire.encode(layout)))
        welcome = read(sock, reader, opener)
        admitted = time.monotonic()
        assert isinstance(welcome, wire.Welcome), welcome
        pings = []
        for _ in range(5):
            t0 = time.monotonic()
            sock.sendall(sealer.seal(wire.encode(wire.Ping())))
            assert isinstance(read(sock, reader, opener), wire.Pong)
            pings.append(time.monotonic() - t0)
            time.sleep(0.05)
        sock.close()
        return {"challenge_s": challenged - started, "admission_s": admitted - challenged, "ping_s": pings}
    finally:
        engine.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--busy-loops", type=int, default=2)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--prefill", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.prefill:
        prefill()
        return
    p = subprocess.Popen([sys.executable, __file__, "--prefill", "--out", str(args.out)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    busy = [subprocess.Popen([sys.executable, "-c", "while 1: pass"]) for _ in range(args.busy_loops)]
    try:
        port = json.loads(p.stdout.readline())["port"]
        time.sleep(2.0)
        rounds = [admit_once(port, i) for i in range(args.rounds)]
    finally:
        for proc in busy + [p]:
            proc.kill()
            proc.wait()
    summary = {key: {"p50_ms": statistics.median(r[key] for r in rounds) * 1e3,
                     "max_ms": max(r[key] for r in rounds) * 1e3} for key in ("challenge_s", "admission_s")}
    pings = [t for r in rounds for t in r["ping_s"]]
    summary["ping_after_admission"] = {"n": len(pings), "p50_ms": statistics.median(pings) * 1e3, "max_ms": max(pings) * 1e3}
    summary["settings"] = {"rounds": args.rounds, "busy_loops": args.busy_loops, "layers": LAYERS, "blocks": BLOCKS}
    args.out.write_text(json.dumps({"summary": summary, "rounds": rounds}))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
