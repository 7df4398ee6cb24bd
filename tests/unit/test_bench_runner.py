"""kvpush.bench.runner: teardown always happens, a failed mode doesn't stop the others,
Ctrl-C stops the bench and still writes what was measured. The steps that touch processes are
fakes passed in BenchSteps; tests/e2e/test_bench_real.py runs the real thing."""
from __future__ import annotations

import dataclasses
import gzip
import json

import pytest

from kvpush.common.errors import KvpushError, UsageError
from kvpush.bench.deployment import Deployed, timed
from kvpush.bench.handoff import spans_document
from kvpush.bench.modes import bench_topology, topology_hash
from kvpush.bench.options import BenchOptions, seed_for
from kvpush.bench.results import ClientResult, RatePoint, Stats
from kvpush.bench.runner import BenchSteps, run_bench
from kvpush.bench.scrape import RouterFigures
from kvpush.deploy.lifecycle.lifecycle import DownResult
from kvpush.deploy.topology.topology import parse_topology
from kvpush.templates import DEFAULT_TEMPLATE, template_text


@pytest.fixture(autouse=True)
def no_plots(monkeypatch):
    """Drawing the PNGs is test_bench_plots.py's subject; here it would only cost seconds per test."""
    monkeypatch.setattr("kvpush.bench.report.write_plots", lambda runs, out, subtitle: [])


@pytest.fixture
def topo():
    return parse_topology(template_text(DEFAULT_TEMPLATE))


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


class _NoSpans:
    """Stands in for the bench's span receiver (span_receiver.py has tests of its own)."""

    endpoint = "http://127.0.0.1:9/v1/traces"

    def __init__(self):
        self.closed = 0

    def close(self):
        self.closed += 1


class _Steps:
    """Deploys and measures without processes, recording every step in `calls`: every measured
    point's TTFT is 100 ms x its round + 1. Each fake can be replaced per test."""

    def __init__(self, tmp_path):
        self.calls: list[tuple] = []
        self.tmp_path = tmp_path
        self.failing_deploys: set[str] = set()  # connector types whose `up` fails
        self.traced_to: list[str | None] = []  # per `up`: where its instances send their spans
        self.receivers: list[_NoSpans] = []

    def deploy(self, mode_topo, options, events, run, stack, doctor):
        self.calls.append(("up", mode_topo.name, mode_topo.connector.type, doctor))
        self.traced_to.append(mode_topo.tracing.otlp_endpoint if mode_topo.tracing else None)
        with timed(run, "up"):
            if mode_topo.connector.type in self.failing_deploys:
                raise KvpushError("prefill-0 exited before it became ready")
        run.up_s = run.phases_s["up"]
        return Deployed(mode_topo, run, [], None, "", "", {})

    def measure(self, d, options, events, client, rate_index, round_index=0):
        self.calls.append(("measure", d.run.mode, options.rates[rate_index], round_index))
        ttft = 100.0 * (round_index + 1)
        stats = Stats(ttft, ttft, ttft, ttft)
        client_result = ClientResult(options.rates[rate_index], 2, 0, 2.0, 1.0, 3.0, 22.0, 16, 6, 2,
                                     {m: stats for m in ("ttft", "tpot", "itl", "e2el")})
        router = RouterFigures(5.0, 9.0, 6.0, 2, 0.0, 0.0, {"success": 2.0})
        spans_file = None
        if d.spans is not None and d.run.mode != "colocated":  # one request joined, one not
            spans_file = f"{d.run.mode}-{rate_index}-{round_index}-spans.json.gz"
            document = spans_document("r-", ["r-0", "r-1"], [
                {"deployment": "d", "instance": f"{role}-0", "role": role, "start_unix_nano": 10**18,
                 "attributes": {"gen_ai.request.id": f"cmpl-r-0-{'ab' * 16}-0", "gen_ai.latency.time_to_first_token": ttft,
                                "gen_ai.latency.time_in_queue": 0.0, "gen_ai.latency.time_in_model_prefill": 0.0}}
                for role, ttft in (("prefill", 0.01), ("decode", 0.01 * (round_index + 2)))])
            with gzip.open(options.out_dir / spans_file, "wt") as f:
                json.dump(document, f)
        point = RatePoint(d.run.mode, options.rates[rate_index], seed_for(options.seed, rate_index, round_index),
                          client_result, router, [], round=round_index, spans_file=spans_file)
        path = self.tmp_path / f"{d.run.mode}-{rate_index}-{round_index}.json"
        path.write_text(json.dumps({"completed": 2, "ttfts": [ttft / 1000] * 2, "latencies": [0.5, 0.5], "output_lens": [3, 3],
                                    "itls": [[0.01, 0.01]] * 2, "errors": ["", ""]}))
        return point, path

    def down(self, name, options=None):
        self.calls.append(("down", name))
        return DownResult(stopped=["router"])

    def bench_steps(self, **replaced) -> BenchSteps:
        return BenchSteps(**{"deploy": self.deploy, "measure": self.measure, "down": self.down,
                             "save_logs": lambda topo, options, mode: None, "client": _NoClient,
                             "spans": self.receiver, **replaced})

    def receiver(self) -> _NoSpans:
        self.receivers.append(_NoSpans())
        return self.receivers[-1]


