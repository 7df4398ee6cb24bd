"""The connector's transfer engine pushing one prompt's KV from N prefill ranks to N decode ranks
at once: tensor-parallel instances (TP N -> TP N), one process per rank, all on one device.

Each rank process (gpu_tp_ranks.py) holds its own KV cache (gpu_kv_layouts.py; rank r holds the
model's KV heads connector/sharding.HeadSharding gives it), registered through kvpush's NixlEngine, and runs the
connector's push service for its side: prefill rank r a Producer (ProducerConfig tp_rank r,
side channel on the base port + r), decode rank r a Consumer (same sharding), which shakes
hands with the prefill ranks it takes heads from and registers its blocks for each push, as in a
deployment (gpu_transfer.py does the same for one rank). Prefill caches are filled with a
pattern salted by the rank's first KV head, so a shard landing on the wrong rank or block fails
the check; decode caches are poisoned before every push and every byte is checked after it.

For each push every decode rank registers the request's blocks (the same block ids on every
rank, as vLLM's TP ranks share one block table); every prefill rank makes its WRITE ahead
(Producer.prepare, the connector's GPU path); then all prefill ranks wait on one barrier and,
released together, call Producer.offer ("prefill finished"). The Producer's own records give
each rank's offer, post and DONE times (one monotonic clock for all processes). Cases:
- fanout: all N pairs r -> r at once;
- rank0-alone: the same processes, only rank 0 pushing its shard (the others idle);
- all-heads: one prefill rank -> one decode rank (TP 1 -> TP 1) moving every KV head, the
  bytes of the whole fanout through one pair;
- device copy: a plain copy of the fanout's total bytes in one process (torch; CUDA events).

aggregate GB/s = bytes of every rank / (last DONE at the prefill ranks - first offer, i.e. the
first rank starting to post); per rank: offer -> DONE. "at D" uses the time each decode rank
saw its outcome (polled every 0.5 ms) instead of DONE at the prefill rank.

    python benchmarks/gpu_tp_fanout.py                   # H200: Qwen3-32B (64 layers, 8 KV heads x 128), TP 8 -> TP 8, 16k tokens
    python benchmarks/gpu_tp_fanout.py --device cpu      # DRAM, small shapes
    python benchmarks/gpu_tp_fanout.py --device cpu --ranks 2 --kv-heads 2 --layers 2 --tokens 64 --repeats 1 --json out.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_bench_common as common  # noqa: E402  (makes kvpush's connector importable from this checkout)
from gpu_bench_common import kvl, np, torch  # noqa: E402
from gpu_tp_ranks import Instances  # noqa: E402
from kvpush.connector import sharding as sharding_mod  # noqa: E402


def summarize(case: str, layout: str, round_no: int, push: dict, copy_gbps: float) -> dict:
    ranks = push["ranks"]
    first_offer = min(r["offered"] for r in ranks)
    last_done = max(r["finished"] for r in ranks)
    last_seen = max(r["seen_at_decode"] for r in ranks)
    total = sum(r["bytes"] for r in ranks)
    span = last_done - first_offer
    return dict(case=case, layout=layout, round=round_no, num_ranks=len(ranks), bytes=total, span_ms=span * 1e3,
                gbps=total / span / 1e9, gbps_at_decode=total / (last_seen - first_offer) / 1e9,
                start_skew_ms=(max(r["offered"] for r in ranks) - first_offer) * 1e3,
                release_to_first_offer_ms=(first_offer - push["released"]) * 1e3,
                rank_ms=[(r["finished"] - r["offered"]) * 1e3 for r in ranks],
                rank_gbps=[r["bytes"] / (r["finished"] - r["offered"]) / 1e9 for r in ranks],
                descriptors=[r["descriptors"] for r in ranks], pct_copy=100 * total / span / 1e9 / copy_gbps,
                verified=all(r["verified"] and r["bytes"] == r["expected_bytes"] == r["verified_bytes"] for r in ranks),
                verified_bytes=sum(r["verified_bytes"] for r in ranks), per_rank=ranks)


def _print_push(s: dict) -> None:
    ok = f"OK {s['verified_bytes'] / 2**20:.1f} MiB checked" if s["verified"] else "WRONG BYTES"
    ranks = " ".join(f"{ms:.2f}" for ms in s["rank_ms"])
    print(f"  {s['case']:<12} round {s['round']}: {s['num_ranks']} rank(s) {s['bytes'] / 2**20:9.2f} MiB in "
          f"{s['span_ms']:8.3f} ms = {s['gbps']:7.1f} GB/s ({s['pct_copy']:5.1f}% of copy; at D {s['gbps_at_decode']:7.1f}); "
          f"start skew {s['start_skew_ms']:.3f} ms; per rank ms [{ranks}]  {ok}", flush=True)
    for r in s["per_rank"]:
        if not r["verified"]:
            print(f"     !! rank {r['rank']}: ok={r['ok']} {r['reason']!r}, {r['wrong_elements']} wrong, "
                  f"{r['stray_elements']} stray elements, {r['bytes']} of {r['expected_bytes']} bytes", flush=True)


def device_copy(device: str, nbytes: int) -> float:
    """GB/s of a plain copy of nbytes in this process (median of 5; CUDA events on a GPU)."""
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = common.copy_seconds(device, src, dst, nbytes)
    del src, dst
    common.empty_cache(device)
    return nbytes / seconds / 1e9


def run_layout(args, layout: str, rng: np.random.Generator, copy_gbps: float, out: list[dict]) -> None:
    n = -(-args.tokens // args.block_size)
    num_blocks = args.num_blocks or n + 64
    cases = [("fanout", args.ranks, list(range(args.ranks))), ("rank0-alone", args.ranks, [0])]
    if args.ranks > 1:
        cases.append(("all-heads", 1, [0]))
    print(f"\n== layout {layout}: {n} blocks per request, {num_blocks} blocks per rank and side", flush=True)
    for tp_size in sorted({c[1] for c in cases}, reverse=True):
        mine = [c for c in cases if c[1] == tp_size]
        t0 = time.monotonic()
        instances = Instances(args, layout, tp_size, num_blocks)
        try:
            shape = instances.shape
            print(f"-- TP {tp_size} -> TP {tp_size}: {shape.kv_heads} KV head(s) per rank, {shape.bytes_per_block} B "
                  f"per block, {n * shape.bytes_per_block / 2**20:.1f} MiB per rank per request "
                  f"(processes up in {time.monotonic() - t0:.1f} s)", flush=True)
            everything = np.arange(n, dtype=np.int64)
            warm = summarize("warm-up", layout, 0, instances.push(f"warm-{tp_size}", everything, everything,
                                                                 list(range(tp_size))), copy_gbps)
            if not warm["verified"]:
                _print_push(warm)
            out.append(warm)
            for round_no in range(1, args.repeats + 1):
                order = mine if round_no % 2 else mine[::-1]  # interleaved, so drift hits each case alike
                for case, _, ranks in order:
                    src, dst = block_ids(args, rng, num_blocks, n)
                    push = instances.push(f"{case}-{round_no}", src, dst, ranks)
                    record = summarize(case, layout, round_no, push, copy_gbps)
                    out.append(record)
                    _print_push(record)
        finally:
            instances.close()


def block_ids(args, rng: np.random.Generator, num_blocks: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    if args.pattern == "fragmented":
        return (common.fragmented_ids(rng, num_blocks, n, args.max_run), common.fragmented_ids(rng, num_blocks, n, args.max_run))
    return common.contiguous_ids(rng, num_blocks, n), common.contiguous_ids(rng, num_blocks, n)


def report(records: list[dict], copy_gbps: float, total_bytes: int) -> dict:
    """Medians per case and layout, with the same-run ratios."""
    summary: dict = {}
    print(f"\n{'layout':<7} {'case':<12} {'ranks':>5} {'MiB':>9} {'median ms':>10} {'GB/s':>8} {'at D':>8} "
          f"{'%copy':>6} {'rank ms (median of ranks)':>26} {'fanout/this':>11}", flush=True)
    for layout in dict.fromkeys(r["layout"] for r in records):
        rows = {}
        for case in ("fanout", "rank0-alone", "all-heads"):
            mine = [r for r in records if r["layout"] == layout and r["case"] == case]
            if mine:
                rows[case] = dict(num_ranks=mine[0]["num_ranks"], bytes=mine[0]["bytes"], rounds=len(mine),
                                  span_ms=statistics.median(r["span_ms"] for r in mine),
                                  gbps=statistics.median(r["gbps"] for r in mine),
                                  gbps_at_decode=statistics.median(r["gbps_at_decode"] for r in mine),
                                  rank_ms=statistics.median(statistics.median(r["rank_ms"]) for r in mine),
                                  start_skew_ms=statistics.median(r["start_skew_ms"] for r in mine))
        fan = rows.get("fanout")
        for case, row in rows.items():
            row["pct_copy"] = 100 * row["gbps"] / copy_gbps
            row["fanout_x"] = fan["gbps"] / row["gbps"] if fan else None
            print(f"{layout:<7} {case:<12} {row['num_ranks']:>5} {row['bytes'] / 2**20:>9.2f} {row['span_ms']:>10.3f} "
                  f"{row['gbps']:>8.1f} {row['gbps_at_decode']:>8.1f} {row['pct_copy']:>6.1f} {row['rank_ms']:>26.3f} "
                  f"{row['fanout_x']:>10.2f}x", flush=True)
        summary[layout] = rows
    print(f"{'':<7} {'device copy':<12} {'':>5} {total_bytes / 2**20:>9.2f} {total_bytes / copy_gbps / 1e6:>10.3f} "
          f"{copy_gbps:>8.1f} (one process, the fanout's total bytes)", flush=True)
    return summary


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu")
    p.add_argument("--layouts", default="blhnc", help=f"comma list of {', '.join(kvl.LAYOUTS)}")
    p.add_argument("--ranks", type=int, default=None, help="TP size of both instances (default 8 on cuda, 2 on cpu)")
    p.add_argument("--kv-heads", type=int, default=None, help="the model's KV heads (default 8: Qwen3-32B; 2 on cpu)")
    p.add_argument("--tokens", type=int, default=None, help="prompt tokens (default 16384 on cuda, 1024 on cpu)")
    p.add_argument("--layers", type=int, default=None, help="default 64 on cuda (Qwen3-32B), 4 on cpu")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=None, help="per rank and side (default: the request's + 64)")
    p.add_argument("--pattern", choices=("contiguous", "fragmented"), default="contiguous",
                   help="the request's block ids on each side (the same on every rank)")
    p.add_argument("--max-run", type=int, default=8, help="fragmented ids come in runs of 1..max-run blocks")
    p.add_argument("--repeats", type=int, default=None, help="rounds per case after a warm-up push (default 5 on cuda, 2 on cpu)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="also write the records and the summary to this file")
    args = p.parse_args(argv)
    on_gpu = args.device.startswith("cuda")
    args.ranks = args.ranks or (8 if on_gpu else 2)
    args.kv_heads = args.kv_heads or (8 if on_gpu else 2)
    args.tokens = args.tokens or (16384 if on_gpu else 1024)
    args.layers = args.layers or (64 if on_gpu else 4)
    args.repeats = args.repeats or (5 if on_gpu else 2)
    args.layouts = args.layouts.split(",")
    unknown = [name for name in args.layouts if name not in kvl.LAYOUTS]
    if unknown:
        p.error(f"unknown layouts {unknown}; choose from {', '.join(kvl.LAYOUTS)}")
    problem = sharding_mod.tp_problem(args.kv_heads, args.ranks)
    if problem:
        p.error(f"--ranks {args.ranks} --kv-heads {args.kv_heads}: {problem}")
    n = -(-args.tokens // args.block_size)
    if args.num_blocks is not None and args.num_blocks < n:
        p.error(f"--num-blocks {args.num_blocks} is below the request's {n} blocks")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    common.describe_environment(args.device)
    per_rank = sharding_mod.HeadSharding(args.kv_heads, args.ranks).heads_per_rank
    n = -(-args.tokens // args.block_size)
    rank_bytes = n * kvl.Shape(args.layers, n, args.block_size, per_rank, args.head_dim).bytes_per_block
    total_bytes = rank_bytes * args.ranks
    print(f"shape: {args.layers} layers, {args.kv_heads} KV heads x {args.head_dim}, bf16, block size {args.block_size}; "
          f"TP {args.ranks} -> TP {args.ranks} ({per_rank} head(s) per rank); {args.tokens} tokens = {n} blocks "
          f"{args.pattern}; {rank_bytes / 2**20:.1f} MiB per rank, {total_bytes / 2**20:.1f} MiB in all; "
          f"{args.repeats} rounds per case; {os.cpu_count()} CPUs", flush=True)
    copy_gbps = device_copy(args.device, total_bytes)
    print(f"device copy of {total_bytes / 2**20:.1f} MiB: {copy_gbps:.1f} GB/s", flush=True)
    rng = np.random.default_rng(args.seed)
    records: list[dict] = []
    failed: list[str] = []
    for layout in args.layouts:
        try:
            run_layout(args, layout, rng, copy_gbps, records)
        except Exception:
            traceback.print_exc()
            failed.append(layout)
    measured = [r for r in records if r["case"] != "warm-up"]
    summary = report(measured, copy_gbps, total_bytes) if measured else {}
    if failed:
        print(f"\nlayouts that failed: {', '.join(failed)}", flush=True)
    ok = bool(measured) and not failed and all(r["verified"] for r in records)
    checked = sum(r["verified_bytes"] for r in records)
    print(f"\nall bytes verified: {ok} ({checked / 2**20:.1f} MiB checked over "
          f"{sum(r['num_ranks'] for r in records)} rank pushes, warm-ups included)", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(dict(args=vars(args), copy_gbps=copy_gbps, total_bytes=total_bytes,
                                                   summary=summary, records=records), indent=1, default=str))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
