"""The connector's KV transfer engine between two processes, on GPU (VRAM) or CPU (DRAM) memory.

A prefill writer (this process) and a decode receiver (a child process; both in
gpu_transfer_sides.py) each allocate a KV cache in one of vLLM's attention layouts
(gpu_kv_layouts.py) and register it through kvpush's NixlEngine. The writer runs the connector's
prefill-side push service (producer.Producer), the receiver its decode-side one (consumer.Consumer),
which shakes hands over the side channel (agent metadata, regions, device id) and registers its
blocks for each push, as in a deployment. For each request size and block pattern the writer pushes
its blocks in each mode and the receiver checks every byte after each push:
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
    python benchmarks/gpu_transfer.py --verify-kv          # + verify_kv's digest time vs the WRITE's

With --verify-kv, each request size and pattern also times the connector's end-to-end KV check
(kv_digest.py) on both sides, in the same run as the WRITEs: prefill's digest of its source blocks
(on the device for GPU memory), decode's of the blocks the last WRITE landed in (checked equal),
and prints their ratio to the producer WRITE's total (records: digest_ms, decode_digest_ms,
digest_ratio).

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

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_bench_common as common  # noqa: E402  (makes kvpush's connector importable from this checkout)
from gpu_bench_common import (contiguous_ids, describe_environment, fragmented_ids, kvl, np, pass_fail,  # noqa: E402
                              torch)
from gpu_transfer_sides import (ENGINE_MODES, PRODUCER_MODES, RAW_VARIANTS, ProducerPush, RawNixl,  # noqa: E402
                                RECEIVER_ENGINE, Receiver, engine_write)
from kvpush.connector import coalesce as coalesce_mod, kv_digest, layout as layout_mod, transfer as transfer_mod  # noqa: E402



# ---- block ids ------------------------------------------------------------------------------------
def count_runs(src: np.ndarray, dst: np.ndarray) -> int:
    """Plain loop, independent of coalesce.block_runs: pairs adjacent on both sides share a run."""
    runs = 0
    for i in range(len(src)):
        if i == 0 or src[i] != src[i - 1] + 1 or dst[i] != dst[i - 1] + 1:
            runs += 1
    return runs


# ---- measuring ------------------------------------------------------------------------------------
@dataclass
class Sample:
    prepare_s: list[float] = field(default_factory=list)  # prepared mode: made before the critical path
    setup_s: list[float] = field(default_factory=list)  # call -> WRITE posted
    wait_s: list[float] = field(default_factory=list)  # posted -> DONE
    descriptors: int = 0
    verified_bytes: int = 0
    ok: bool = True


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
    common.sync(device)
    regions = layout_mod.kv_regions((layout_mod.TensorView.of(t) for t in cache.layers), shape.num_blocks)
    engine = transfer_mod.NixlEngine(f"bench-prefill-{layout_name}-{os.getpid()}", regions,
                                     mem_type=common.mem_type(device), device_id=common.device_id(device),
                                     progress_delay_us=args.progress_delay_us)
    _, peer_meta, peer_regions = receiver.call("setup", layout_name, shape)
    pusher = ProducerPush(engine, shape, device) if set(args.modes) & set(PRODUCER_MODES) else None
    if pusher is not None:  # the side channel's handshake adds the receiver as the engine's peer
        everything = np.arange(shape.num_blocks, dtype=np.int64).tolist()
        pusher.push(receiver, "producer", everything, everything)
        peer = pusher.producer.peer(RECEIVER_ENGINE)
    else:
        peer = engine.add_peer(peer_meta, peer_regions, common.device_id(device))
    raws = {m: RawNixl(f"bench-{m}-{layout_name}-{os.getpid()}", m, cache.buffers, common.mem_type(device),
                       common.device_id(device), peer_meta) for m in args.modes if m in RAW_VARIANTS}
    plan = coalesce_mod.Plan.pair(regions, peer_regions, common.device_id(device), common.device_id(device))
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
            copy_s = common.copy_seconds(device, copy_src, copy_dst, nbytes)
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
                if args.verify_kv:
                    _time_digests(args, receiver, cache, regions, peer_regions, segments, src_list, dst_list,
                                  [r for r in out if r["layout"] == layout_name and r["tokens"] == tokens
                                   and r["pattern"] == pattern_name])
        _print_targets(layout_name, [r for r in out if r["layout"] == layout_name], max(args.tokens))
    finally:
        for raw in raws.values():
            raw.close()
        if pusher is not None:
            pusher.close()
        engine.close()
        receiver.call("teardown")
        del cache, copy_src, copy_dst
        common.empty_cache(device)


def _time_digests(args, receiver, cache, regions, peer_regions, segments, src, dst, records: list[dict]) -> None:
    """verify_kv's cost beside the WRITEs just measured: both sides' digests (decode's over what
    the last WRITE landed), checked equal, and their ratio to the WRITE's total."""
    memory = kv_digest.HostMemory() if args.device == "cpu" else kv_digest.TorchMemory(cache.buffers)
    slices = kv_digest.producer_slices(segments, regions, peer_regions)
    sent = kv_digest.digest(memory, slices, src)
    prefill_s = median_seconds(lambda: kv_digest.digest(memory, slices, src), max(3, args.repeats))
    _, landed, decode_s = receiver.call("digest", dst)
    write = next((r for r in records if r["mode"] == "producer"), records[0] if records else None)
    ratio = (prefill_s + decode_s) * 1e3 / write["total_ms"] if write else float("nan")
    for r in records:
        r.update(digest_ms=prefill_s * 1e3, decode_digest_ms=decode_s * 1e3, digest_ratio=ratio, digest_equal=sent == landed)
        r["verified"] &= sent == landed
    print(f"   verify_kv: digest {prefill_s * 1e3:.3f} ms (prefill) + {decode_s * 1e3:.3f} ms (decode) = {ratio:.3f}x the "
          f"{write['mode'] if write else '?'} WRITE's {write['total_ms'] if write else float('nan'):.3f} ms; digests equal: "
          f"{sent == landed}", flush=True)


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
                  f"{pass_fail(c['pct_copy'] >= 25)}")
            print(f"   contiguous setup {c['setup_ms']:.3f} ms (target < 1 ms): {pass_fail(c['setup_ms'] < 1.0)}")
        if f:
            print(f"   fragmented descriptors {f['descriptors']} = runs {f['runs']} x segments "
                  f"({f['expected_descriptors']}): {pass_fail(f['descriptors'] == f['expected_descriptors'])}")
        if f and fr:
            ratio = f["total_ms"] / fr["total_ms"]
            print(f"   fragmented WRITE {f['total_ms']:.2f} ms = {ratio:.2f}x raw NIXL's {fr['total_ms']:.2f} ms "
                  f"(target <= 1.5x): {pass_fail(ratio <= 1.5)}")
    print(f"   bytes verified on every run: {pass_fail(all(r['verified'] for r in rows))}", flush=True)


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
    p.add_argument("--verify-kv", action="store_true",
                   help="also time verify_kv's digest on both sides and print its ratio to the WRITE's time")
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