@pytest.fixture
def fakes(tmp_path):
    return _Steps(tmp_path)


def _options(tmp_path, modes):
    return BenchOptions(modes=modes, rates=[1.0], input_len=8, output_len=2, num_prompts=1, out_dir=tmp_path,
                        baseline=modes[0])


def _modes_run(calls) -> list[tuple]:
    return [(c[0], c[2]) if c[0] == "up" else c[:2] for c in calls if c[0] in ("up", "down")]


def test_a_failed_mode_is_recorded_torn_down_and_the_next_mode_runs(topo, tmp_path, fakes):
    fakes.failing_deploys = {"kvpush"}
    report = run_bench(topo, _options(tmp_path, ["kvpush", "nixl-pull"]), steps=fakes.bench_steps())
    assert _modes_run(fakes.calls) == [("up", "kvpush"), ("down", "local-cpu-bench"), ("up", "nixl-pull"), ("down", "local-cpu-bench")]
    assert report.runs[0].error.startswith("prefill-0 exited")
    assert report.runs[1].error is None and [p.rate for p in report.runs[1].points] == [1.0]
    document = json.loads((tmp_path / "bench.json").read_text())
    assert document["runs"][0]["error"] and not document["interrupted"]


def test_ctrl_c_tears_down_stops_the_bench_and_keeps_partial_results(topo, tmp_path, fakes):
    def interrupted(*args):
        fakes.calls.append(("up", "", "nixl-pull"))
        raise KeyboardInterrupt

    report = run_bench(topo, _options(tmp_path, ["nixl-pull", "colocated"]), steps=fakes.bench_steps(deploy=interrupted))
    assert _modes_run(fakes.calls) == [("up", "nixl-pull"), ("down", "local-cpu-bench")]  # colocated never started
    assert report.interrupted and _NoClient.closed >= 1  # the client process is stopped too
    assert json.loads((tmp_path / "bench.json").read_text())["interrupted"] is True


def test_a_deployment_that_does_not_stop_is_an_error(topo, tmp_path, fakes):
    with pytest.raises(KvpushError, match="could not stop decode-0"):
        run_bench(topo, _options(tmp_path, ["colocated"]),
                  steps=fakes.bench_steps(down=lambda name, options=None: DownResult(left_running=["decode-0"])))


def test_options_are_checked_before_anything_starts(topo, tmp_path, fakes):
    with pytest.raises(UsageError, match="--num-prompts must be at least 1"):
        run_bench(topo, BenchOptions(modes=["colocated"], rates=[1.0], input_len=8, output_len=2, num_prompts=0,
                                     out_dir=tmp_path, baseline="colocated"), steps=fakes.bench_steps())
    with pytest.raises(UsageError, match="--baseline nixl-pull is not among --modes"):
        run_bench(topo, BenchOptions(modes=["colocated"], rates=[1.0], input_len=8, output_len=2, num_prompts=1,
                                     out_dir=tmp_path), steps=fakes.bench_steps())
    assert fakes.calls == []


