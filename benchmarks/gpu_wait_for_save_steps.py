"""gpu_wait_for_save.py's stand-in model runner: one run of a workload in one save mode, stepped
on the compute thread the way vLLM's model runner calls the connector, with every push's bytes
checked at the receiver afterwards."""
from __future__ import annotations

import argparse
import gc
import threading
import time
from dataclasses import dataclass, field

from gpu_bench_common import kvl, torch
from gpu_transfer_sides import RECEIVER_ENGINE, Receiver
from gpu_wait_for_save_model import StandInModel, Workload

from kvpush.connector.metadata import PushMetadata, SendSpec
from kvpush.connector.step_marks import CudaStreamMarks
from kvpush.connector.worker import PushWorker


# ---- the save paths compared ------------------------------------------------------------------------
def save_connector(ctx: "Context", meta: PushMetadata) -> None:
    """The connector's wait_for_save: PushWorker.save (on a GPU: the stream taken, the step queued;
    the event recorded by the worker's recorder thread, or by bind before the next forward)."""
    ctx.worker.save(meta)


def save_record_on_compute(ctx: "Context", meta: PushMetadata) -> None:
    """The connector's wait_for_save before the recorder thread: the event recorded here, on the
    compute thread, then the step handed to the save queue."""
    worker = ctx.worker
    for s in meta.sends:
        worker._offered.add(s.req_id)
    if meta.sends or meta.aborts:
        marks = ctx.stream_marks
        worker.save_queue().submit(marks.record(marks.current()) if meta.sends else None, meta.sends, meta.aborts)


def save_sync(ctx: "Context", meta: PushMetadata) -> None:
    """The connector's wait_for_save before the save queue (its GPU branch): WRITEs made here, a
    device-wide synchronize, then offered."""
    worker = ctx.worker
    if meta.sends:
        for s in meta.sends:
            worker.producer.prepare(s.transfer_id, s.block_ids, s.peer_engine)
        ctx.device_sync()
        ctx.forward_seen = time.monotonic()
    for s in meta.sends:
        worker._offered.add(s.req_id)
        worker.producer.offer(s.transfer_id, s.req_id, list(s.block_ids), s.peer_engine)


def save_unordered(ctx: "Context", meta: PushMetadata) -> None:
    """A save path that does not wait for the forward at all: wrong on a GPU, as the check shows."""
    worker = ctx.worker
    for s in meta.sends:
        worker._offered.add(s.req_id)
        worker.producer.prepare(s.transfer_id, s.block_ids, s.peer_engine)
        worker.producer.offer(s.transfer_id, s.req_id, list(s.block_ids), s.peer_engine)


SAVE_PATHS = {"none": save_connector, "connector": save_connector, "record-on-compute": save_record_on_compute,
              "sync": save_sync, "unordered": save_unordered}
GPU_ONLY_MODES = ("record-on-compute",)


class CpuStepEvent:
    def record(self) -> None:
        pass

    def synchronize(self) -> None:
        pass


@dataclass
class Context:
    args: argparse.Namespace
    worker: PushWorker
    receiver: Receiver
    cache: kvl.KVCache
    records: list = field(default_factory=list)  # the Producer's SendRecords, as the worker collects them
    mark_records: list = field(default_factory=list)  # (seconds, on the compute thread) per event record
    take_s: list = field(default_factory=list)  # seconds per stream taken (StreamMarks.current)
    stream_marks: CudaStreamMarks | None = None  # the worker's, its record timed
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
        """Keep the Producer's records (the worker folds them into its stats) and time every event
        record of the worker's marks, on whichever thread it runs."""
        take = self.worker.producer.take_records

        def records():
            got = take()
            self.records.extend(got)
            return got

        self.worker.producer.take_records = records
        step_marks = self.worker._step_marks
        if step_marks is None:  # CPU: no marks
            return
        self.stream_marks = step_marks._marks
        record, current = self.stream_marks.record, self.stream_marks.current
        compute_thread = threading.current_thread()

        def timed_record(stream):
            t = time.perf_counter()
            made = record(stream)
            self.mark_records.append((time.perf_counter() - t, threading.current_thread() is compute_thread))
            return made

        def timed_current():
            t = time.perf_counter()
            stream = current()
            self.take_s.append(time.perf_counter() - t)
            return stream

        self.stream_marks.record, self.stream_marks.current = timed_record, timed_current


