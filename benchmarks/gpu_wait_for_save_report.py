"""gpu_wait_for_save.py's summary: per workload and mode, pooled over rounds, with steps/s as a
ratio to the same workload without pushes in the same run, and the issue's targets."""
from __future__ import annotations

from gpu_bench_common import pass_fail

TARGET_SAVE_P99_MS = 0.1
TARGET_STEPS_RATIO = 0.98


def pct(values: list[float], q: float) -> float:
    """Nearest-rank percentile; nan for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, int(round(q / 100 * len(ordered) + 0.5)) - 1))]


def _pooled(runs: list[dict], key: str) -> list[float]:
    return [x for r in runs for x in r.get(key, [])]


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
            push_cpu = [ms for r in mine for ms, p in zip(r.get("save_cpu_ms", []), r["push_step"]) if p]
            bind, marks = _pooled(mine, "bind_ms"), _pooled(mine, "mark_ms")
            fwd_done = _pooled(mine, "forward_end_to_done_ms")
            row = dict(workload=name, mode=mode, runs=len(mine), steps=steps, steps_per_s=rate,
                       steps_per_s_by_round=[r["steps_per_s"] for r in mine],
                       push_steps=len(push_save),
                       save_push_p50_ms=pct(push_save, 50), save_push_p99_ms=pct(push_save, 99),
                       save_push_max_ms=max(push_save, default=float("nan")),
                       save_other_p99_ms=pct(other_save, 99),
                       save_push_cpu_p50_ms=pct(push_cpu, 50), save_push_cpu_p99_ms=pct(push_cpu, 99),
                       stream_take_p99_ms=pct(_pooled(mine, "stream_take_ms"), 99),
                       bind_p50_ms=pct(bind, 50), bind_p99_ms=pct(bind, 99), bind_max_ms=max(bind, default=float("nan")),
                       marks_on_compute_thread=sum(r["marks_on_compute"] for r in mine),
                       marks_on_compute_thread_stat=sum(r["marks_on_compute_thread_stat"] for r in mine),
                       marks_recorded=len(marks),
                       event_record_p50_ms=pct(marks, 50), event_record_p99_ms=pct(marks, 99),
                       next_launch_p50_ms=pct(_pooled(mine, "next_launch_ms"), 50),
                       next_launch_p99_ms=pct(_pooled(mine, "next_launch_ms"), 99),
                       get_finished_p99_ms=pct(_pooled(mine, "get_finished_ms"), 99),
                       gpu_step_p50_ms=pct(_pooled(mine, "gpu_step_ms"), 50),
                       pushes=sum(r["pushes"] for r in mine),
                       forward_end_to_done_p50_ms=pct(fwd_done, 50), forward_end_to_done_p99_ms=pct(fwd_done, 99),
                       offer_to_done_p50_ms=pct(_pooled(mine, "offer_to_done_ms"), 50),
                       verified=all(r.get("verified", True) and r["reported_once"] for r in mine),
                       wrong_elements=sum(r.get("wrong_elements", 0) for r in mine),
                       verified_bytes=sum(r.get("verified_bytes", 0) for r in mine))
            if mode == "none":
                base = rate
            row["steps_ratio_vs_none"] = rate / base if base else float("nan")
            out.append(row)
    return out


def print_summary(summary: list[dict], on_gpu: bool) -> None:
    print(f"\n{'workload':<13} {'mode':<17} {'steps/s':>8} {'vs none':>7} {'GPU ms/step':>11} {'push steps':>10} "
          f"{'wait_for_save p50/p99/max ms (push steps)':>41} {'bind p50/p99/max ms':>23} {'marks on compute':>16} "
          f"{'record p50/p99':>15} {'next launch p50/p99':>19} {'fwd end->DONE p50/p99':>21}  bytes")
    for r in summary:
        ok = ("-" if r["mode"] == "none" else
              f"OK {r['verified_bytes'] / 2**20:.0f} MiB checked" if r["verified"] else
              f"WRONG ({r['wrong_elements']} elements)")
        marks = f"{r['marks_on_compute_thread']}/{r['marks_recorded']}" if r["marks_recorded"] else "-"
        print(f"{r['workload']:<13} {r['mode']:<17} {r['steps_per_s']:>8.3f} {r['steps_ratio_vs_none']:>7.3f} "
              f"{r['gpu_step_p50_ms']:>11.2f} {r['push_steps']:>10} "
              f"{r['save_push_p50_ms']:>13.3f} {r['save_push_p99_ms']:>13.3f} {r['save_push_max_ms']:>13.3f} "
              f"{r['bind_p50_ms']:>7.3f} {r['bind_p99_ms']:>7.3f} {r['bind_max_ms']:>7.3f} {marks:>16} "
              f"{r['event_record_p50_ms']:>7.3f} {r['event_record_p99_ms']:>7.3f} "
              f"{r['next_launch_p50_ms']:>9.3f} {r['next_launch_p99_ms']:>9.3f} "
              f"{r['forward_end_to_done_p50_ms']:>10.2f} {r['forward_end_to_done_p99_ms']:>10.2f}  {ok}")
    for r in summary:
        if r["mode"] != "connector":
            continue
        print(f"-- targets, {r['workload']} (connector = the connector's save path):")
        print(f"   wait_for_save on a push step p99 {r['save_push_p99_ms']:.3f} ms (target <= {TARGET_SAVE_P99_MS} ms): "
              f"{pass_fail(r['save_push_p99_ms'] <= TARGET_SAVE_P99_MS)}")
        print(f"   of which on the compute thread's CPU p50/p99 {r['save_push_cpu_p50_ms']:.3f}/"
              f"{r['save_push_cpu_p99_ms']:.3f} ms (the rest off the CPU: waiting for the GIL or the OS); stream taken p99 "
              f"{r['stream_take_p99_ms']:.3f} ms")
        print(f"   steps/s with pushes {r['steps_ratio_vs_none']:.3f}x without (target >= {TARGET_STEPS_RATIO}): "
              f"{pass_fail(r['steps_ratio_vs_none'] >= TARGET_STEPS_RATIO)}")
        if r["marks_recorded"]:
            print(f"   marks recorded by the compute thread before the next forward (bind): "
                  f"{r['marks_on_compute_thread']} of {r['marks_recorded']} (connector stats: "
                  f"{r['marks_on_compute_thread_stat']}); bind p99 {r['bind_p99_ms']:.3f} ms, max {r['bind_max_ms']:.3f} ms")
        for mode, label in (("record-on-compute", "event recorded on the compute thread"), ("sync", "before (sync)")):
            old = next((s for s in summary if s["workload"] == r["workload"] and s["mode"] == mode), None)
            if old:
                print(f"   {label}: wait_for_save p99 {old['save_push_p99_ms']:.3f} ms, steps/s "
                      f"{old['steps_ratio_vs_none']:.3f}x without, fwd end->DONE p50 "
                      f"{old['forward_end_to_done_p50_ms']:.2f} ms")
    if not on_gpu:
        print("(CPU: the forward is over when wait_for_save runs and the worker offers on the compute thread; "
              "these timings say nothing about a GPU)")