def test_seeds_differ_per_rate_and_match_across_modes():
    seeds = [seed_for(0, i) for i in range(4)]
    assert len(set(seeds)) == 4
    assert seed_for(7, 2) == seed_for(7, 2)
    assert seed_for(0, 0) != seed_for(1, 0)


def test_where_the_time_went_is_recorded_per_mode_also_for_a_failed_mode(topo, tmp_path, fakes):
    fakes.failing_deploys = {"kvpush"}
    run_bench(topo, _options(tmp_path, ["kvpush"]), steps=fakes.bench_steps())
    phases = json.loads((tmp_path / "bench.json").read_text())["runs"][0]["phases_s"]
    assert set(phases) == {"up", "down"}
    assert all(v >= 0 for v in phases.values())


def test_doctor_checks_the_hosts_until_one_mode_started(topo, tmp_path, fakes):
    fakes.failing_deploys = {"kvpush"}  # `up` refused: nothing started, no up_s
    run_bench(topo, _options(tmp_path, ["kvpush", "nixl-pull", "colocated"]), steps=fakes.bench_steps())
    assert [(c[2], c[3]) for c in fakes.calls if c[0] == "up"] == [("kvpush", True), ("nixl-pull", True), ("colocated", False)]


def test_the_client_runs_beside_a_pinned_local_router(topo, tmp_path, fakes):
    run_bench(topo, _options(tmp_path, ["kvpush"]), steps=fakes.bench_steps())
    assert _NoClient.cpu_cores == topo.router.cpu_cores == "1"
    remote = topo.model_copy(update={"hosts": {"local": dataclasses.replace(topo.hosts["local"], address="10.0.0.9")}})
    run_bench(remote, _options(tmp_path, ["kvpush"]), steps=fakes.bench_steps())
    assert _NoClient.cpu_cores is None  # a router on another machine says nothing about this one's cores


def _rounds_options(tmp_path, modes, rounds=3, **extra):
    return BenchOptions(modes=modes, rates=[1.0, 2.0], input_len=8, output_len=3, num_prompts=2, out_dir=tmp_path,
                        baseline=modes[-1], port_base=15200, rounds=rounds, **extra)


def test_rounds_start_every_mode_first_then_interleave_them_rotating_the_order(topo, tmp_path, fakes):
    report = run_bench(topo, _rounds_options(tmp_path, ["kvpush", "colocated", "nixl-pull"]), steps=fakes.bench_steps())
    names = {m: f"local-cpu-bench-{m}" for m in ("kvpush", "colocated", "nixl-pull")}
    assert [c[1] for c in fakes.calls[:3]] == [names["kvpush"], names["colocated"], names["nixl-pull"]]
    measured = [c[1:] for c in fakes.calls if c[0] == "measure"]
    assert measured[:3] == [("kvpush", 1.0, 0), ("colocated", 1.0, 0), ("nixl-pull", 1.0, 0)]
    assert measured[6:9] == [("colocated", 1.0, 1), ("nixl-pull", 1.0, 1), ("kvpush", 1.0, 1)]
    assert measured[12:15] == [("nixl-pull", 1.0, 2), ("kvpush", 1.0, 2), ("colocated", 1.0, 2)]
    assert len(measured) == 3 * 2 * 3
    assert [c[1] for c in fakes.calls if c[0] == "down"] == list(names.values())
    run = report.runs[0]
    assert [p.rate for p in run.points] == [1.0, 2.0] and all(p.round == -1 for p in run.points)
    assert run.points[0].client.completed == 3 * 2
    assert run.points[0].client.latency["ttft"].p50 == pytest.approx(200.0)  # pooled over 100, 200, 300 ms
    assert len(run.round_points) == 6
    document = json.loads((tmp_path / "bench.json").read_text())
    assert document["options"]["rounds"] == 3
    assert document["paired_ratios_vs_baseline"]["kvpush"]["1"]["ttft_p50"] == pytest.approx([1.0, 1.0, 1.0])
    seeds = document["configuration"]["client"]["seeds"]["1"]
    assert len(set(seeds)) == 3  # fresh prompts every round: no prefix-cache hits from an earlier round


