"""What vLLM's compute thread sees of a push on a GPU: its time in wait_for_save, and steps/s.

A stand-in model runner (no vLLM) steps a forward-sized workload on a stream of its own, as
vLLM's model runner does, with the connector's prefill-side worker (worker.PushWorker, its KV
cache registered through it) pushing to a decode receiver in another process (gpu_transfer.py's:
the connector's Consumer). Each step, on the compute thread:
  1. --host-ms of Python work (what vLLM's scheduler and input preparation do per step);
  2. the forward launched: per layer the four projections of a Qwen3-32B decoder layer at TP 8
     (hidden 5120; q/k/v 8+1+1 heads of 128; MLP 2 x 3200) as bf16 matmuls over the step's
     tokens, each layer then writing the KV the step computed into its request's cache blocks;
  3. the worker's save path (wait_for_save) for the requests whose prefill finished in the step,
     timed on the compute thread;
  4. the previous step's output waited for (vLLM's asynchronous scheduling: a step is launched
     before the previous one's output is read), then get_finished, as vLLM calls it.
Workloads: `prefill`, each step one 16k-token prefill whose request (512 MiB of KV) is pushed
at the step's end; `decode`, each step a decode batch of 128 tokens replayed from a CUDA graph,
with a 1k-token prefill written in chunks alongside and pushed every 8 steps (as many KV tokens
pushed per step as computed). Modes, interleaved in rounds, same steps in each:
  none       nothing pushed;
  queue      PushWorker.save: an event on the stream, the step handed to the save queue;
  queue-sleep the same with an event whose waiter sleeps instead of spinning (GPU; for comparison);
  sync       the worker's wait_for_save before the save queue (WRITEs made on the compute
             thread, torch.cuda.synchronize, then offered), for comparison;
  unordered  (--control) offered at once without waiting for the forward: the bytes check must
             catch it, which shows the check would see a push that does not wait.
Every request gets blocks of its own on both sides (poisoned before each run), and after each run
every byte of every push is checked at the receiver.

    python benchmarks/gpu_wait_for_save.py --json out.json            # H200
    python benchmarks/gpu_wait_for_save.py --device cpu               # DRAM, tiny shapes: the code paths only
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_transfer as gt  # noqa: E402  (imports kvpush's connector from this checkout if needed)
from gpu_transfer import RECEIVER_ENGINE, WRITER_ENGINE, kvl, torch  # noqa: E402

from kvpush.connector.metadata import PushMetadata, SendSpec  # noqa: E402
from kvpush.connector.save_order import cuda_forward_marks  # noqa: E402
from kvpush.connector.settings import Settings  # noqa: E402
from kvpush.connector.worker import PushWorker  # noqa: E402

MODES = ("none", "queue", "queue-sleep", "sync")
TARGET_SAVE_P99_MS = 0.1
TARGET_STEPS_RATIO = 0.98


@dataclass(frozen=True)
class Workload:
    name: str
    tokens: int  # per step, the matmuls' M
    request_tokens: int  # of each pushed request
    push_every: int  # steps per request: its KV is written in that many chunks, pushed after the last
    warmup_steps: int
    timed_steps: int
    graph: bool  # replay the forward from a CUDA graph (vLLM does for decode batches)

    @property
    def steps(self) -> int:
        return self.warmup_steps + self.timed_steps


# ---- the stand-in model ---------------------------------------------------------------------------
class StandInModel:
    """Per layer x @ Wqkv, attention output @ Wo, @ Wgate_up, @ Wdown (bf16, one weight set per
    layer so a step streams all of them from memory like a real shard), then the KV of the step's
    chunk written into that layer's blocks: kvl.pattern of (layer, block), so the receiver can
    check it. Attention itself is left out: it has no weights and the connector never sees it."""

    def __init__(self, args, workload: Workload, cache: kvl.KVCache, plan: torch.Tensor):
        dev, dt = args.device, torch.bfloat16
        gen = torch.Generator(device=dev).manual_seed(0)

        def weight(rows, cols):
            return torch.randn(rows, cols, device=dev, dtype=dt, generator=gen) / rows ** 0.5

        self.layers = [(weight(args.hidden, args.qkv), weight(args.attn_out, args.hidden),
                        weight(args.hidden, 2 * args.mlp), weight(args.mlp, args.hidden)) for _ in range(args.layers)]
        self.attn_out, self.mlp = args.attn_out, args.mlp
        self.x = torch.randn(workload.tokens, args.hidden, device=dev, dtype=dt, generator=gen)
        self.views = [cache.block_major(layer) for layer in range(args.layers)]
        self.block_shape = tuple(self.views[0].shape[1:])
        # pattern(layer) = pattern(0) + layer * 1_000_003 in 16-bit arithmetic (kvl.pattern)
        self.offsets = [((layer * 1_000_003) & 0xFFFF) - (65536 if (layer * 1_000_003) & 0x8000 else 0)
                        for layer in range(args.layers)]
        self.plan = plan  # [steps, blocks per step] on the device: the blocks each step writes
        self.blocks = plan[0].clone()  # the graph's input
        self.graph = None
        if workload.graph:
            try:
                self._capture()
            except RuntimeError as exc:  # report it and measure the workload launched kernel by kernel
                print(f"  CUDA graph capture failed, {workload.name} runs eagerly: {exc}", flush=True)
                self.graph = None

    def _forward(self, blocks: torch.Tensor) -> None:
        kv0 = kvl.pattern(0, blocks, self.block_shape)
        x = self.x
        for (w_qkv, w_o, w_gu, w_down), view, offset in zip(self.layers, self.views, self.offsets):
            qkv = x @ w_qkv
            h = x + qkv[:, :self.attn_out] @ w_o
            x = (h @ w_gu)[:, :self.mlp] @ w_down
            view.index_copy_(0, blocks, kv0 + offset)

    def _capture(self) -> None:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self._forward(self.blocks)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self._forward(self.blocks)

    def launch(self, step: int) -> None:
        if self.graph is None:
            self._forward(self.plan[step])
        else:
            self.blocks.copy_(self.plan[step])
            self.graph.replay()


# ---- the save paths compared ------------------------------------------------------------------------
def save_queue(ctx, meta: PushMetadata) -> None:
    ctx.worker.save(meta)


def save_sync(ctx, meta: PushMetadata) -> None:
    """PushWorker.save as it was before the save queue (the GPU branch), for comparison."""
    worker = ctx.worker
    if meta.sends:
        for s in meta.sends:
            worker.producer.prepare(s.transfer_id, s.block_ids, s.peer_engine)
        ctx.device_sync()
        ctx.forward_seen = time.monotonic()
    for s in meta.sends:
        worker._offered.add(s.req_id)
        worker.producer.offer(s.transfer_id, s.req_id, list(s.block_ids), s.peer_engine)


def save_unordered(ctx, meta: PushMetadata) -> None:
    """A save path that does not wait for the forward at all: wrong on a GPU, as the check shows."""
    worker = ctx.worker
    for s in meta.sends:
        worker._offered.add(s.req_id)
        worker.producer.prepare(s.transfer_id, s.block_ids, s.peer_engine)
        worker.producer.offer(s.transfer_id, s.req_id, list(s.block_ids), s.peer_engine)


SAVE_PATHS = {"none": save_queue, "queue": save_queue, "queue-sleep": save_queue, "sync": save_sync,
              "unordered": save_unordered}


class CpuStepEvent:
    def record(self) -> None:
        pass

    def synchronize(self) -> None:
        pass


@dataclass
class Context:
    args: argparse.Namespace
    worker: PushWorker
    receiver: gt.Receiver
    cache: kvl.KVCache
    records: list = field(default_factory=list)  # the Producer's SendRecords, as the worker collects them
    mark_s: list = field(default_factory=list)  # the worker's event records (inside wait_for_save)
    marks: dict = field(default_factory=dict)  # mode -> the worker's event factory in that mode
    mode: str = ""
    forward_seen: float = 0.0  # sync: when the device synchronize returned

    @property
    def on_gpu(self) -> bool:
        return self.args.device.startswith("cuda")

    def device_sync(self) -> None:
        if self.on_gpu:
            torch.cuda.synchronize(self.args.device)

    def step_event(self):
        return torch.cuda.Event(enable_timing=True) if self.on_gpu else CpuStepEvent()

    def gpu_clock(self):
        """host_time(event) for timing events recorded from now on: one event recorded on an idle
        GPU at a known host time, then the GPU's own clock."""
        if not self.on_gpu:
            return None
        self.device_sync()
        origin = torch.cuda.Event(enable_timing=True)
        origin.record()
        at = time.monotonic()
        origin.synchronize()
        return lambda event: at + origin.elapsed_time(event) / 1e3

    def tap(self) -> None:
        """Keep the Producer's records (the worker folds them into its stats) and time the worker's
        event record."""
        take = self.worker.producer.take_records

        def records():
            got = take()
            self.records.extend(got)
            return got

        self.worker.producer.take_records = records
        if self.worker._forward_mark is not None:
            device = self.cache.layers[0].device
            self.marks = {"queue": self.worker._forward_mark, "queue-sleep": cuda_forward_marks(device, blocking=True)}

            def timed_mark():
                t = time.perf_counter()
                made = self.marks[self.mode]()
                self.mark_s.append(time.perf_counter() - t)
                return made

            self.worker._forward_mark = timed_mark


