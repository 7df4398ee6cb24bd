"""The connector's KV transfer engine between two processes, on GPU (VRAM) or CPU (DRAM) memory.

A prefill writer (this process) and a decode receiver (a child process) each allocate a KV cache
in one of vLLM's attention layouts (gpu_kv_layouts.py) and register it through kvpush's NixlEngine.
The writer runs the connector's prefill-side push service (producer.Producer), the receiver its
decode-side one (consumer.Consumer), which shakes hands over the side channel (agent metadata,
regions, device id) and registers its blocks for each push, as in a deployment. For each request
size and block pattern the writer pushes its blocks in each mode and the receiver checks every
byte after each push:
- producer: the connector's path on a GPU. D's Consumer registers its blocks; Producer.prepare
  makes the WRITE (the worker's save queue calls it while the forward's kernels still run);
  the clock starts at Producer.offer (prefill finished: the save queue saw the forward end) and the Producer's own
  records give "posted" and "DONE" (its side-channel thread polls completion every 0.2 ms);
- producer-late: the same without Producer.prepare (D registered after the forward pass started):
  offer makes and posts the WRITE;
- per-block: NixlEngine.write, prepared per-block descriptor lists (the engine before coalescing);
- coalesced: NixlEngine.write_coalesced, descriptors built per request from coalesced runs;
- prepared: the same WRITE made by NixlEngine.prepare_write before the clock starts (both block
  lists are known before the prefill ends: P allocates at scheduling) and only NixlEngine.post timed;
- raw: the same runs through nixl._api alone (own agent, no kvpush code, no progress thread),
  the floor for what NIXL itself costs.

    python benchmarks/gpu_transfer.py                      # H200: Qwen3-32B TP 8 shape, 1k/4k/16k
    python benchmarks/gpu_transfer.py --device cpu         # DRAM, small sizes
    python benchmarks/gpu_transfer.py --device cpu --layers 2 --tokens 64,256 --repeats 1 --json out.json

setup = from "prefill finished" (block lists known) to WRITE posted; total = to DONE at the
writer. prep = building the coalesced descriptors (coalesced: warm numpy time, part of setup;
prepared: prepare_write, off the critical path). GB/s counts bytes written over total; %copy
compares with a plain copy of the same number of bytes in the same process (torch, timed with
CUDA events on GPU).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

import numpy as np  # noqa: E402
import torch  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


def _import_connector():
    """kvpush's connector modules, installed or straight from this checkout (the GPU host has no
    kvpush install: `kvpush` becomes a namespace whose `connector` is the repo's connector/)."""
    try:
        import kvpush.connector.transfer  # noqa: F401
    except ImportError:
        import types

        for name in [m for m in sys.modules if m == "kvpush" or m.startswith("kvpush.")]:
            del sys.modules[name]
        pkg = types.ModuleType("kvpush")
        pkg.__path__ = [str(REPO)]
        sys.modules["kvpush"] = pkg
    from kvpush.connector import coalesce, consumer, layout, producer, transfer, wire

    return coalesce, consumer, layout, producer, transfer, wire


coalesce_mod, consumer_mod, layout_mod, producer_mod, transfer_mod, wire_mod = _import_connector()
WRITER_ENGINE, RECEIVER_ENGINE = "bench.prefill", "bench.decode"


def _identity(shape, regions, model_kv_heads: int = 1) -> "wire_mod.LayoutIdentity":
    """What both sides' push services compare at handshake (layer names sorted, as the connector's
    worker lists vLLM's)."""
    return wire_mod.LayoutIdentity("bench-model", str(shape.dtype).removeprefix("torch."), shape.block_size,
                                   tuple(sorted(layer_names(shape.num_layers))), model_kv_heads)


def layer_names(num_layers: int) -> list[str]:
    return [f"layer{i}" for i in range(num_layers)]


sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_kv_layouts as kvl  # noqa: E402


