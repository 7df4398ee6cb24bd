"""The TP instances of gpu_tp_fanout.py: a prefill and a decode instance of TP N, one child process
per rank. Each rank holds its own KV cache (rank r the model's KV heads connector/sharding.HeadSharding
gives it), registered through kvpush's NixlEngine, and runs the connector's push service for its
side: prefill rank r a Producer (side channel on the base port + r), decode rank r a Consumer.
Instances.push pushes one request from the chosen prefill ranks, released together by a barrier,
and returns every rank's records and the decode ranks' byte checks.
"""
from __future__ import annotations

import os
import random
import socket
import time
from dataclasses import asdict, dataclass

import gpu_bench_common as common
from gpu_bench_common import kvl, np, torch
from kvpush.connector import consumer as consumer_mod, layout as layout_mod, producer as producer_mod
from kvpush.connector import sharding as sharding_mod, transfer as transfer_mod, worker as worker_mod

PREFILL_ENGINE, DECODE_ENGINE = "fanout.prefill", "fanout.decode"
HOST = "127.0.0.1"
CALL_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class RankSpec:
    """One rank's cache and place in its instance (the same on both sides)."""

    layout: str
    shape: kvl.Shape  # this rank's cache: kv_heads = the heads it holds
    rank: int
    tp_size: int
    model_kv_heads: int
    base_port: int  # prefill rank r listens on base_port + r
    device: str

    @property
    def sharding(self) -> "sharding_mod.HeadSharding":
        return sharding_mod.HeadSharding(self.model_kv_heads, self.tp_size)

    @property
    def salt(self) -> int:
        """The pattern's salt: the rank's first global KV head (ranks holding the same heads hold the same KV)."""
        return self.sharding.heads_of(self.rank).start


class RankCache:
    """A rank's KV cache, its regions and head layouts (as the connector's worker computes them),
    registered with a NixlEngine."""

    def __init__(self, spec: RankSpec, side: str):
        self.spec = spec
        self.cache = kvl.allocate(spec.layout, spec.shape, spec.device)
        layers = self.cache.layers
        self.regions = layout_mod.kv_regions((layout_mod.TensorView.of(t) for t in layers), spec.shape.num_blocks)
        kv_caches = dict(zip(common.layer_names(spec.shape.num_layers), layers))
        self.head_layouts = worker_mod._head_layouts(kv_caches, self.regions, spec.shape.num_blocks,
                                                     spec.sharding.heads_per_rank)
        self.identity = common.layout_identity(spec.shape, spec.model_kv_heads)
        self.device_id = common.device_id(spec.device)
        self.engine = transfer_mod.NixlEngine(f"fanout-{side}-{spec.rank}-{os.getpid()}", self.regions,
                                                 mem_type=common.mem_type(spec.device), device_id=self.device_id)


def _closing(state: dict, service: str):
    """A rank process's cleanup: its push service, then its engine (whichever it got to make)."""
    def cleanup() -> None:
        if service in state:
            state[service].close()
        if "rc" in state:
            state["rc"].engine.close()
    return cleanup


# ---- prefill rank (child process) ------------------------------------------------------------------
def prefill_rank_main(conn, barrier, spec: RankSpec) -> None:
    state: dict = {}

    def setup():
        rc = state["rc"] = RankCache(spec, "prefill")
        kvl.fill(rc.cache, spec.salt)
        common.sync(spec.device)
        config = producer_mod.ProducerConfig(
            PREFILL_ENGINE, rc.identity, frozenset({DECODE_ENGINE}), HOST, spec.base_port + spec.rank, timeout_s=60.0,
            tp_rank=spec.rank, sharding=spec.sharding, head_layouts=rc.head_layouts,
            drive_writes=not spec.device.startswith("cuda"))
        state["producer"] = producer_mod.Producer(config, rc.engine)
        return ("ready", state["producer"].port)

    def arm(tid: str, src: list[int], joins: bool):
        """D's registrations are in: make the WRITE ahead (the save queue's prepare, during the forward)."""
        producer = state["producer"]
        if joins:
            deadline = time.monotonic() + 60
            while not producer.has_registration(tid, spec.tp_size):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"prefill rank {spec.rank}: no registration for {tid} from its decode ranks")
                time.sleep(0.0002)
            if not producer.prepare(tid, src, DECODE_ENGINE, spec.tp_size):
                raise RuntimeError(f"prefill rank {spec.rank}: Producer.prepare made no WRITE for {tid}")
        return ("armed",)

    def go(tid: str, src: list[int], joins: bool):
        """Wait for every prefill rank, then offer: the prefill finished on all ranks at once."""
        producer = state["producer"]
        barrier.wait(CALL_TIMEOUT_S)
        released = time.monotonic()
        if not joins:
            return ("sent", released, [])
        producer.offer(tid, f"req-{tid}", src, DECODE_ENGINE, spec.tp_size)
        expected = len(sharding_mod.targets_of(spec.rank, spec.sharding, spec.sharding))
        records, deadline = [], time.monotonic() + 60
        while len(records) < expected:
            records += [r for r in producer.take_records() if r.transfer_id == tid]
            if time.monotonic() > deadline:
                raise RuntimeError(f"prefill rank {spec.rank}: {tid} did not end within 60 s")
            time.sleep(0.0001)
        producer.take_freed()
        return ("sent", released, [asdict(r) for r in records])

    common.serve(conn, {"setup": setup, "arm": arm, "go": go}, _closing(state, "producer"))


