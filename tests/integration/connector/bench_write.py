"""WRITE throughput of the push path vs a plain memory copy of the same bytes (prints numbers;
speed is not asserted). A Producer in a child process pushes into this process's buffer.

    python tests/integration/connector/bench_write.py [--mib 256] [--block-kib 128] [--rounds 3]
        [--writer-core 0 --receiver-core 1]   # each side on one core, as in a CPU deployment
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

os.environ.update({"UCX_MODULES": "^ib", "UCX_MEM_EVENTS": "no", "NIXL_LOG_LEVEL": "WARN"})
sys.path.insert(0, str(Path(__file__).parent))

from peer_proc import PeerProcess, identity, kv_buffer, view_of, wait_outcomes  # noqa: E402

from kvpush.connector.consumer import Consumer, ConsumerConfig  # noqa: E402
from kvpush.connector.layout import kv_regions  # noqa: E402
from kvpush.connector.transfer import NixlEngine  # noqa: E402

SEED = 3


def memcpy_gbps(arr_shape: tuple[int, ...], src: list[int], dst: list[int]) -> tuple[float, float]:
    a = kv_buffer(arr_shape[0], arr_shape[1:], SEED)
    b = np.zeros_like(a)
    np.copyto(b, a)  # fault the pages in first
    t = time.perf_counter(); np.copyto(b, a); flat = a.nbytes / (time.perf_counter() - t) / 1e9
    t = time.perf_counter(); b[dst] = a[src]; scattered = a[src].nbytes / (time.perf_counter() - t) / 1e9
    return flat, scattered


def run(mib: int, block_kib: int, rounds: int, writer_core: str | None = None,
        receiver_core: int | None = None) -> list[dict]:
    if receiver_core is not None:
        os.sched_setaffinity(0, {receiver_core})  # before NIXL starts its threads, so they inherit it
    block_shape = (block_kib, 1024)
    num_blocks = mib * 1024 // block_kib
    arr = kv_buffer(num_blocks, block_shape, None)
    regions = kv_regions([view_of(arr)], num_blocks)
    engine = NixlEngine("D.bench", regions)
    consumer = Consumer(ConsumerConfig("D.bench", 0, identity(arr), frozenset({"P.bench"}), timeout_s=30),
                        engine.name, engine.metadata, tuple(regions))
    peer = PeerProcess("P.bench", ["D.bench"], num_blocks=num_blocks, block_shape=block_shape, seed=SEED,
                       cpu_cores=writer_core)
    expected = kv_buffer(num_blocks, block_shape, SEED)
    rng = np.random.default_rng(0)
    results = []
    try:
        for pattern in ("contiguous", "random"):
            for r in range(rounds):
                src = list(range(num_blocks))
                dst = list(range(num_blocks)) if pattern == "contiguous" else [int(x) for x in rng.permutation(num_blocks)]
                arr[:] = 0
                tid = f"{pattern}-{r}"
                consumer.expect("rq", tid, "P.bench", "127.0.0.1", peer.port, dst, 0, num_blocks)
                time.sleep(0.1)
                peer.send(offer=[tid, "pr", src, "D.bench"])
                [outcome] = wait_outcomes(consumer, 1, timeout_s=60)
                assert outcome.ok, outcome.reason
                assert np.array_equal(arr[dst], expected[src]), "bytes differ"
                [rec] = peer.status()["records"]
                seconds = rec["finished"] - rec["offered"]  # the copy may run inside the post call
                flat, scattered = memcpy_gbps(arr.shape, src, dst)
                results.append({"pattern": pattern, "bytes": rec["num_bytes"], "write_s": seconds,
                                "write_gbps": rec["num_bytes"] / seconds / 1e9, "memcpy_gbps": flat,
                                "memcpy_same_pattern_gbps": scattered})
    finally:
        peer.kill()
        consumer.close()
        engine.close()
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--block-kib", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--writer-core", help="pin the writing (prefill) process to these cores, e.g. 0")
    ap.add_argument("--receiver-core", type=int, help="pin the receiving (decode) process to this core, e.g. 1")
    args = ap.parse_args(argv)
    for res in run(args.mib, args.block_kib, args.rounds, args.writer_core, args.receiver_core):
        print(f"{res['pattern']:>10} {res['bytes'] / 2**20:.0f} MiB, offer to done {res['write_s'] * 1000:.1f} ms: "
              f"WRITE {res['write_gbps']:.2f} GB/s | memcpy {res['memcpy_gbps']:.2f} GB/s "
              f"(same block pattern {res['memcpy_same_pattern_gbps']:.2f}) -> "
              f"{100 * res['write_gbps'] / res['memcpy_gbps']:.0f}% of memcpy", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