# ---- receiver (decode side, child process) -------------------------------------------------------
def receiver_main(conn, device: str) -> None:
    cache = engine = consumer = None
    try:
        while True:
            msg = conn.recv()
            op = msg[0]
            if op == "exit":
                break
            try:
                if op == "setup":
                    _, layout_name, shape = msg
                    cache = kvl.allocate(layout_name, shape, device)
                    kvl.poison(cache)
                    regions = layout_mod.kv_regions((layout_mod.TensorView.of(t) for t in cache.layers), shape.num_blocks)
                    engine = transfer_mod.NixlEngine(f"bench-decode-{layout_name}-{os.getpid()}", regions,
                                                     mem_type=_mem_type(device), device_id=_device_id(device))
                    consumer = consumer_mod.Consumer(
                        consumer_mod.ConsumerConfig(RECEIVER_ENGINE, 0, _identity(shape, regions),
                                                    frozenset({WRITER_ENGINE}), timeout_s=60.0),
                        engine.name, engine.metadata, tuple(regions), _device_id(device))
                    _sync(device)
                    conn.send(("ready", engine.metadata, tuple(regions)))
                elif op == "expect":  # D allocated blocks for a request: register them with P
                    _, tid, dst, port = msg
                    consumer.expect(f"req-{tid}", tid, WRITER_ENGINE, "127.0.0.1", port, list(dst), 0,
                                    len(dst) * 16)
                    conn.send(("ok",))
                elif op == "outcome":  # wait for P's DONE/FAIL of a push
                    _, tid, timeout_s = msg
                    deadline = time.monotonic() + timeout_s
                    outcome = None
                    while outcome is None and time.monotonic() < deadline:
                        outcome = next((o for o in consumer.take_outcomes() if o.pending.transfer_id == tid), None)
                        time.sleep(0.0005)
                    conn.send(("outcome", outcome is not None and outcome.ok,
                               "timed out" if outcome is None else outcome.reason))
                elif op == "outcomes":  # wait for P's DONE/FAIL of several pushes: {tid: (ok, reason)}
                    _, tids, timeout_s = msg
                    deadline = time.monotonic() + timeout_s
                    got: dict = {}
                    while len(got) < len(tids) and time.monotonic() < deadline:
                        got.update({o.pending.transfer_id: (o.ok, o.reason) for o in consumer.take_outcomes()
                                    if o.pending.transfer_id in tids})
                        time.sleep(0.0005)
                    conn.send(("outcomes", {tid: got.get(tid, (False, "timed out")) for tid in tids}))
                elif op == "poison":
                    kvl.poison(cache)
                    _sync(device)
                    conn.send(("ok",))
                elif op == "verify":
                    _, src, dst = msg
                    verdict = kvl.verify(cache, torch.as_tensor(src, device=device), torch.as_tensor(dst, device=device))
                    conn.send(("verdict", verdict))
                elif op == "teardown":
                    consumer.close()
                    engine.close()
                    engine = cache = consumer = None
                    _empty_cache(device)
                    conn.send(("ok",))
                else:
                    conn.send(("error", f"unknown op {op!r}"))
            except Exception:
                conn.send(("error", traceback.format_exc()))
    finally:
        if consumer is not None:
            consumer.close()
        if engine is not None:
            engine.close()


def _mem_type(device: str) -> str:
    return "VRAM" if device.startswith("cuda") else "DRAM"