# ---- decode rank (child process) -------------------------------------------------------------------
def decode_rank_main(conn, spec: RankSpec) -> None:
    state: dict = {}

    def setup():
        rc = state["rc"] = RankCache(spec, "decode")
        kvl.poison(rc.cache)
        common.sync(spec.device)
        config = consumer_mod.ConsumerConfig(DECODE_ENGINE, spec.rank, rc.identity, frozenset({PREFILL_ENGINE}),
                                                timeout_s=60.0, sharding=spec.sharding, head_layouts=rc.head_layouts)
        state["consumer"] = consumer_mod.Consumer(config, rc.engine.name, rc.engine.metadata, tuple(rc.regions),
                                                     rc.device_id)
        return ("ready", None)

    def expect(tid: str, dst: list[int]):
        """D allocated the request's blocks: poison them, register them with the prefill ranks."""
        kvl.poison(state["rc"].cache)
        common.sync(spec.device)
        state["consumer"].expect(f"req-{tid}", tid, PREFILL_ENGINE, HOST, spec.base_port, dst, 0,
                                 len(dst) * spec.shape.block_size, peer_tp_size=spec.tp_size)
        return ("expecting",)

    def outcome(tid: str, src: list[int], dst: list[int]):
        consumer, deadline, got = state["consumer"], time.monotonic() + 60, None
        while got is None and time.monotonic() < deadline:
            got = next((o for o in consumer.take_outcomes() if o.pending.transfer_id == tid), None)
            if got is None:
                time.sleep(0.0005)
        seen = time.monotonic()
        common.sync(spec.device)
        verdict = kvl.verify(state["rc"].cache, torch.as_tensor(src, device=spec.device),
                             torch.as_tensor(dst, device=spec.device), spec.salt)
        return ("outcome", got is not None and got.ok, "timed out" if got is None else got.reason, seen, verdict)

    common.serve(conn, {"setup": setup, "expect": expect, "outcome": outcome}, _closing(state, "consumer"))


# ---- the instances (this process) ------------------------------------------------------------------
def free_port_block(n: int) -> int:
    """A base port b with b .. b+n-1 free on HOST now (prefill rank r listens on b + r)."""
    for _ in range(200):
        base = random.randint(20000, 60000 - n)
        socks = []
        try:
            for i in range(n):
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                socks.append(s)
                s.bind((HOST, base + i))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {n} consecutive free ports on {HOST}")


def _all(children: list, what: str) -> list:
    return [c.answer(what, CALL_TIMEOUT_S) for c in children]


class Instances:
    """A prefill and a decode instance of TP `tp_size`, one process per rank."""

    def __init__(self, args, layout: str, tp_size: int, num_blocks: int):
        import multiprocessing as mp

        heads = sharding_mod.HeadSharding(args.kv_heads, tp_size).heads_per_rank
        self.shape = kvl.Shape(args.layers, num_blocks, args.block_size, heads, args.head_dim)
        self.tp_size = tp_size
        base_port = free_port_block(tp_size)
        barrier = mp.get_context("spawn").Barrier(tp_size)
        specs = [RankSpec(layout, self.shape, r, tp_size, args.kv_heads, base_port, args.device) for r in range(tp_size)]
        self.prefill: list = []
        self.decode: list = []
        try:
            for spec in specs:
                self.prefill.append(common.ChildProcess(f"prefill rank {spec.rank}", prefill_rank_main, barrier, spec))
                self.decode.append(common.ChildProcess(f"decode rank {spec.rank}", decode_rank_main, spec))
            for child in self.prefill + self.decode:
                child.send("setup")
            _all(self.prefill + self.decode, "setup")
        except BaseException:
            self.close()
            raise

    def push(self, tid: str, src: np.ndarray, dst: np.ndarray, ranks: list[int]) -> dict:
        """One request pushed by the prefill ranks `ranks` into their decode ranks, all released together."""
        src_list, dst_list = src.tolist(), dst.tolist()
        for r in ranks:
            self.decode[r].send("expect", tid, dst_list)
        _all([self.decode[r] for r in ranks], "expect")
        for r, p in enumerate(self.prefill):
            p.send("arm", tid, src_list, r in ranks)
        _all(self.prefill, "arm")
        for r in ranks:  # decode ranks wait for their outcome while the prefill ranks push
            self.decode[r].send("outcome", tid, src, dst)
        for r, p in enumerate(self.prefill):
            p.send("go", tid, src_list, r in ranks)
        sent = _all(self.prefill, "go")
        outcomes = dict(zip(ranks, _all([self.decode[r] for r in ranks], "outcome")))
        per_rank = []
        for r in ranks:
            (rec,) = sent[r][2]  # rank r writes into decode rank r only (equal TP)
            _, ok, reason, seen, verdict = outcomes[r]
            per_rank.append(dict(rank=r, offered=rec["offered"], posted=rec["posted"], finished=rec["finished"],
                                 seen_at_decode=seen, bytes=rec["num_bytes"], descriptors=rec["num_descriptors"],
                                 prepared_ahead=rec["prepared_ahead"], ok=rec["ok"] and ok,
                                 reason=rec["reason"] or reason, wrong_elements=verdict.wrong_elements,
                                 stray_elements=verdict.stray_elements, verified_bytes=verdict.checked_bytes,
                                 verified=verdict.ok and rec["ok"] and ok,
                                 expected_bytes=len(dst_list) * self.shape.bytes_per_block))
        return dict(released=min(s[1] for s in sent), ranks=per_rank)

    def close(self) -> None:
        for child in self.prefill + self.decode:
            child.close()