def test_rounds_go_on_without_a_mode_that_failed_to_start_and_stop_it_too(topo, tmp_path, fakes):
    fakes.failing_deploys = {"nixl-push"}
    report = run_bench(topo, _rounds_options(tmp_path, ["kvpush", "nixl-push", "nixl-pull"], rounds=2), steps=fakes.bench_steps())
    assert {c[1] for c in fakes.calls if c[0] == "measure"} == {"kvpush", "nixl-pull"}
    # The mode that failed to start is stopped at once (whatever `up` left), the others at the end.
    assert [c[1] for c in fakes.calls if c[0] == "down"] == [f"local-cpu-bench-{m}" for m in ("nixl-push", "kvpush", "nixl-pull")]
    assert report.runs[1].error.startswith("prefill-0 exited") and report.runs[1].points == []


def test_rounds_need_their_own_ports_and_a_sane_count(topo, tmp_path, fakes):
    with pytest.raises(UsageError, match="give --port-base"):
        run_bench(topo, dataclasses.replace(_rounds_options(tmp_path, ["kvpush", "nixl-pull"]), port_base=None),
                  steps=fakes.bench_steps())
    with pytest.raises(UsageError, match="--rounds must be between 1 and 50"):
        run_bench(topo, _rounds_options(tmp_path, ["kvpush", "nixl-pull"], rounds=0), steps=fakes.bench_steps())
    assert fakes.calls == []


def test_seeds_differ_per_round():
    assert seed_for(0, 1, 0) == seed_for(0, 1) != seed_for(0, 1, 1)
    assert len({seed_for(0, r, k) for r in range(10) for k in range(5)}) == 50


def test_rounds_check_the_hosts_for_every_mode(topo, tmp_path, fakes):
    run_bench(topo, _rounds_options(tmp_path, ["kvpush", "colocated", "nixl-pull"], rounds=2), steps=fakes.bench_steps())
    # All deployments are up together on the same hosts: ports and memory add up, so each is checked.
    assert [(c[2], c[3]) for c in fakes.calls if c[0] == "up"] == [("kvpush", True), ("colocated", True), ("nixl-pull", True)]


def test_a_mode_failing_mid_rounds_is_stopped_at_once_and_the_others_go_on(topo, tmp_path, fakes):
    def failing_measure(d, options, events, client, rate_index, round_index=0):
        if d.run.mode == "colocated" and round_index == 1:
            raise KvpushError("vllm bench serve did not finish within 300 s")
        return fakes.measure(d, options, events, client, rate_index, round_index)

    report = run_bench(topo, _rounds_options(tmp_path, ["kvpush", "colocated", "nixl-pull"], rounds=3),
                       steps=fakes.bench_steps(measure=failing_measure))
    events = [c[:2] if c[0] == "down" else (c[0], c[1], c[3]) for c in fakes.calls if c[0] in ("down", "measure")]
    down_at = events.index(("down", "local-cpu-bench-colocated"))
    assert ("measure", "colocated", 1) not in events[down_at:] and ("measure", "kvpush", 2) in events[down_at:]
    assert [c[1] for c in fakes.calls if c[0] == "down"][-2:] == ["local-cpu-bench-kvpush", "local-cpu-bench-nixl-pull"]
    colocated = report.runs[1]
    assert colocated.error.startswith("vllm bench serve did not finish")
    assert [p.round for p in colocated.round_points] == [0, 0]  # what it measured before failing is kept
    # Rotation is over the modes still running: round 2 of 2 live modes starts where round 0 did
    # (rotating over all 3 would have put nixl-pull first).
    assert [c[1] for c in fakes.calls if c[0] == "measure" and c[3] == 2][:2] == ["kvpush", "nixl-pull"]