def _device_id(device: str) -> int:
    return torch.device(device).index or 0 if device.startswith("cuda") else 0


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _empty_cache(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


class ChildProcess:
    """A spawned process running `target(conn, *args)`, driven over a pipe: each request is a
    tuple whose first item names it, each answer likewise ("error", traceback) on failure."""

    def __init__(self, name: str, target, *args):
        import multiprocessing as mp

        ctx = mp.get_context("spawn")  # CUDA cannot be used in a forked child
        self.name = name
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=target, args=(child, *args), daemon=True)
        self.proc.start()
        child.close()

    def call(self, *msg, timeout_s: float = 300.0):
        self.send(*msg)
        return self.answer(msg[0], timeout_s)

    def send(self, *msg) -> None:
        self.conn.send(msg)

    def answer(self, what: str, timeout_s: float = 300.0):
        """The answer to the request `what` sent last (raises on an error or no answer in time)."""
        if not self.conn.poll(timeout_s):
            raise RuntimeError(f"{self.name} did not answer {what!r} within {timeout_s:.0f} s")
        reply = self.conn.recv()
        if reply[0] == "error":
            raise RuntimeError(f"{self.name} failed on {what!r}:\n{reply[1]}")
        return reply

    def close(self) -> None:
        try:
            if self.proc.is_alive():
                self.conn.send(("exit",))
        except (BrokenPipeError, OSError):
            pass
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()


class Receiver(ChildProcess):
    def __init__(self, device: str):
        super().__init__("receiver", receiver_main, device)


# ---- block ids ------------------------------------------------------------------------------------
def contiguous_ids(rng: np.random.Generator, num_blocks: int, n: int) -> np.ndarray:
    start = int(rng.integers(0, num_blocks - n + 1))
    return np.arange(start, start + n, dtype=np.int64)


def fragmented_ids(rng: np.random.Generator, num_blocks: int, n: int, max_run: int) -> np.ndarray:
    """n distinct ids made of runs of 1..max_run consecutive blocks, in shuffled order, as a block
    pool that has seen many allocations and frees hands them out."""
    cuts, pos = [0], 0
    while pos < num_blocks:
        pos = min(num_blocks, pos + int(rng.integers(1, max_run + 1)))
        cuts.append(pos)
    runs = [np.arange(a, b) for a, b in zip(cuts[:-1], cuts[1:])]
    order = rng.permutation(len(runs))
    ids = np.concatenate([runs[i] for i in order])[:n]
    return ids.astype(np.int64)


def count_runs(src: np.ndarray, dst: np.ndarray) -> int:
    """Plain loop, independent of coalesce.block_runs: pairs adjacent on both sides share a run."""
    runs = 0
    for i in range(len(src)):
        if i == 0 or src[i] != src[i - 1] + 1 or dst[i] != dst[i - 1] + 1:
            runs += 1
    return runs


# ---- writer (prefill side, this process) ----------------------------------------------------------
@dataclass
class Sample:
    prepare_s: list[float] = field(default_factory=list)  # prepared mode: made before the critical path
    setup_s: list[float] = field(default_factory=list)  # call -> WRITE posted
    wait_s: list[float] = field(default_factory=list)  # posted -> DONE
    descriptors: int = 0
    verified_bytes: int = 0
    ok: bool = True


ENGINE_MODES = ("per-block", "coalesced", "prepared")
PRODUCER_MODES = ("producer", "producer-late")
RAW_VARIANTS = {
    # name: (progress thread delay in us or None for no progress thread, UCX backend num_threads)
    "raw": (None, 0),
    "raw-pt100": (100, 0),  # diagnosis: a progress thread paced like kvpush's engine
    "raw-pt0": (0, 0),  # diagnosis: nixl_agent's default, a spinning progress thread
    "raw-w4": (None, 4),  # diagnosis: UCX backend with 4 worker threads
}