def host_work(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


# ---- one run: a workload in one mode ------------------------------------------------------------------
def requests_of(workload: Workload, block_size: int, num_blocks: int) -> list[tuple[list[int], list[int], int]]:
    """(source blocks at P, destination blocks at D, the step that finishes it) per request: P's
    in allocation order, D's from the other end of its cache."""
    n = -(-workload.request_tokens // block_size)
    out = []
    for r in range(workload.steps // workload.push_every):
        src = list(range(r * n, (r + 1) * n))
        dst = list(range(num_blocks - (r + 1) * n, num_blocks - r * n))
        out.append((src, dst, (r + 1) * workload.push_every - 1))
    return out


def plan_of(workload: Workload, requests, device: str) -> torch.Tensor:
    """The blocks each step writes: its chunk of the request being prefilled."""
    rows = []
    for src, _, _ in requests:
        chunk = len(src) // workload.push_every
        rows += [src[i * chunk:(i + 1) * chunk] for i in range(workload.push_every)]
    return torch.tensor(rows, dtype=torch.int64, device=device)


def run(ctx: Context, model: StandInModel, workload: Workload, requests, mode: str, round_: int) -> dict:
    args, worker = ctx.args, ctx.worker
    kvl.poison(ctx.cache)
    ctx.receiver.call("poison")
    ctx.device_sync()
    pushing = mode != "none"
    tids = [f"{workload.name}-{mode}-{round_}-{i}" for i in range(len(requests))]
    if pushing:  # D registers its blocks as it allocates them, long before P's prefill ends
        for tid, (_, dst, _) in zip(tids, requests):
            ctx.receiver.call("expect", tid, dst, worker.producer.port)
        deadline = time.monotonic() + 30
        while not all(worker.producer.has_registration(t) for t in tids):
            if time.monotonic() > deadline:
                raise RuntimeError("the receiver's registrations did not reach the prefill side")
            time.sleep(0.001)
    sends_at = {step: [SendSpec(f"req-{tid}", tid, tuple(src), RECEIVER_ENGINE)]
                for tid, (src, _, step) in zip(tids, requests)} if pushing else {}
    save = SAVE_PATHS[mode]
    save_s, is_push, finished_s, launch_s, events = [], [], [], [], []
    forward_end: dict[str, float] = {}  # host time the forward that wrote a request's KV ended
    reported: list[str] = []
    scheduler_finished: set[str] = set()
    ctx.records.clear()
    ctx.mark_s.clear()
    ctx.mode = mode
    worker.take_stats()
    gc.collect()
    host_time = ctx.gpu_clock()
    started = None
    for step in range(workload.steps):
        if step == workload.warmup_steps:
            started = time.perf_counter()
        host_work(args.host_ms / 1e3)
        model.launch(step)
        meta = PushMetadata(sends=sends_at.get(step, []))
        if mode == "sync" or host_time is None:  # (CPU: the forward is over already)
            for s in meta.sends:
                forward_end[s.transfer_id] = time.monotonic()
        t0 = time.perf_counter()
        save(ctx, meta)
        t1 = time.perf_counter()
        event = ctx.step_event()
        event.record()  # the step's output (sampled tokens) is ready here: the next launch after the forward
        t_launch = time.perf_counter() - t1
        if meta.sends and mode == "sync" and host_time is not None:
            forward_end[meta.sends[0].transfer_id] = ctx.forward_seen
        elif meta.sends and host_time is not None:  # right behind the forward on the stream
            forward_end[meta.sends[0].transfer_id] = event
        if events:
            events[-1].synchronize()
        events.append(event)
        t2 = time.perf_counter()
        sending, _ = worker.get_finished(scheduler_finished)
        t3 = time.perf_counter()
        reported += sorted(sending or ())
        # vLLM finishes a request with one output token once it has read the step's output
        scheduler_finished = {s.req_id for s in meta.sends}
        if step >= workload.warmup_steps:
            save_s.append(t1 - t0)
            is_push.append(bool(meta.sends))
            finished_s.append(t3 - t2)
            launch_s.append(t_launch)
    events[-1].synchronize()
    elapsed = time.perf_counter() - started
    if host_time is not None:  # steady state: from the end of the last warm-up step to the end of the last
        elapsed = events[workload.warmup_steps - 1].elapsed_time(events[-1]) / 1e3
        forward_end = {tid: host_time(e) if not isinstance(e, float) else e for tid, e in forward_end.items()}
    gpu_step_ms = ([events[i - 1].elapsed_time(events[i]) for i in range(workload.warmup_steps + 1, len(events))]
                   if ctx.on_gpu else [])
    # the pushes still in flight end; vLLM keeps calling get_finished until every one is reported
    deadline = time.monotonic() + 60
    expected = {f"req-{t}" for t in tids} if pushing else set()
    while set(reported) != expected and time.monotonic() < deadline:
        sending, _ = worker.get_finished(scheduler_finished)
        scheduler_finished = set()
        reported += sorted(sending or ())
        time.sleep(0.001)
    record = dict(workload=workload.name, mode=mode, round=round_, timed_steps=workload.timed_steps,
                  elapsed_s=elapsed, steps_per_s=workload.timed_steps / elapsed,
                  save_ms=[x * 1e3 for x in save_s], push_step=is_push,
                  get_finished_ms=[x * 1e3 for x in finished_s], next_launch_ms=[x * 1e3 for x in launch_s],
                  mark_ms=[x * 1e3 for x in ctx.mark_s], gpu_step_ms=gpu_step_ms,
                  pushes=len(tids) if pushing else 0, reported_once=sorted(reported) == sorted(expected))
    if pushing:
        outcomes = ctx.receiver.call("outcomes", tids, 60.0)[1]
        src = torch.tensor([b for s, _, _ in requests for b in s])
        dst = torch.tensor([b for _, d, _ in requests for b in d])
        _, verdict = ctx.receiver.call("verify", src, dst)
        by_tid = {r.transfer_id: r for r in ctx.records}
        record.update(
            outcomes_ok=sum(ok for ok, _ in outcomes.values()),
            failures=sorted({reason for ok, reason in outcomes.values() if not ok})[:3],
            wrong_elements=verdict.wrong_elements, stray_elements=verdict.stray_elements,
            verified=verdict.ok and all(ok for ok, _ in outcomes.values()), verified_bytes=verdict.checked_bytes,
            forward_end_to_done_ms=[(by_tid[t].finished - forward_end[t]) * 1e3 for t in tids if t in by_tid],
            offer_to_done_ms=[(by_tid[t].finished - by_tid[t].offered) * 1e3 for t in tids if t in by_tid],
            prepared_ahead=sum(by_tid[t].prepared_ahead for t in tids if t in by_tid))
    return record


# ---- summary ----------------------------------------------------------------------------------------
def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, int(round(q / 100 * len(ordered) + 0.5)) - 1))]