def test_ctrl_c_in_rounds_stops_every_deployment_and_keeps_what_was_measured(topo, tmp_path, fakes):
    def interrupted_measure(d, options, events, client, rate_index, round_index=0):
        if round_index == 1:
            raise KeyboardInterrupt
        return fakes.measure(d, options, events, client, rate_index, round_index)

    report = run_bench(topo, _rounds_options(tmp_path, ["kvpush", "nixl-pull"], rounds=3),
                       steps=fakes.bench_steps(measure=interrupted_measure))
    assert report.interrupted
    assert sorted(c[1] for c in fakes.calls if c[0] == "down") == ["local-cpu-bench-kvpush", "local-cpu-bench-nixl-pull"]
    document = json.loads((tmp_path / "bench.json").read_text())
    assert document["interrupted"] and [p["client"]["completed"] for p in document["runs"][0]["points"]] == [2, 2]


def test_one_deployment_that_does_not_stop_does_not_keep_the_others_up(topo, tmp_path, fakes):
    def down(name, options=None):
        fakes.calls.append(("down", name))
        return DownResult(left_running=["decode-0"]) if name.endswith("-kvpush") else DownResult(stopped=["router"])

    with pytest.raises(KvpushError, match="local-cpu-bench-kvpush: could not stop decode-0"):
        run_bench(topo, _rounds_options(tmp_path, ["kvpush", "nixl-pull"], rounds=2), steps=fakes.bench_steps(down=down))
    assert [c[1] for c in fakes.calls if c[0] == "down"] == ["local-cpu-bench-kvpush", "local-cpu-bench-nixl-pull"]
    assert json.loads((tmp_path / "bench.json").read_text())["runs"][1]["points"]  # results still written


def test_every_modes_instances_send_their_spans_to_one_receiver_closed_with_the_bench(topo, tmp_path, fakes):
    run_bench(topo, _options(tmp_path, ["kvpush", "colocated"]), steps=fakes.bench_steps())
    [receiver] = fakes.receivers
    assert fakes.traced_to == [receiver.endpoint] * 2 and receiver.closed == 1
    document = json.loads((tmp_path / "bench.json").read_text())
    assert document["configuration"]["engine_timings"]["taken"] is True
    # where the spans go is the measurement's, not the deployment's: the hashes of a run without them
    assert document["configuration"]["topology_hashes"]["kvpush"] == topology_hash(bench_topology(topo, "kvpush"))


def test_no_spans_when_asked_not_to_or_when_an_instance_runs_elsewhere(topo, tmp_path, fakes):
    run_bench(topo, dataclasses.replace(_options(tmp_path, ["kvpush"]), engine_timings=False), steps=fakes.bench_steps())
    assert json.loads((tmp_path / "bench.json").read_text())["configuration"]["engine_timings"] == {
        "taken": False, "why_not": "--no-engine-timings"}
    remote = topo.model_copy(update={"hosts": {"local": dataclasses.replace(topo.hosts["local"], address="10.0.0.9")}})
    run_bench(remote, _options(tmp_path, ["kvpush"]), steps=fakes.bench_steps())
    why_not = json.loads((tmp_path / "bench.json").read_text())["configuration"]["engine_timings"]["why_not"]
    assert "instances on local" in why_not and "wall clock" in why_not
    assert fakes.receivers == [] and fakes.traced_to == [None, None]


def test_rounds_pool_the_engine_handoff_of_every_round(topo, tmp_path, fakes):
    report = run_bench(topo, _rounds_options(tmp_path, ["kvpush", "colocated"], rounds=2), steps=fakes.bench_steps())
    kvpush, colocated = report.runs
    pooled = kvpush.points[0].engine_handoff
    assert (pooled.requests, pooled.joined) == (4, 2)  # two rounds of two requests, one joined in each
    assert pooled.answer_to_first["p50"] == pytest.approx(15.0, abs=1e-3)  # 10 ms and 20 ms
    assert all(p.engine_handoff is None for p in colocated.points)
