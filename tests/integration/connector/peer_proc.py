"""A prefill-side push peer in its own process, driven over stdin/stdout by the tests.

Commands (one JSON object per line): {"offer": [tid, req, [blocks], peer]}, {"accept": [tids]} (decode TP 1;
an entry [tid, tokens, digest] gives its request's prompt identity, which decode's registration must match),
{"abort": [tid, reason]}, {"prepare": [tid, [blocks], peer]} (prints {"prepared": bool}),
{"freed": true} -> prints {"freed": [...], "records": [...]}, {"registered": tid} -> prints
{"registered": bool} (whether decode's registration is here). Prints {"port": P} once ready.
With {"save_queue": true} in its config (a GPU's path: the side-channel thread polls the WRITEs),
{"save": [[tid, req, [blocks], peer], ...]} hands a step to a SaveQueue as wait_for_save does, its
forward pass standing in as a gate that {"forward_done": true} opens (oldest first).
With {"stop_before_post": N}, the process stops itself (SIGSTOP) just before its WRITE post number N
(from 0), so a test can stall it mid-stream at a known layer whatever the machine's load.
With {"stream_drive_s": S}, a streamed WRITE's part may take up to S seconds and still be announced
LANDED on its own (a loaded machine can make the first WRITE to a peer take longer than the default).
With {"stop_before_write": true}, it stops itself once it has matched its first offer with its
registration, before it checks that decode still wants the push and posts anything.
The status ({"freed": true}) also says how many NIXL peers it made ("peers_added").
With {"verify_kv": true}, it sends decode a digest of each push's KV (kv_digest.py); with
{"swap_dst_blocks": true} too, its WRITEs put each source block into another destination block
than decode registered for it (the first two swapped), as a block-mapping bug would.
"""
from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter, deque
from pathlib import Path

import numpy as np

from kvpush.common.kv_params import PromptIdentity
from kvpush.connector.consumer import Consumer, ConsumerConfig
from kvpush.connector.layout import TensorView, kv_regions
from kvpush.connector.metadata import SendSpec
from kvpush.connector.producer import Producer, ProducerConfig
from kvpush.connector import streamed_write
from kvpush.connector.save_order import SaveQueue
from kvpush.connector.kv_digest import HostMemory
from kvpush.connector.transfer import NixlEngine
from kvpush.connector.regions import LayoutIdentity


def kv_buffer(num_blocks: int, block_shape: tuple[int, ...], seed: int | None) -> np.ndarray:
    shape = (num_blocks, *block_shape)
    if seed is None:
        return np.zeros(shape, dtype=np.uint8)
    return np.random.default_rng(seed).integers(0, 256, size=shape, dtype=np.uint8)


