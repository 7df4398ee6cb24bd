"""kvpush.deploy.bench.runner: teardown always happens, a failed mode doesn't stop the others,
Ctrl-C stops the bench and still writes what was measured. The deployment itself is faked here;
tests/e2e/test_bench_real.py runs the real thing."""
from __future__ import annotations

import json

import pytest

from kvpush.deploy.bench import runner as bench_runner
from kvpush.deploy.bench.runner import BenchOptions, run_bench, seed_for
from kvpush.deploy.errors import KvpushError, UsageError
from kvpush.deploy.lifecycle import DownResult
from kvpush.deploy.topology import parse_topology
from kvpush.templates import DEFAULT_TEMPLATE, template_text


@pytest.fixture
def topo():
    return parse_topology(template_text(DEFAULT_TEMPLATE))


@pytest.fixture
def calls(monkeypatch):
    log: list[tuple[str, str]] = []

    def fake_down(name, options=None, events=None):
        log.append(("down", name))
        return DownResult(stopped=["router"])

    monkeypatch.setattr(bench_runner, "down", fake_down)
    monkeypatch.setattr(bench_runner, "save_logs", lambda topo, options, mode: None)
    monkeypatch.setattr(bench_runner, "BenchClient", _NoClient)
    return log


class _NoClient:
    """Stands in for the warm `vllm bench serve` process (no vLLM import in unit tests)."""

    closed = 0
    cpu_cores: str | None = None

    def __init__(self, log_path, cpu_cores=None):
        self.log_path = log_path
        _NoClient.cpu_cores = cpu_cores

    def start(self):
        pass

    def close(self):
        _NoClient.closed += 1


def _options(tmp_path, modes):
    return BenchOptions(modes=modes, rates=[1.0], input_len=8, output_len=2, num_prompts=1, out_dir=tmp_path,
                        baseline=modes[0])


def test_a_failed_mode_is_recorded_torn_down_and_the_next_mode_runs(topo, tmp_path, calls, monkeypatch):
    def fake_run_mode(mode_topo, options, events, run, client, doctor=True):
        calls.append(("run", mode_topo.connector.type))
        if mode_topo.connector.type == "kvpush":
            raise KvpushError("process prefill-0 on host local exited before it became ready")

    monkeypatch.setattr(bench_runner, "_run_mode", fake_run_mode)
    report = run_bench(topo, _options(tmp_path, ["kvpush", "nixl-pull"]))
    assert calls == [("run", "kvpush"), ("down", "local-cpu-bench"), ("run", "nixl-pull"), ("down", "local-cpu-bench")]
    assert report.runs[0].error.startswith("process prefill-0")
    assert report.runs[1].error is None
    document = json.loads((tmp_path / "bench.json").read_text())
    assert document["runs"][0]["error"] and not document["interrupted"]


def test_ctrl_c_tears_down_stops_the_bench_and_keeps_partial_results(topo, tmp_path, calls, monkeypatch):
    def fake_run_mode(mode_topo, options, events, run, client, doctor=True):
        calls.append(("run", mode_topo.connector.type))
        raise KeyboardInterrupt

    monkeypatch.setattr(bench_runner, "_run_mode", fake_run_mode)
    report = run_bench(topo, _options(tmp_path, ["nixl-pull", "colocated"]))
    assert calls == [("run", "nixl-pull"), ("down", "local-cpu-bench")]  # colocated never started
    assert report.interrupted and _NoClient.closed >= 1  # the client process is stopped too
    assert json.loads((tmp_path / "bench.json").read_text())["interrupted"] is True


def test_a_deployment_that_does_not_stop_is_an_error(topo, tmp_path, monkeypatch):
    monkeypatch.setattr(bench_runner, "BenchClient", _NoClient)
    monkeypatch.setattr(bench_runner, "_run_mode", lambda *a: None)
    monkeypatch.setattr(bench_runner, "save_logs", lambda topo, options, mode: None)
    monkeypatch.setattr(bench_runner, "down", lambda name, options=None: DownResult(left_running=["decode-0"]))
    with pytest.raises(KvpushError, match="could not stop decode-0"):
        run_bench(topo, _options(tmp_path, ["colocated"]))


def test_options_are_checked_before_anything_starts(topo, tmp_path, calls):
    with pytest.raises(UsageError, match="--num-prompts must be at least 1"):
        run_bench(topo, BenchOptions(modes=["colocated"], rates=[1.0], input_len=8, output_len=2, num_prompts=0,
                                     out_dir=tmp_path, baseline="colocated"))
    with pytest.raises(UsageError, match="--baseline nixl-pull is not among --modes"):
        run_bench(topo, _options(tmp_path, ["colocated"]).__class__(
            modes=["colocated"], rates=[1.0], input_len=8, output_len=2, num_prompts=1, out_dir=tmp_path))
    assert calls == []


def test_seeds_differ_per_rate_and_match_across_modes():
    seeds = [seed_for(0, i) for i in range(4)]
    assert len(set(seeds)) == 4
    assert seed_for(7, 2) == seed_for(7, 2)
    assert seed_for(0, 0) != seed_for(1, 0)


def test_where_the_time_went_is_recorded_per_mode_also_for_a_failed_mode(topo, tmp_path, calls, monkeypatch):
    def fake_run_mode(mode_topo, options, events, run, client, doctor=True):
        with bench_runner.timed(run, "up"):
            pass
        with bench_runner.timed(run, "prove"):
            raise KvpushError("the proof request was answered, but no decode instance received prompt tokens")

    monkeypatch.setattr(bench_runner, "_run_mode", fake_run_mode)
    run_bench(topo, _options(tmp_path, ["kvpush"]))
    phases = json.loads((tmp_path / "bench.json").read_text())["runs"][0]["phases_s"]
    assert set(phases) == {"up", "prove", "down"}
    assert all(v >= 0 for v in phases.values())


def test_doctor_checks_the_hosts_until_one_mode_started(topo, tmp_path, calls, monkeypatch):
    seen = []

    def fake_run_mode(mode_topo, options, events, run, client, doctor=True):
        seen.append((mode_topo.connector.type, doctor))
        if mode_topo.connector.type == "kvpush":
            raise KvpushError("doctor: ucx-env failed")  # `up` refused: nothing started, no up_s
        run.up_s = 60.0

    monkeypatch.setattr(bench_runner, "_run_mode", fake_run_mode)
    run_bench(topo, _options(tmp_path, ["kvpush", "nixl-pull", "colocated"]))
    assert seen == [("kvpush", True), ("nixl-pull", True), ("colocated", False)]


def test_the_client_runs_beside_a_pinned_local_router(topo, tmp_path, calls, monkeypatch):
    monkeypatch.setattr(bench_runner, "_run_mode", lambda *a, **k: None)
    run_bench(topo, _options(tmp_path, ["kvpush"]))
    assert _NoClient.cpu_cores == topo.router.cpu_cores == "1"
    remote = topo.model_copy(update={"hosts": {"local": topo.hosts["local"].model_copy(update={"address": "10.0.0.9"})}})
    run_bench(remote, _options(tmp_path, ["kvpush"]))
    assert _NoClient.cpu_cores is None  # a router on another machine says nothing about this one's cores