class RawNixl:
    """The same WRITE through nixl._api alone: its own agent (by default without a progress
    thread: we poll), memory registered as allocated, descriptors handed in ready-made."""

    def __init__(self, name: str, variant: str, buffers: list[torch.Tensor], mem_type: str, device_id: int,
                 peer_metadata: bytes):
        from nixl._api import nixl_agent, nixl_agent_config

        delay_us, threads = RAW_VARIANTS[variant]
        self.mem_type = mem_type
        if delay_us is not None and delay_us > 0:
            # nixl_agent cannot pace its progress thread; borrow the engine's agent factory for it
            self.agent = transfer_mod._create_agent(name, "UCX", delay_us)
        else:
            self.agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=delay_us is not None,
                                                            num_threads=threads, backends=["UCX"]))
        spans = [(b.data_ptr(), b.numel() * b.element_size(), device_id, "") for b in buffers]
        self.registered = self.agent.register_memory(spans, mem_type)
        self.peer = self.agent.add_remote_agent(peer_metadata)
        self.agent.make_connection(self.peer)

    def write(self, local: np.ndarray, remote: np.ndarray) -> tuple[float, float]:
        t0 = time.perf_counter()
        handle = self.agent.initialize_xfer("WRITE", self.agent.get_xfer_descs(local, self.mem_type),
                                            self.agent.get_xfer_descs(remote, self.mem_type), self.peer)
        state = self.agent.transfer(handle)
        t1 = time.perf_counter()
        while state == "PROC":
            state = self.agent.check_xfer_state(handle)
        t2 = time.perf_counter()
        self.agent.release_xfer_handle(handle)
        if state != "DONE":
            raise RuntimeError(f"raw NIXL WRITE ended in state {state}")
        return t1 - t0, t2 - t1

    def close(self) -> None:
        self.agent.remove_remote_agent(self.peer)
        self.agent.deregister_memory(self.registered)


def engine_write(engine, peer, mode: str, src, dst):
    """(seconds made before the critical path, call -> posted, posted -> DONE, descriptors)."""
    prepare_s = 0.0
    if mode == "prepared":  # made when both block lists are known; only the post is timed
        t = time.perf_counter()
        w = engine.prepare_write(peer, src, dst)
        prepare_s = time.perf_counter() - t
    t0 = time.perf_counter()
    if mode == "per-block":
        w = engine.write(peer, src, dst)
    elif mode == "coalesced":
        w = engine.write_coalesced(peer, src, dst)
    else:
        engine.post(w, peer.agent_name)
    t1 = time.perf_counter()
    state = engine.state(w)
    while state == "PROC":
        state = engine.state(w)
    t2 = time.perf_counter()
    engine.release(w)
    if state != "DONE":
        raise RuntimeError(f"{mode} WRITE ended in state {state}")
    return prepare_s, t1 - t0, t2 - t1, w.num_descriptors


class ProducerPush:
    """The connector's prefill-side push service on the writer's engine, pushing to the receiver's
    Consumer over the side channel."""

    def __init__(self, engine, shape, regions, device: str):
        config = producer_mod.ProducerConfig(WRITER_ENGINE, _identity(shape, regions), frozenset({RECEIVER_ENGINE}),
                                             "127.0.0.1", 0, timeout_s=60.0,
                                             drive_writes=not device.startswith("cuda"))
        self.producer = producer_mod.Producer(config, engine)
        self.count = 0

    def push(self, receiver: "Receiver", mode: str, src: list[int], dst: list[int]):
        """(seconds of Producer.prepare, offer -> posted, posted -> DONE at P, descriptors)."""
        self.count += 1
        tid = f"{mode}-{self.count}"
        receiver.call("expect", tid, dst, self.producer.port)
        deadline = time.monotonic() + 30
        while not self.producer.has_registration(tid):  # D's registration travels the side channel
            if time.monotonic() > deadline:
                raise RuntimeError(f"no registration from the receiver for {tid}")
            time.sleep(0.0002)
        prepare_s = 0.0
        if mode == "producer":  # the worker's save() while the forward's kernels run
            t = time.perf_counter()
            if not self.producer.prepare(tid, src, RECEIVER_ENGINE):
                raise RuntimeError(f"Producer.prepare made no WRITE for {tid}")
            prepare_s = time.perf_counter() - t
        self.producer.offer(tid, f"req-{tid}", src, RECEIVER_ENGINE)  # wait_for_save: prefill finished
        record = None
        while record is None:
            record = next((r for r in self.producer.take_records() if r.transfer_id == tid), None)
            if record is None:
                time.sleep(0.0001)
        _, ok, reason = receiver.call("outcome", tid, 60.0)
        if not (record.ok and ok):
            raise RuntimeError(f"{mode} push {tid} failed: P: {record.reason or 'ok'}; D: {reason or 'ok'}")
        if record.prepared_ahead != (mode == "producer"):
            raise RuntimeError(f"{mode} push {tid}: prepared_ahead={record.prepared_ahead}")
        self.producer.take_freed()
        return prepare_s, record.posted - record.offered, record.finished - record.posted, record.num_descriptors

    def close(self) -> None:
        self.producer.close()


