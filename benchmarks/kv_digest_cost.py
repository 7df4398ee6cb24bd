"""verify_kv's digest (connector/kv_digest.py) on host memory: time per side for a prompt's KV.

A KV cache shaped like the KV-heavy test model of ../shared/README.md (8 layers, K and V regions,
16-token blocks of 8 heads x 128 x float32), random bytes; the digest over a prompt's blocks as
decode computes it (prefill's covers the same bytes), median of 5, one thread.

    python benchmarks/kv_digest_cost.py [--tokens 512,1500,3000]
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np

from kvpush.connector import kv_digest
from kvpush.connector.regions import Region

LAYERS, HEADS, HEAD_DIM, BLOCK_TOKENS, ITEM = 8, 8, 128, 16, 4


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", default="512,1500,3000")
    tokens = [int(t) for t in p.parse_args().tokens.split(",")]
    block_len = BLOCK_TOKENS * HEADS * HEAD_DIM * ITEM
    blocks = -(-max(tokens) // BLOCK_TOKENS) + 8
    arr = np.random.default_rng(0).integers(0, 2**63, size=(2 * LAYERS, blocks, block_len // 8), dtype=np.uint64)
    regions = [Region(arr[k].ctypes.data, block_len, block_len, blocks) for k in range(2 * LAYERS)]
    slices = kv_digest.decode_slices(regions, [None] * len(regions), 0, 1, whole=True)
    for n_tokens in tokens:
        ids = list(range(4, 4 + -(-n_tokens // BLOCK_TOKENS)))
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            kv_digest.digest(kv_digest.HostMemory(), slices, ids)
            times.append(time.perf_counter() - t0)
        mib = len(ids) * block_len * len(regions) / 2**20
        median = sorted(times)[2]
        print(json.dumps({"tokens": n_tokens, "kv_mib": round(mib, 1), "digest_ms_median": round(median * 1e3, 2),
                          "gib_per_s": round(mib / 1024 / median, 3), "all_ms": [round(t * 1e3, 2) for t in times]}))


if __name__ == "__main__":
    main()