def summarize(records: list[dict]) -> list[dict]:
    out = []
    for name in dict.fromkeys(r["workload"] for r in records):
        rows = [r for r in records if r["workload"] == name]
        base = None
        for mode in dict.fromkeys(r["mode"] for r in rows):
            mine = [r for r in rows if r["mode"] == mode]
            steps = sum(r["timed_steps"] for r in mine)
            rate = steps / sum(r["elapsed_s"] for r in mine)
            push_save = [ms for r in mine for ms, p in zip(r["save_ms"], r["push_step"]) if p]
            other_save = [ms for r in mine for ms, p in zip(r["save_ms"], r["push_step"]) if not p]
            row = dict(workload=name, mode=mode, runs=len(mine), steps=steps, steps_per_s=rate,
                       steps_per_s_by_round=[r["steps_per_s"] for r in mine],
                       push_steps=len(push_save),
                       save_push_p50_ms=pct(push_save, 50), save_push_p99_ms=pct(push_save, 99),
                       save_push_max_ms=max(push_save, default=float("nan")),
                       save_other_p99_ms=pct(other_save, 99),
                       event_record_p50_ms=pct([x for r in mine for x in r["mark_ms"]], 50),
                       event_record_p99_ms=pct([x for r in mine for x in r["mark_ms"]], 99),
                       next_launch_p50_ms=pct([x for r in mine for x in r["next_launch_ms"]], 50),
                       next_launch_p99_ms=pct([x for r in mine for x in r["next_launch_ms"]], 99),
                       get_finished_p99_ms=pct([x for r in mine for x in r["get_finished_ms"]], 99),
                       gpu_step_p50_ms=pct([x for r in mine for x in r["gpu_step_ms"]], 50),
                       pushes=sum(r["pushes"] for r in mine),
                       forward_end_to_done_p50_ms=pct([x for r in mine for x in r.get("forward_end_to_done_ms", [])], 50),
                       forward_end_to_done_p99_ms=pct([x for r in mine for x in r.get("forward_end_to_done_ms", [])], 99),
                       offer_to_done_p50_ms=pct([x for r in mine for x in r.get("offer_to_done_ms", [])], 50),
                       verified=all(r.get("verified", True) and r["reported_once"] for r in mine),
                       wrong_elements=sum(r.get("wrong_elements", 0) for r in mine),
                       verified_bytes=sum(r.get("verified_bytes", 0) for r in mine))
            if mode == "none":
                base = rate
            row["steps_ratio_vs_none"] = rate / base if base else float("nan")
            out.append(row)
    return out


