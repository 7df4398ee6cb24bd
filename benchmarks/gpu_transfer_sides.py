"""The two ends of gpu_transfer.py's pushes: the decode receiver (a child process running the
connector's Consumer over a KV cache of its own) and the writer's ways to WRITE into it (raw NIXL,
kvpush's NixlEngine, the connector's Producer). gpu_wait_for_save.py pushes into the same receiver.
"""
from __future__ import annotations

import os
import time

import gpu_bench_common as common
from gpu_bench_common import kvl, np, torch
from kvpush.connector import consumer as consumer_mod, layout as layout_mod, producer as producer_mod
from kvpush.connector import transfer as transfer_mod

WRITER_ENGINE, RECEIVER_ENGINE = "bench.prefill", "bench.decode"
ENGINE_MODES = ("per-block", "coalesced", "prepared")
PRODUCER_MODES = ("producer", "producer-late")
RAW_VARIANTS = {
    # name: (progress thread delay in us or None for no progress thread, UCX backend num_threads)
    "raw": (None, 0),
    "raw-pt100": (100, 0),  # diagnosis: a progress thread paced like kvpush's engine
    "raw-pt0": (0, 0),  # diagnosis: nixl_agent's default, a spinning progress thread
    "raw-w4": (None, 4),  # diagnosis: UCX backend with 4 worker threads
}


# ---- receiver (decode side, child process) -------------------------------------------------------
def receiver_main(conn, device: str) -> None:
    state: dict = {}

    def setup(layout_name: str, shape: "kvl.Shape"):
        cache = state["cache"] = kvl.allocate(layout_name, shape, device)
        kvl.poison(cache)
        regions = layout_mod.kv_regions((layout_mod.TensorView.of(t) for t in cache.layers), shape.num_blocks)
        engine = state["engine"] = transfer_mod.NixlEngine(f"bench-decode-{layout_name}-{os.getpid()}", regions,
                                                           mem_type=common.mem_type(device),
                                                           device_id=common.device_id(device))
        state["consumer"] = consumer_mod.Consumer(
            consumer_mod.ConsumerConfig(RECEIVER_ENGINE, 0, common.layout_identity(shape), frozenset({WRITER_ENGINE}),
                                        timeout_s=60.0),
            engine.name, engine.metadata, tuple(regions), common.device_id(device))
        common.sync(device)
        return ("ready", engine.metadata, tuple(regions))

    def expect(tid: str, dst, port: int):
        """D allocated blocks for a request: register them with P."""
        state["consumer"].expect(f"req-{tid}", tid, WRITER_ENGINE, "127.0.0.1", port, list(dst), 0, len(dst) * 16)
        return ("ok",)

    def outcome(tid: str, timeout_s: float):
        """Wait for P's DONE/FAIL of a push."""
        deadline = time.monotonic() + timeout_s
        found = None
        while found is None and time.monotonic() < deadline:
            found = next((o for o in state["consumer"].take_outcomes() if o.pending.transfer_id == tid), None)
            time.sleep(0.0005)
        return ("outcome", found is not None and found.ok, "timed out" if found is None else found.reason)

    def outcomes(tids, timeout_s: float):
        """Wait for P's DONE/FAIL of several pushes: {tid: (ok, reason)}."""
        deadline = time.monotonic() + timeout_s
        got: dict = {}
        while len(got) < len(tids) and time.monotonic() < deadline:
            got.update({o.pending.transfer_id: (o.ok, o.reason) for o in state["consumer"].take_outcomes()
                        if o.pending.transfer_id in tids})
            time.sleep(0.0005)
        return ("outcomes", {tid: got.get(tid, (False, "timed out")) for tid in tids})

    def poison():
        kvl.poison(state["cache"])
        common.sync(device)
        return ("ok",)

    def verify(src, dst):
        return ("verdict", kvl.verify(state["cache"], torch.as_tensor(src, device=device),
                                      torch.as_tensor(dst, device=device)))

    def digest(dst):
        """verify_kv's digest of these blocks on this side, and how long it took (median of 3)."""
        from kvpush.connector import kv_digest
        from kvpush.connector.regions import HeadLayout

        regions = state["engine"].regions
        slices = kv_digest.decode_slices(regions, [HeadLayout.whole(r.block_len) for r in regions], 0, 1, whole=True)
        memory = kv_digest.HostMemory() if device == "cpu" else kv_digest.TorchMemory(state["cache"].buffers)
        times, value = [], 0
        for _ in range(3):
            t0 = time.perf_counter()
            value = kv_digest.digest(memory, slices, list(dst))
            times.append(time.perf_counter() - t0)
        return ("digest", value, sorted(times)[1])

    def teardown():
        state.pop("consumer").close()
        state.pop("engine").close()
        state.pop("cache")
        common.empty_cache(device)
        return ("ok",)

    def cleanup():
        if "consumer" in state:
            state["consumer"].close()
        if "engine" in state:
            state["engine"].close()

    common.serve(conn, {"setup": setup, "expect": expect, "outcome": outcome, "outcomes": outcomes, "poison": poison,
                        "verify": verify, "digest": digest, "teardown": teardown}, cleanup)


class Receiver(common.ChildProcess):
    def __init__(self, device: str):
        super().__init__("receiver", receiver_main, device)


# ---- writer (prefill side, the benchmark's process) ----------------------------------------------
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

    def __init__(self, engine, shape: "kvl.Shape", device: str):
        config = producer_mod.ProducerConfig(WRITER_ENGINE, common.layout_identity(shape), frozenset({RECEIVER_ENGINE}),
                                             "127.0.0.1", 0, timeout_s=60.0,
                                             drive_writes=not device.startswith("cuda"))
        self.producer = producer_mod.Producer(config, engine)
        self.count = 0

    def push(self, receiver: Receiver, mode: str, src: list[int], dst: list[int]):
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