def copy_seconds(device: str, src: torch.Tensor, dst: torch.Tensor, nbytes: int, repeats: int = 5) -> float:
    """Median time of a plain copy of nbytes (the device's own ceiling for moving these bytes)."""
    a, b = src[:nbytes], dst[:nbytes]
    times = []
    for i in range(repeats + 1):
        if device.startswith("cuda"):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            b.copy_(a)
            end.record()
            end.synchronize()
            seconds = start.elapsed_time(end) / 1e3
        else:
            t0 = time.perf_counter()
            b.copy_(a)
            seconds = time.perf_counter() - t0
        if i:  # the first one warms up
            times.append(seconds)
    return statistics.median(times)


def median_seconds(fn, repeats: int = 20) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run_layout(args, receiver: Receiver, layout_name: str, rng: np.random.Generator, out: list[dict]) -> None:
    device = args.device
    shape = kvl.Shape(args.layers, args.num_blocks, args.block_size, args.kv_heads, args.head_dim)
    cache = kvl.allocate(layout_name, shape, device)
    kvl.fill(cache)
    _sync(device)
    regions = layout_mod.kv_regions((layout_mod.TensorView.of(t) for t in cache.layers), shape.num_blocks)
    engine = transfer_mod.NixlEngine(f"bench-prefill-{layout_name}-{os.getpid()}", regions,
                                     mem_type=_mem_type(device), device_id=_device_id(device),
                                     progress_delay_us=args.progress_delay_us)
    _, peer_meta, peer_regions = receiver.call("setup", layout_name, shape)
    pusher = ProducerPush(engine, shape, regions, device) if set(args.modes) & set(PRODUCER_MODES) else None
    if pusher is not None:  # the side channel's handshake adds the receiver as the engine's peer
        everything = np.arange(shape.num_blocks, dtype=np.int64).tolist()
        pusher.push(receiver, "producer", everything, everything)
        peer = pusher.producer.peer(RECEIVER_ENGINE)
    else:
        peer = engine.add_peer(peer_meta, peer_regions, _device_id(device))
    raws = {m: RawNixl(f"bench-{m}-{layout_name}-{os.getpid()}", m, cache.buffers, _mem_type(device),
                       _device_id(device), peer_meta) for m in args.modes if m in RAW_VARIANTS}
    plan = coalesce_mod.Plan.pair(regions, peer_regions, _device_id(device), _device_id(device))
    segments = plan.segments
    total_bytes = sum(b.numel() * b.element_size() for b in cache.buffers)
    max_bytes = -(-max(args.tokens) // args.block_size) * shape.bytes_per_block
    copy_src = torch.randint(0, 256, (max_bytes,), dtype=torch.uint8, device=device)
    copy_dst = torch.empty_like(copy_src)
    print(f"\n== layout {layout_name}: {len(regions)} regions -> {len(segments)} coalesced segments "
          f"(block {sorted({s.block_len for s in segments})} B, packed={all(s.packed for s in segments)}); "
          f"{shape.num_blocks} blocks x {shape.bytes_per_block} B = {total_bytes / 2**20:.0f} MiB per side", flush=True)
    try:
        # warm-up: connections, CUDA IPC mappings of the whole remote cache, code paths
        everything = np.arange(shape.num_blocks, dtype=np.int64)
        engine_write(engine, peer, "coalesced", everything, everything)
        engine_write(engine, peer, "prepared", everything, everything)
        engine_write(engine, peer, "per-block", everything[:4], everything[:4])
        for raw in raws.values():
            raw.write(*plan.descriptors(everything, everything))
        for tokens in args.tokens:
            n = -(-tokens // args.block_size)
            nbytes = n * shape.bytes_per_block
            copy_s = copy_seconds(device, copy_src, copy_dst, nbytes)
            for pattern_name in ("contiguous", "fragmented"):
                if pattern_name == "contiguous":
                    src, dst = contiguous_ids(rng, shape.num_blocks, n), contiguous_ids(rng, shape.num_blocks, n)
                else:
                    src = fragmented_ids(rng, shape.num_blocks, n, args.max_run)
                    dst = fragmented_ids(rng, shape.num_blocks, n, args.max_run)
                runs = count_runs(src, dst)
                local, remote = plan.descriptors(src, dst)  # the raw WRITEs' runs, built outside their timing
                src_list, dst_list = src.tolist(), dst.tolist()  # what vLLM hands the connector
                prep_s = median_seconds(lambda: plan.descriptors(src_list, dst_list))
                for mode in args.modes:
                    if mode == "per-block" and args.skip_per_block_over and n * len(regions) > args.skip_per_block_over:
                        continue
                    sample = Sample()
                    for _ in range(args.repeats):
                        receiver.call("poison")
                        if mode in raws:
                            setup_s, wait_s = raws[mode].write(local, remote)
                            sample.descriptors = len(local)
                        elif mode in PRODUCER_MODES:
                            prepare_s, setup_s, wait_s, sample.descriptors = pusher.push(receiver, mode, src_list, dst_list)
                            sample.prepare_s.append(prepare_s)
                        else:
                            prepare_s, setup_s, wait_s, sample.descriptors = engine_write(engine, peer, mode, src_list, dst_list)
                            sample.prepare_s.append(prepare_s)
                        sample.setup_s.append(setup_s)
                        sample.wait_s.append(wait_s)
                        _, verdict = receiver.call("verify", src, dst)
                        sample.ok &= verdict.ok
                        sample.verified_bytes += verdict.checked_bytes
                        if not verdict.ok:
                            print(f"   !! {mode}: {verdict.wrong_elements} wrong, {verdict.stray_elements} stray elements", flush=True)
                    made_s = (statistics.median(sample.prepare_s) if mode in ("prepared", "producer")
                              else prep_s if mode in ("coalesced", "producer-late") else 0.0)
                    record = _record(layout_name, tokens, n, pattern_name, mode, len(regions), len(segments), runs,
                                     nbytes, copy_s, made_s, sample)
                    out.append(record)
                    _print_row(record)
        _print_targets(layout_name, [r for r in out if r["layout"] == layout_name], max(args.tokens))
    finally:
        for raw in raws.values():
            raw.close()
        if pusher is not None:
            pusher.close()
        engine.close()
        receiver.call("teardown")
        del cache, copy_src, copy_dst
        _empty_cache(device)


def _record(layout_name, tokens, n, pattern_name, mode, num_regions, num_segments, runs, nbytes, copy_s, prep_s,
            s: Sample) -> dict:
    totals = [a + b for a, b in zip(s.setup_s, s.wait_s)]
    total = statistics.median(totals)
    gbps = nbytes / total / 1e9
    copy_gbps = nbytes / copy_s / 1e9
    return dict(layout=layout_name, tokens=tokens, blocks=n, pattern=pattern_name, mode=mode,
                descriptors_per_block=n * num_regions, descriptors=s.descriptors, runs=runs,
                expected_descriptors=runs * num_segments, bytes=nbytes, prep_ms=prep_s * 1e3,
                setup_ms=statistics.median(s.setup_s) * 1e3, wait_ms=statistics.median(s.wait_s) * 1e3,
                total_ms=total * 1e3, gbps=gbps, copy_gbps=copy_gbps, pct_copy=100 * gbps / copy_gbps,
                verified=s.ok, verified_bytes=s.verified_bytes, repeats=len(totals),
                setup_all_ms=[x * 1e3 for x in s.setup_s], total_all_ms=[x * 1e3 for x in totals])


HEADER = (f"{'tokens':>6} {'pattern':<10} {'mode':<9} {'blocks':>6} {'desc/blk':>8} {'runs':>6} {'desc':>7} "
          f"{'prep ms':>8} {'setup ms':>9} {'total ms':>9} {'GB/s':>7} {'copy GB/s':>9} {'%copy':>6}  bytes")
_printed_header = set()


def _print_row(r: dict) -> None:
    if r["layout"] not in _printed_header:
        _printed_header.add(r["layout"])
        print(HEADER, flush=True)
    ok = f"OK {r['verified_bytes'] / 2**20:.0f} MiB checked" if r["verified"] else "WRONG BYTES"
    print(f"{r['tokens']:>6} {r['pattern']:<10} {r['mode']:<9} {r['blocks']:>6} {r['descriptors_per_block']:>8} "
          f"{r['runs']:>6} {r['descriptors']:>7} {r['prep_ms']:>8.3f} {r['setup_ms']:>9.3f} {r['total_ms']:>9.3f} "
          f"{r['gbps']:>7.1f} {r['copy_gbps']:>9.1f} {r['pct_copy']:>6.1f}  {ok}", flush=True)


def _print_targets(layout_name: str, rows: list[dict], tokens: int) -> None:
    def pick(pattern, mode):
        return next((r for r in rows if r["tokens"] == tokens and r["pattern"] == pattern and r["mode"] == mode), None)

    print(f"-- targets, {layout_name}, {tokens} tokens (WRITE = prefill finished -> DONE; setup = -> posted):")
    # the connector's own path first; the engine-level modes where the producer ones did not run
    for mode, note in (("producer", "connector, WRITE made ahead"), ("producer-late", "connector, WRITE made at prefill end"),
                       ("coalesced", "engine alone")):
        c, f, fr = pick("contiguous", mode), pick("fragmented", mode), pick("fragmented", "raw")
        if not (c or f):
            continue
        print(f"   [{mode}: {note}]")
        if c:
            print(f"   contiguous WRITE {c['gbps']:.0f} GB/s = {c['pct_copy']:.1f}% of device copy (target >= 25%): "
                  f"{_pf(c['pct_copy'] >= 25)}")
            print(f"   contiguous setup {c['setup_ms']:.3f} ms (target < 1 ms): {_pf(c['setup_ms'] < 1.0)}")
        if f:
            print(f"   fragmented descriptors {f['descriptors']} = runs {f['runs']} x segments "
                  f"({f['expected_descriptors']}): {_pf(f['descriptors'] == f['expected_descriptors'])}")
        if f and fr:
            ratio = f["total_ms"] / fr["total_ms"]
            print(f"   fragmented WRITE {f['total_ms']:.2f} ms = {ratio:.2f}x raw NIXL's {fr['total_ms']:.2f} ms "
                  f"(target <= 1.5x): {_pf(ratio <= 1.5)}")
    print(f"   bytes verified on every run: {_pf(all(r['verified'] for r in rows))}", flush=True)


def _pf(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu")
    p.add_argument("--layouts", default="nhd,hnd,lbnhc,blnhc", help=f"comma list of {','.join(kvl.LAYOUTS)}")
    p.add_argument("--tokens", default=None, help="request sizes in tokens (default: 1024,4096,16384 on cuda; 256,1024 on cpu)")
    p.add_argument("--layers", type=int, default=None, help="default 64 on cuda (Qwen3-32B), 4 on cpu")
    p.add_argument("--kv-heads", type=int, default=1, help="KV heads per rank (Qwen3-32B at TP 8: 1)")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=None, help="per side (default: 2x the largest request + 64)")
    p.add_argument("--max-run", type=int, default=8, help="fragmented ids come in runs of 1..max-run blocks")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--modes", default="producer,producer-late,per-block,coalesced,raw",
                   help="comma list of " + ", ".join(PRODUCER_MODES + ENGINE_MODES + tuple(RAW_VARIANTS)))
    p.add_argument("--skip-per-block-over", type=int, default=0,
                   help="skip the per-block mode above this many per-block descriptors (0: never)")
    p.add_argument("--progress-delay-us", type=int, default=None,
                   help="the writer engine's NIXL progress-thread pause (default: the connector's for the memory type)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="also write every record to this file")
    args = p.parse_args(argv)
    on_gpu = args.device.startswith("cuda")
    args.tokens = [int(t) for t in (args.tokens or ("1024,4096,16384" if on_gpu else "256,1024")).split(",")]
    args.layers = args.layers or (64 if on_gpu else 4)
    args.layouts = args.layouts.split(",")
    args.modes = args.modes.split(",")
    bad_modes = [m for m in args.modes if m not in PRODUCER_MODES + ENGINE_MODES + tuple(RAW_VARIANTS)]
    if bad_modes:
        p.error(f"unknown modes {bad_modes}")
    unknown = [name for name in args.layouts if name not in kvl.LAYOUTS]
    if unknown:
        p.error(f"unknown layouts {unknown}; choose from {', '.join(kvl.LAYOUTS)}")
    max_blocks = -(-max(args.tokens) // args.block_size)
    args.num_blocks = args.num_blocks or 2 * max_blocks + 64
    if args.num_blocks < max_blocks:
        p.error(f"--num-blocks {args.num_blocks} is below the largest request's {max_blocks} blocks")
    return args


def describe_environment(device: str) -> None:
    from importlib import metadata

    versions = []
    for dist in ("nixl", "nixl-cu13", "nixl-cu12"):
        try:
            versions.append(f"{dist} {metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            pass
    where = torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") else "CPU (DRAM)"
    print(f"device: {where}; torch {torch.__version__}; {', '.join(versions) or 'nixl version unknown'}; "
          f"UCX_TLS={os.environ.get('UCX_TLS', '(default)')}", flush=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    describe_environment(args.device)
    print(f"shape: {args.layers} layers, {args.kv_heads} KV heads x {args.head_dim}, bf16, block size "
          f"{args.block_size}; {args.num_blocks} blocks per side; requests {args.tokens} tokens; "
          f"fragmented runs 1..{args.max_run} blocks; median of {args.repeats}", flush=True)
    rng = np.random.default_rng(args.seed)
    records: list[dict] = []
    failed: list[str] = []
    receiver = Receiver(args.device)
    try:
        for layout_name in args.layouts:
            try:
                run_layout(args, receiver, layout_name, rng, records)
                if args.json:  # after each layout, so a run cut short keeps what it measured
                    Path(args.json).write_text(json.dumps(records, indent=1))
            except Exception:  # report it, then carry on with the next layout and a fresh receiver
                traceback.print_exc()
                failed.append(layout_name)
                receiver.close()
                receiver = Receiver(args.device)
    finally:
        receiver.close()
    if args.json:
        Path(args.json).write_text(json.dumps(records, indent=1))
    if failed:
        print(f"\nlayouts that failed: {', '.join(failed)}", flush=True)
    ok = all(r["verified"] for r in records) and not failed and bool(records)
    print(f"\nall bytes verified: {ok} ({sum(r['verified_bytes'] for r in records) / 2**20:.0f} MiB checked "
          f"over {sum(r['repeats'] for r in records)} WRITEs)", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