def view_of(arr: np.ndarray) -> TensorView:
    return TensorView(arr.ctypes.data, arr.shape, tuple(s // arr.itemsize for s in arr.strides), arr.itemsize)


def layer_views(arr: np.ndarray, layers: int) -> list[TensorView]:
    """layers=0: the buffer is one region. Else `arr` is block-major `[blocks, layers, ...]` (vLLM's
    BLHNC) and each layer is a strided view, as vLLM hands the connector one per layer."""
    if not layers:
        return [view_of(arr)]
    return [view_of(arr[:, layer]) for layer in range(layers)]


def layer_major_buffer(num_blocks: int, layers: int, block_shape: tuple[int, ...], seed: int | None) -> np.ndarray:
    """`[layers, blocks, ...]`, one tensor per layer as vLLM's CPU cache (LBHNC): a run of blocks is
    one descriptor per layer, and a streamed WRITE goes one layer per part."""
    return kv_buffer(layers, (num_blocks, *block_shape), seed)


def identity(arr: np.ndarray, model: str = "test-model", layers: int = 0) -> LayoutIdentity:
    return LayoutIdentity(model, "uint8", 16, tuple(f"layer{i}" for i in range(max(layers, 1))), 1)


class DecodeSide:
    """A decode side in the test's own process: a zeroed KV buffer registered with NIXL, and a Consumer
    that accepts pushes from `prefill` (with the deployment's key when given)."""

    def __init__(self, engine_id: str, prefill: str, num_blocks: int, block_shape: tuple[int, ...],
                 key: bytes | None = None):
        self.engine_id = engine_id
        self.arr = kv_buffer(num_blocks, block_shape, None)
        regions = kv_regions([view_of(self.arr)], num_blocks)
        self.engine = NixlEngine(engine_id, regions)
        config = ConsumerConfig(engine_id, 0, identity(self.arr), frozenset({prefill}), timeout_s=5.0,
                                **({"side_channel_key": key} if key is not None else {}))
        self.consumer = Consumer(config, self.engine.name, self.engine.metadata, tuple(regions))

    def close(self) -> None:
        self.consumer.close()
        self.engine.close()


class PeerProcess:
    """Launcher side: runs this file as a child process and talks to it."""

    def __init__(self, engine_id: str, allowed: list[str], *, num_blocks: int, block_shape: tuple[int, ...],
                 seed: int | None, cpu_cores: str | None = None, **extra):
        cfg = {"engine_id": engine_id, "allowed": allowed, "num_blocks": num_blocks,
               "block_shape": list(block_shape), "seed": seed, **extra}
        env = {**os.environ, "UCX_MODULES": "^ib", "UCX_MEM_EVENTS": "no", "NIXL_LOG_LEVEL": "WARN"}
        pin = ["taskset", "--cpu-list", cpu_cores] if cpu_cores else []
        self.proc = subprocess.Popen([*pin, sys.executable, str(Path(__file__)), json.dumps(cfg)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env)
        self.port = json.loads(self.proc.stdout.readline())["port"]

    def send(self, **cmd) -> None:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def wait_registered(self, transfer_id: str, timeout_s: float = 20.0) -> None:
        """Until decode's registration for the transfer is here (a bound for a loaded machine)."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.send(registered=transfer_id)
            if json.loads(self.proc.stdout.readline())["registered"]:
                return
            assert time.monotonic() < deadline, f"decode's registration of {transfer_id} never reached P"
            time.sleep(0.01)

    def status(self) -> dict:
        self.send(freed=True)
        return json.loads(self.proc.stdout.readline())

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)


def wait_outcomes(consumer, n: int, timeout_s: float = 20.0) -> list:
    """The first n outcomes, waiting at most timeout_s (a bound for a loaded machine, not a speed goal)."""
    got, deadline = [], time.monotonic() + timeout_s
    while len(got) < n and time.monotonic() < deadline:
        got += consumer.take_outcomes()
        time.sleep(0.001)
    return got


class ForwardGate:
    """A forward pass's end on the stream, reached when the test says so."""

    def __init__(self):
        self._done = threading.Event()

    def synchronize(self) -> None:
        self._done.wait()

    def open(self) -> None:
        self._done.set()


def _stop_before_post(engine: NixlEngine, n: int) -> None:
    post, posted = engine.post, [0]

    def post_or_stop(*args, **kwargs):
        if posted[0] == n:
            os.kill(os.getpid(), signal.SIGSTOP)  # resumes here on SIGCONT
        posted[0] += 1
        return post(*args, **kwargs)

    engine.post = post_or_stop


def _stop_before_write(producer: Producer) -> None:
    pushes, stopped = producer._pushes, []
    for name in ("drive", "stream"):
        write = getattr(pushes, name)

        def stop_then_write(match, write=write):
            if not stopped:  # once: the writes after go on as usual
                stopped.append(True)
                os.kill(os.getpid(), signal.SIGSTOP)  # resumes here on SIGCONT
            return write(match)

        setattr(pushes, name, stop_then_write)


def _swap_dst_blocks(engine: NixlEngine) -> None:
    def swapped(dst):
        dst = list(dst)
        dst[:2] = dst[:2][::-1]
        return dst

    for name in ("prepare_write", "prepare_parts"):
        make = getattr(engine, name)
        setattr(engine, name, lambda peer, src, dst, *rest, make=make: make(peer, src, swapped(dst), *rest))


def _count_peers_added(engine: NixlEngine) -> Counter:
    added, add_peer = Counter(), engine.add_peer

    def counted(*args, **kwargs):
        peer = add_peer(*args, **kwargs)
        added["peers_added"] += 1
        return peer

    engine.add_peer = counted
    return added


def main() -> None:
    cfg = json.loads(sys.argv[1])
    layers = cfg.get("layers", 0)
    if cfg.get("layer_major"):
        arr = layer_major_buffer(cfg["num_blocks"], layers, tuple(cfg["block_shape"]), cfg["seed"])
        regions = kv_regions([view_of(layer) for layer in arr], cfg["num_blocks"])
    else:
        arr = kv_buffer(cfg["num_blocks"], tuple(cfg["block_shape"]), cfg["seed"])
        regions = kv_regions(layer_views(arr, layers), cfg["num_blocks"])
    engine = NixlEngine(cfg["engine_id"], regions)
    if "stop_before_post" in cfg:
        _stop_before_post(engine, cfg["stop_before_post"])
    if "stream_drive_s" in cfg:
        streamed_write.STREAM_DRIVE_S = cfg["stream_drive_s"]
    peers_added = _count_peers_added(engine)
    producer = Producer(ProducerConfig(cfg["engine_id"], identity(arr, cfg.get("model", "test-model"), layers),
                                       frozenset(cfg["allowed"]), "127.0.0.1", cfg.get("port", 0),
                                       cfg.get("timeout_s", 5.0), stream_writes=cfg.get("stream_writes", False),
                                       side_channel_key=bytes.fromhex(cfg.get("side_channel_key", "")),
                                       drive_writes=not cfg.get("save_queue", False),
                                       verify_kv=HostMemory() if cfg.get("verify_kv") else None),
                        engine)
    if cfg.get("swap_dst_blocks"):
        _swap_dst_blocks(engine)
    if cfg.get("stop_before_write"):
        _stop_before_write(producer)
    saves = SaveQueue(producer) if cfg.get("save_queue") else None
    gates: deque[ForwardGate] = deque()
    refused: Counter = Counter()
    # As vLLM's engine core does once started (vllm.utils.gc_utils.freeze_gc_heap): the start-up heap
    # is left out of every later collection, whose pauses then stop every thread, the reactor's too.
    gc.collect()
    gc.freeze()
    print(json.dumps({"port": producer.port}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if "offer" in cmd:
            producer.offer(*cmd["offer"])
        elif "accept" in cmd:
            # a transfer id, or [transfer id, prompt tokens, prompt digest]: its request's prompt
            producer.accept([(a, 1, None) if isinstance(a, str) else (a[0], 1, PromptIdentity(a[1], a[2]))
                             for a in cmd["accept"]])
        elif "abort" in cmd:
            producer.abort(*cmd["abort"])
        elif "registered" in cmd:
            print(json.dumps({"registered": producer.has_registration(cmd["registered"])}), flush=True)
        elif "prepare" in cmd:
            print(json.dumps({"prepared": producer.prepare(*cmd["prepare"])}), flush=True)
        elif "save" in cmd:
            gates.append(ForwardGate())
            saves.submit(gates[-1], [SendSpec(req, tid, tuple(blocks), peer) for tid, req, blocks, peer in cmd["save"]])
        elif "forward_done" in cmd:
            gates.popleft().open()
        elif "freed" in cmd:
            refused.update(producer.take_counts())  # what was dropped or refused, the reactor's own counts too
            recs = [r.__dict__ for r in producer.take_records()]
            outcomes = {k: v for k, v in producer.counters.items() if k in ("sent", "failed")}
            print(json.dumps({"freed": producer.take_freed(), "records": recs,
                              "counters": {**refused, **outcomes}, **peers_added}), flush=True)
    if saves is not None:
        saves.close()
    producer.close()


if __name__ == "__main__":
    main()