def print_summary(summary: list[dict], on_gpu: bool) -> None:
    print(f"\n{'workload':<13} {'mode':<11} {'steps/s':>8} {'vs none':>7} {'GPU ms/step':>11} {'push steps':>10} "
          f"{'save p50/p99/max ms (push steps)':>33} {'record p99':>10} {'next launch p50/p99':>19} "
          f"{'get_fin p99':>11} {'fwd end->DONE p50/p99':>21} {'offer->DONE':>11}  bytes")
    for r in summary:
        ok = ("-" if r["mode"] == "none" else
              f"OK {r['verified_bytes'] / 2**20:.0f} MiB checked" if r["verified"] else
              f"WRONG ({r['wrong_elements']} elements)")
        print(f"{r['workload']:<13} {r['mode']:<11} {r['steps_per_s']:>8.3f} {r['steps_ratio_vs_none']:>7.3f} "
              f"{r['gpu_step_p50_ms']:>11.2f} {r['push_steps']:>10} "
              f"{r['save_push_p50_ms']:>11.3f} {r['save_push_p99_ms']:>10.3f} {r['save_push_max_ms']:>10.3f} "
              f"{r['event_record_p99_ms']:>10.3f} {r['next_launch_p50_ms']:>9.3f} {r['next_launch_p99_ms']:>9.3f} "
              f"{r['get_finished_p99_ms']:>11.3f} {r['forward_end_to_done_p50_ms']:>10.2f} "
              f"{r['forward_end_to_done_p99_ms']:>10.2f} {r['offer_to_done_p50_ms']:>11.2f}  {ok}")
    for r in summary:
        if r["mode"] != "queue":
            continue
        print(f"-- targets, {r['workload']} (queue = the connector's save path):")
        print(f"   wait_for_save on a push step p99 {r['save_push_p99_ms']:.3f} ms (target <= {TARGET_SAVE_P99_MS} ms): "
              f"{gt._pf(r['save_push_p99_ms'] <= TARGET_SAVE_P99_MS)}")
        print(f"   steps/s with pushes {r['steps_ratio_vs_none']:.3f}x without (target >= {TARGET_STEPS_RATIO}): "
              f"{gt._pf(r['steps_ratio_vs_none'] >= TARGET_STEPS_RATIO)}")
        old = next((s for s in summary if s["workload"] == r["workload"] and s["mode"] == "sync"), None)
        if old:
            print(f"   before (sync): wait_for_save p99 {old['save_push_p99_ms']:.3f} ms, steps/s "
                  f"{old['steps_ratio_vs_none']:.3f}x without")
    if not on_gpu:
        print("(CPU: the forward is over when wait_for_save runs and the worker offers on the compute thread; "
              "these timings say nothing about a GPU)")