def host_work(seconds: float) -> None:
    """Python holding the GIL, as vLLM's per-step Python does (a busy loop never lets it go early)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


# ---- one run: a workload in one mode ------------------------------------------------------------------
def run(ctx: Context, model: StandInModel, workload: Workload, requests, mode: str, round_: int) -> dict:
    """Per step, on the compute thread, in vLLM's order:
      input preparation (--host-ms of Python), bind_connector_metadata (timed: where the connector
      marks what its recorder has not), the forward launched, wait_for_save (timed), the step's
      output event (the sampler's launch; timed as *next launch*), the sampler's and scheduler's
      Python (--sampler-ms, holding the GIL while the recorder wants it), the previous step's output
      waited for (asynchronous scheduling: the compute thread runs a step ahead), get_finished."""
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
    save_s, save_cpu_s, bind_s, is_push, finished_s, launch_s, events = [], [], [], [], [], [], []
    forward_end: dict[str, float] = {}  # host time the forward that wrote a request's KV ended
    reported: list[str] = []
    scheduler_finished: set[str] = set()
    ctx.records.clear()
    worker.take_stats()
    gc.collect()
    host_time = ctx.gpu_clock()
    started, marks_from, takes_from = None, 0, 0
    for step in range(workload.steps):
        if step == workload.warmup_steps:
            started = time.perf_counter()
            marks_from, takes_from = len(ctx.mark_records), len(ctx.take_s)
            worker.take_stats()
        host_work(args.host_ms / 1e3)
        tb = time.perf_counter()
        worker.bind(PushMetadata())
        t_bind = time.perf_counter() - tb
        model.launch(step)
        meta = PushMetadata(sends=sends_at.get(step, []))
        if mode == "sync" or host_time is None:  # (CPU: the forward is over already)
            for s in meta.sends:
                forward_end[s.transfer_id] = time.monotonic()
        c0, t0 = time.thread_time(), time.perf_counter()
        save(ctx, meta)
        t1, c1 = time.perf_counter(), time.thread_time()
        event = ctx.step_event()
        event.record()  # the step's output (sampled tokens) is ready here: the next launch after the forward
        t_launch = time.perf_counter() - t1
        if meta.sends and mode == "sync" and host_time is not None:
            forward_end[meta.sends[0].transfer_id] = ctx.forward_seen
        elif meta.sends and host_time is not None:  # right behind the forward on the stream
            forward_end[meta.sends[0].transfer_id] = event
        host_work(args.sampler_ms / 1e3)
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
            save_cpu_s.append(c1 - c0)
            bind_s.append(t_bind)
            is_push.append(bool(meta.sends))
            finished_s.append(t3 - t2)
            launch_s.append(t_launch)
    events[-1].synchronize()
    elapsed = time.perf_counter() - started
    stats = worker.take_stats()  # the timed steps' (a mark left for the next bind is not counted)
    marks = ctx.mark_records[marks_from:]
    if host_time is not None:  # steady state: from the end of the last warm-up step to the end of the last
        elapsed = events[workload.warmup_steps - 1].elapsed_time(events[-1]) / 1e3
        forward_end = {tid: host_time(e) if not isinstance(e, float) else e for tid, e in forward_end.items()}
    gpu_step_ms = ([events[i - 1].elapsed_time(events[i]) for i in range(workload.warmup_steps + 1, len(events))]
                   if ctx.on_gpu else [])
    worker.bind(PushMetadata())  # vLLM's next step: a mark still waiting for the recorder is recorded
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
                  save_ms=[x * 1e3 for x in save_s], save_cpu_ms=[x * 1e3 for x in save_cpu_s],
                  bind_ms=[x * 1e3 for x in bind_s], push_step=is_push,
                  stream_take_ms=[x * 1e3 for x in ctx.take_s[takes_from:]],
                  get_finished_ms=[x * 1e3 for x in finished_s], next_launch_ms=[x * 1e3 for x in launch_s],
                  mark_ms=[x * 1e3 for x, _ in marks], marks_on_compute=sum(on for _, on in marks),
                  marks_on_compute_thread_stat=(stats.data["marks_on_compute_thread"] if stats else 0),
                  gpu_step_ms=gpu_step_ms, pushes=len(tids) if pushing else 0,
                  reported_once=sorted(reported) == sorted(expected))
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
