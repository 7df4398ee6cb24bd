"""What vLLM's compute thread sees of a push on a GPU: its time in wait_for_save, and steps/s.

A stand-in model runner (no vLLM) steps a forward-sized workload on a stream of its own, as
vLLM's model runner does, with the connector's prefill-side worker (worker.PushWorker, its KV
cache registered through it) pushing to a decode receiver in another process (gpu_transfer.py's:
the connector's Consumer). Each step, on the compute thread (gpu_wait_for_save_steps.run):
  1. --host-ms of Python holding the GIL (vLLM's input preparation);
  2. bind_connector_metadata (PushWorker.bind; timed): where the connector records the marks its
     recorder thread has not recorded yet, before the next forward pass;
  3. the forward launched: per layer the four projections of a Qwen3-32B decoder layer at TP 8
     (hidden 5120; q/k/v 8+1+1 heads of 128; MLP 2 x 3200) as bf16 matmuls over the step's
     tokens, each layer then writing the KV the step computed into its request's cache blocks
     (gpu_wait_for_save_model.py);
  4. the worker's save path (wait_for_save) for the requests whose prefill finished in the step,
     timed; then the step's output event (the sampler's launch, timed as *next launch*);
  5. --sampler-ms of Python holding the GIL (vLLM's sampler and scheduler) while the connector's
     recorder thread wants it;
  6. the previous step's output waited for (vLLM's asynchronous scheduling: a step is launched
     before the previous one's output is read), then get_finished, as vLLM calls it.
Workloads: `prefill`, each step one 16k-token prefill whose request (512 MiB of KV) is pushed
at the step's end; `decode`, each step a decode batch of 128 tokens replayed from a CUDA graph,
with a 1k-token prefill written in chunks alongside and pushed every 8 steps (as many KV tokens
pushed per step as computed); `prefill-graph`, the prefill as one CUDA graph. Modes, interleaved
in rounds, same steps in each:
  none               nothing pushed;
  connector          PushWorker.save, the connector's path: the stream taken and the step queued;
                     the event recorded by the worker's recorder thread (or by bind, before the
                     next forward, if that thread has not run by then);
  record-on-compute  (GPU) the event recorded in wait_for_save on the compute thread, then the
                     step queued: the connector before the recorder thread, for comparison;
  sync               the worker's wait_for_save before the save queue (WRITEs made on the compute
                     thread, torch.cuda.synchronize, then offered), for comparison;
  unordered          (--control) offered at once without waiting for the forward: the bytes check
                     must catch it, which shows the check would see a push that does not wait.
Every request gets blocks of its own on both sides (poisoned before each run), and after each run
every byte of every push is checked at the receiver. Summary: gpu_wait_for_save_report.py.

    python benchmarks/gpu_wait_for_save.py --json out.json            # H200
    python benchmarks/gpu_wait_for_save.py --device cpu               # DRAM, tiny shapes: the code paths only
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_bench_common import describe_environment, kvl, layer_names, torch  # noqa: E402  (makes kvpush's connector importable from this checkout)
from gpu_transfer_sides import RECEIVER_ENGINE, WRITER_ENGINE, Receiver  # noqa: E402
from gpu_wait_for_save_model import StandInModel, blocks_needed, plan_of, requests_of, workloads  # noqa: E402
from gpu_wait_for_save_report import print_summary, summarize  # noqa: E402
from gpu_wait_for_save_steps import GPU_ONLY_MODES, Context, run  # noqa: E402

from kvpush.connector.settings import Settings  # noqa: E402
from kvpush.connector.worker import PushWorker  # noqa: E402

MODES = ("none", "connector", "record-on-compute", "sync")
WORKLOADS = ("prefill", "decode", "prefill-graph")


def make_worker(args, cache: kvl.KVCache, num_blocks: int) -> PushWorker:
    settings = Settings(engine_id=WRITER_ENGINE, is_producer=True, backend="UCX", side_channel_host="127.0.0.1",
                        side_channel_port=0, allowed_engines=frozenset({RECEIVER_ENGINE}), transfer_timeout_s=60.0,
                        peer_silence_s=1.0, buffer_device="cuda" if args.device.startswith("cuda") else "cpu",
                        model="bench-model", tp_size=1, block_size=args.block_size, kv_heads=args.kv_heads, progress_delay_us=None,
                        huge_pages=False, kv_cache_layout=args.layout.upper())
    worker = PushWorker(settings, num_blocks, tp_rank=0)
    worker.register_kv_caches(dict(zip(layer_names(args.layers), cache.layers)))
    return worker


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu")
    p.add_argument("--workloads", default="prefill,decode", help="comma list of prefill, decode, prefill-graph (GPU)")
    p.add_argument("--modes", default=None, help="comma list of " + ", ".join(MODES) +
                   " (default: all on cuda; none,connector,sync on cpu, which has no events to record)")
    p.add_argument("--control", action="store_true", help="also run the unordered save path (GPU): its bytes must be wrong")
    p.add_argument("--rounds", type=int, default=None, help="rounds of every mode (default 3 on cuda, 1 on cpu)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per run (default: the workload's)")
    p.add_argument("--host-ms", type=float, default=1.0,
                   help="Python per step before the forward, holding the GIL (vLLM's input preparation)")
    p.add_argument("--sampler-ms", type=float, default=2.0,
                   help="Python per step after wait_for_save, holding the GIL (vLLM's sampler and scheduler)")
    p.add_argument("--layout", default="blhnc", help=f"KV cache layout, one of {', '.join(kvl.LAYOUTS)}")
    p.add_argument("--layers", type=int, default=None, help="default 64 on cuda, 2 on cpu")
    p.add_argument("--hidden", type=int, default=None, help="default 5120 on cuda")
    p.add_argument("--qkv", type=int, default=None, help="q+k+v width per rank (default 1280 on cuda)")
    p.add_argument("--attn-out", type=int, default=None, help="attention output width per rank (default 1024)")
    p.add_argument("--mlp", type=int, default=None, help="MLP intermediate width per rank (default 3200)")
    p.add_argument("--kv-heads", type=int, default=1)
    p.add_argument("--head-dim", type=int, default=None, help="default 128 on cuda, 32 on cpu")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--json", default=None, help="write every run and the summary to this file")
    args = p.parse_args(argv)
    on_gpu = args.device.startswith("cuda")
    gpu = dict(layers=64, hidden=5120, qkv=1280, attn_out=1024, mlp=3200, head_dim=128)
    cpu = dict(layers=2, hidden=128, qkv=64, attn_out=64, mlp=96, head_dim=32)
    for key, value in (gpu if on_gpu else cpu).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.rounds = args.rounds or (3 if on_gpu else 1)
    args.workloads = args.workloads.split(",")
    args.modes = (args.modes or ",".join(m for m in MODES if on_gpu or m not in GPU_ONLY_MODES)).split(",")
    bad = [m for m in args.modes if m not in MODES] + [w for w in args.workloads if w not in WORKLOADS]
    if bad:
        p.error(f"unknown modes or workloads {bad}")
    if not on_gpu and set(args.modes) & set(GPU_ONLY_MODES):
        p.error(f"modes {', '.join(GPU_ONLY_MODES)} record CUDA events: --device cuda")
    if args.layout not in kvl.LAYOUTS:
        p.error(f"unknown layout {args.layout!r}; one of {', '.join(kvl.LAYOUTS)}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    on_gpu = args.device.startswith("cuda")
    describe_environment(args.device)
    if on_gpu:
        torch.cuda.set_device(torch.device(args.device).index or 0)
        torch.cuda.set_stream(torch.cuda.Stream())  # vLLM runs the forward on a stream of its own
    chosen = workloads(args.workloads, on_gpu, args.steps)
    num_blocks = blocks_needed(chosen, args.block_size)
    shape = kvl.Shape(args.layers, num_blocks, args.block_size, args.kv_heads, args.head_dim)
    print(f"model: {args.layers} layers, hidden {args.hidden}, qkv {args.qkv}, attention out {args.attn_out}, MLP "
          f"{args.mlp} per rank, bf16; KV {args.layout} {num_blocks} blocks x {shape.bytes_per_block} B = "
          f"{num_blocks * shape.bytes_per_block / 2**30:.2f} GiB per side; Python per step {args.host_ms} ms before the "
          f"forward and {args.sampler_ms} ms after wait_for_save; "
          f"{args.rounds} rounds of {', '.join(args.modes)}", flush=True)
    for w in chosen:
        print(f"workload {w.name}: {w.tokens} tokens per step{' (CUDA graph)' if w.graph else ''}, a "
              f"{w.request_tokens}-token request pushed every {w.push_every} steps; {w.warmup_steps} + "
              f"{w.timed_steps} steps per run", flush=True)
    records: list[dict] = []
    receiver = Receiver(args.device)
    worker = None
    try:
        cache = kvl.allocate(args.layout, shape, args.device)
        receiver.call("setup", args.layout, shape)
        worker = make_worker(args, cache, num_blocks)
        ctx = Context(args, worker, receiver, cache)
        ctx.tap()
        for w in chosen:
            requests = requests_of(w, args.block_size, num_blocks)
            model = StandInModel(args, w, cache, plan_of(w, requests, args.device))
            gc.collect()
            gc.freeze()  # vLLM freezes its start-up objects too: collections stay short
            for round_ in range(args.rounds):
                order = args.modes[round_ % len(args.modes):] + args.modes[:round_ % len(args.modes)]
                for mode in order:
                    records.append(run(ctx, model, w, requests, mode, round_))
                    r = records[-1]
                    push_save = [ms for ms, p in zip(r["save_ms"], r["push_step"]) if p]
                    print(f"  {w.name} round {round_} {mode:<17} {r['steps_per_s']:8.2f} steps/s, wait_for_save on push "
                          f"steps max {max(push_save, default=0):.3f} ms, bind max {max(r['bind_ms']):.3f} ms, "
                          f"{r['marks_on_compute']} marks on the compute thread, {r['pushes']} pushes "
                          f"{'' if mode == 'none' else 'verified' if r['verified'] else 'WRONG BYTES'}", flush=True)
            if args.control and on_gpu and w.name == "prefill" and not w.graph:
                records.append(run(ctx, model, w, requests, "unordered", 0))
                caught = not records[-1]["verified"]
                print(f"  control: pushes that do not wait for the forward -> {records[-1]['wrong_elements']} wrong "
                      f"elements ({'caught' if caught else 'NOT caught'} by the bytes check)", flush=True)
            del model
            gc.unfreeze()
    finally:
        if worker is not None:
            worker.shutdown()
        receiver.close()
    timed = [r for r in records if r["mode"] != "unordered"]
    summary = summarize(timed)
    print_summary(summary, on_gpu)
    control = [r for r in records if r["mode"] == "unordered"]
    ok = bool(timed) and all(s["verified"] for s in summary)
    if control:
        ok &= not control[0]["verified"]
    print(f"\nall bytes verified: {all(s['verified'] for s in summary)} "
          f"({sum(s['verified_bytes'] for s in summary) / 2**30:.2f} GiB over {sum(s['pushes'] for s in summary)} pushes)"
          + (f"; control caught: {not control[0]['verified']}" if control else ""), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(dict(args=vars(args), workloads=[asdict(w) for w in chosen],
                                                   runs=records, summary=summary), indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