# ---- setup and main ------------------------------------------------------------------------------------
def workloads(args) -> list[Workload]:
    if args.device.startswith("cuda"):
        table = {"prefill": Workload("prefill", 16384, 16384, 1, 2, 12, False),
                 "decode": Workload("decode", 128, 1024, 8, 32, 320, True),
                 # the prefill again, launched as one CUDA graph: the compute thread is not held up
                 # by a full launch queue, whatever it launches
                 "prefill-graph": Workload("prefill-graph", 16384, 16384, 1, 2, 12, True)}
    else:
        table = {"prefill": Workload("prefill", 64, 64, 1, 1, 4, False),
                 "decode": Workload("decode", 8, 32, 2, 2, 8, False)}
    unknown = [name for name in args.workloads if name not in table]
    if unknown:
        raise SystemExit(f"workloads {unknown} need a GPU; on {args.device}: {', '.join(table)}")
    chosen = [table[name] for name in args.workloads]
    if args.steps:
        chosen = [Workload(w.name, w.tokens, w.request_tokens, w.push_every, w.warmup_steps,
                           -(-args.steps // w.push_every) * w.push_every, w.graph) for w in chosen]
    return chosen


def make_worker(args, cache: kvl.KVCache, num_blocks: int) -> PushWorker:
    settings = Settings(engine_id=WRITER_ENGINE, is_producer=True, backend="UCX", side_channel_host="127.0.0.1",
                        side_channel_port=0, allowed_engines=frozenset({RECEIVER_ENGINE}), transfer_timeout_s=60.0,
                        peer_silence_s=1.0, buffer_device="cuda" if args.device.startswith("cuda") else "cpu",
                        model="bench-model", tp_size=1, block_size=args.block_size, kv_heads=args.kv_heads, progress_delay_us=None,
                        huge_pages=False, kv_cache_layout=args.layout.upper())
    worker = PushWorker(settings, num_blocks, tp_rank=0)
    worker.register_kv_caches(dict(zip(gt.layer_names(args.layers), cache.layers)))
    return worker


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu")
    p.add_argument("--workloads", default="prefill,decode", help="comma list of prefill, decode, prefill-graph (GPU)")
    p.add_argument("--modes", default="none,queue,sync", help="comma list of " + ", ".join(MODES))
    p.add_argument("--control", action="store_true", help="also run the unordered save path (GPU): its bytes must be wrong")
    p.add_argument("--rounds", type=int, default=None, help="rounds of every mode (default 3 on cuda, 1 on cpu)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per run (default: the workload's)")
    p.add_argument("--host-ms", type=float, default=1.0, help="CPU work per step on the compute thread")
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
    args.modes = args.modes.split(",")
    bad = [m for m in args.modes if m not in MODES] + [w for w in args.workloads
                                                       if w not in ("prefill", "decode", "prefill-graph")]
    if bad:
        p.error(f"unknown modes or workloads {bad}")
    if args.layout not in kvl.LAYOUTS:
        p.error(f"unknown layout {args.layout!r}; one of {', '.join(kvl.LAYOUTS)}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    on_gpu = args.device.startswith("cuda")
    gt.describe_environment(args.device)
    if on_gpu:
        torch.cuda.set_device(torch.device(args.device).index or 0)
        torch.cuda.set_stream(torch.cuda.Stream())  # vLLM runs the forward on a stream of its own
    chosen = workloads(args)
    num_blocks = max(len(requests_of(w, args.block_size, 1 << 40)) * -(-w.request_tokens // args.block_size)
                     for w in chosen)
    shape = kvl.Shape(args.layers, num_blocks, args.block_size, args.kv_heads, args.head_dim)
    print(f"model: {args.layers} layers, hidden {args.hidden}, qkv {args.qkv}, attention out {args.attn_out}, MLP "
          f"{args.mlp} per rank, bf16; KV {args.layout} {num_blocks} blocks x {shape.bytes_per_block} B = "
          f"{num_blocks * shape.bytes_per_block / 2**30:.2f} GiB per side; host work {args.host_ms} ms per step; "
          f"{args.rounds} rounds of {', '.join(args.modes)}", flush=True)
    for w in chosen:
        print(f"workload {w.name}: {w.tokens} tokens per step{' (CUDA graph)' if w.graph else ''}, a "
              f"{w.request_tokens}-token request pushed every {w.push_every} steps; {w.warmup_steps} + "
              f"{w.timed_steps} steps per run", flush=True)
    records: list[dict] = []
    receiver = gt.Receiver(args.device)
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
                    print(f"  {w.name} round {round_} {mode:<11} {r['steps_per_s']:8.2f} steps/s, wait_for_save on push "
                          f"steps max {max(push_save, default=0):.3f} ms, {r['pushes']} pushes "
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
