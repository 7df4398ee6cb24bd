"""benchmarks/gpu_wait_for_save.py on CPU memory: the stand-in model runner steps both workloads
in every mode through the connector's PushWorker, pushes to a real decode receiver process over
real NIXL (UCX on DRAM), and every byte of every push is checked; the timings mean nothing here."""
from __future__ import annotations

import json

import pytest

from benchmark_scripts import failure_excerpt, run_benchmark


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("wait-for-save") / "results.json"
    rc, stdout = run_benchmark("gpu_wait_for_save", ["--device", "cpu", "--rounds", "2", "--json", str(out)], timeout_s=240)
    return rc, stdout, json.loads(out.read_text()) if out.exists() else {}


def test_every_push_of_every_mode_moved_the_right_bytes_and_was_reported_once(bench_run):
    rc, stdout, results = bench_run
    assert rc == 0, failure_excerpt(stdout)
    assert "all bytes verified: True" in stdout and "WRONG" not in stdout
    pushed = [r for r in results["runs"] if r["mode"] != "none"]
    assert pushed and all(r["verified"] and r["outcomes_ok"] == r["pushes"] > 0 for r in pushed)
    assert all(r["reported_once"] for r in results["runs"])  # finished_sending exactly once per push


def test_each_workload_and_mode_is_measured_in_every_round(bench_run):
    _, stdout, results = bench_run
    runs = {(r["workload"], r["mode"], r["round"]) for r in results["runs"]}
    assert runs == {(w, m, i) for w in ("prefill", "decode") for m in ("none", "connector", "sync") for i in range(2)}
    for r in results["runs"]:
        assert r["steps_per_s"] > 0 and len(r["save_ms"]) == r["timed_steps"] == len(r["push_step"]) == len(r["bind_ms"])
        assert any(r["push_step"]) == (r["mode"] != "none")
        assert r["mark_ms"] == [] and r["marks_on_compute"] == 0  # CPU: nothing to mark, offered at once
    rows = {(s["workload"], s["mode"]): s for s in results["summary"]}
    assert rows[("prefill", "none")]["steps_ratio_vs_none"] == 1.0
    assert rows[("decode", "connector")]["push_steps"] > 0 and rows[("decode", "connector")]["save_push_p99_ms"] >= 0
    assert stdout.count("-- targets") == 2 and "before (sync)" in stdout


def test_the_modes_that_record_cuda_events_are_refused_on_cpu():
    rc, output = run_benchmark("gpu_wait_for_save", ["--device", "cpu", "--modes", "none,record-on-compute"], timeout_s=120)
    assert rc == 2 and "record-on-compute" in output and "--device cuda" in output
