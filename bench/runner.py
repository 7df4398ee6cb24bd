"""Run a bench: for each mode, deploy its topology, drive each rate with `vllm bench serve` and
scrape /metrics around it, bring it down again (also on Ctrl-C or failure); or, with --rounds,
every mode up at once and the modes taking turns. Reports through BenchEvents.

The steps that touch hosts and processes (deploy, measure, down, keeping logs, the load client)
come in a BenchSteps, so the orchestration is tested with fakes of them.
"""
from __future__ import annotations

import dataclasses
import time
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Callable

from kvpush.common.errors import KvpushError
from kvpush.deploy.lifecycle.lifecycle import DownResult, LifecycleOptions, down
from kvpush.deploy.lifecycle.secrets import client_api_key
from kvpush.deploy.topology.topology import Topology

from .client import BenchClient
from .deployment import Deployed, client_cores, deploy_mode, no_interrupts, save_logs, timed
from .engine_timings import engine_timings_note, engine_timings_unavailable, read_kept
from .handoff import HandoffSamples
from .measure import measure_rate
from .modes import topology_hash
from .options import BenchEvents, BenchOptions, mode_topology
from .raw import read_text
from .report import BenchReport, configuration, write_outputs
from .results import ModeRun, RequestSamples, parse_request_samples, pool_points
from .span_receiver import SpanReceiver


@dataclass(frozen=True)
class BenchSteps:
    deploy: Callable[..., Deployed] = deploy_mode  # (topo, options, events, run, stack, doctor) -> Deployed
    measure: Callable[..., tuple] = measure_rate  # (deployed, options, events, client, rate_index, round_index)
    down: Callable[[str, LifecycleOptions], DownResult] = down
    save_logs: Callable[[Topology, BenchOptions, str], None] = save_logs
    client: Callable[..., BenchClient] = BenchClient  # (log_path, cpu_cores=...) -> started, run, closed
    spans: Callable[[], SpanReceiver] = lambda: SpanReceiver().start()  # started; closed by the bench


def _run_mode(topo: Topology, options: BenchOptions, events: BenchEvents, run: ModeRun, client: BenchClient,
              steps: BenchSteps, doctor: bool, spans: SpanReceiver | None) -> None:
    with ExitStack() as stack:
        deployed = steps.deploy(topo, options, events, run, stack, doctor)
        deployed.spans = spans
        for index in range(len(options.rates)):
            point, _ = steps.measure(deployed, options, events, client, index)
            run.points.append(point)


def _tear_down(
    mode_topo: Topology, options: BenchOptions, events: BenchEvents, run: ModeRun, steps: BenchSteps
) -> None:
    events.mode(run.mode, "stopping the deployment")
    with no_interrupts():
        with timed(run, "down"):
            result = steps.down(mode_topo.name, options.lifecycle)
        try:
            steps.save_logs(mode_topo, options, run.mode)
        except KvpushError as exc:
            events.mode_failed(run.mode, f"could not keep its logs: {exc}")
    if not result.complete:
        raise KvpushError(
            f"deployment {mode_topo.name}: could not stop {', '.join(result.left_running) or 'every process'}"
            f" ({'; '.join(result.unreachable.values())}); run `kvpush down` for it"
        )
    events.mode(run.mode, "done" if run.error is None else "failed")


def _run_rounds(topo: Topology, options: BenchOptions, events: BenchEvents, report: BenchReport, client: BenchClient,
                steps: BenchSteps, spans: SpanReceiver | None) -> None:
    """Every mode's deployment up at once, then `rounds` passes over the rates, each pass running every
    mode in turn (the order rotating by one per round) on prompts of its own. Modes measured minutes
    apart instead of a whole mode's run apart: drift of the machine hits them alike. A mode that
    fails is stopped at once (it would otherwise share the cores with the modes still measured)."""
    topos = {mode: mode_topology(topo, options, mode) for mode in options.modes}
    running: list[ModeRun] = []  # started and not yet stopped
    failures: list[str] = []
    samples: dict[tuple[str, float], list[RequestSamples]] = {}
    handoffs: dict[tuple[str, float], list[HandoffSamples]] = {}

    def stop(runs: list[ModeRun]) -> None:
        with no_interrupts():  # every deployment up must come down, even on a second Ctrl-C
            for run in runs:
                running.remove(run)
                try:
                    _tear_down(topos[run.mode], options, events, run, steps)
                except Exception as exc:  # noqa: BLE001 - the others must still be stopped
                    failures.append(str(exc))
                    events.mode_failed(run.mode, str(exc))

    def failed(run: ModeRun, error: str) -> None:
        run.error = error
        events.mode_failed(run.mode, error)
        stop([run])

    try:
        with ExitStack() as stack:
            deployed: list[Deployed] = []
            for mode in options.modes:
                run = ModeRun(mode, topology_hash(topos[mode]))
                report.runs.append(run)
                running.append(run)
                try:
                    # Doctor for every mode: the deployments add up on the same hosts (ports, memory).
                    deployed.append(steps.deploy(topos[mode], options, events, run, stack, True))
                    deployed[-1].spans = spans
                except KvpushError as exc:
                    failed(run, str(exc))
            for round_index in range(options.rounds):
                live = [d for d in deployed if d.run.error is None]
                shift = round_index % max(len(live), 1)
                for rate_index, rate in enumerate(options.rates):
                    for d in live[shift:] + live[:shift]:
                        if d.run.error is not None:
                            continue
                        try:
                            point, path = steps.measure(d, options, events, client, rate_index, round_index)
                            got = parse_request_samples(read_text(path), str(path))
                        except KvpushError as exc:
                            failed(d.run, str(exc))
                            continue
                        d.run.round_points.append(point)
                        samples.setdefault((d.run.mode, rate), []).append(got)
                        if point.spans_file is not None:
                            handoffs.setdefault((d.run.mode, rate), []).append(
                                read_kept(options.out_dir / point.spans_file))
    finally:
        stop(list(running))
        for run in report.runs:
            for rate in options.rates:
                points = [p for p in run.round_points if p.rate == rate]
                if points:
                    run.points.append(pool_points(points, samples[(run.mode, rate)], options.slo,
                                                  handoffs.get((run.mode, rate))))
    if failures:
        raise KvpushError("; ".join(failures))


def run_bench(topo: Topology, options: BenchOptions, events: BenchEvents = BenchEvents(),
              steps: BenchSteps = BenchSteps()) -> BenchReport:
    options.validate()
    client_api_key(topo)  # an unset router key is bad input before any deployment starts, not a failure per mode
    options.out_dir.mkdir(parents=True, exist_ok=True)
    spans = steps.spans() if options.engine_timings and engine_timings_unavailable(topo) is None else None
    try:
        return _bench(topo, options if spans is None else dataclasses.replace(options, traces_endpoint=spans.endpoint),
                      events, steps, spans)
    finally:
        if spans is not None:
            spans.close()


def _bench(topo: Topology, options: BenchOptions, events: BenchEvents, steps: BenchSteps,
           spans: SpanReceiver | None) -> BenchReport:
    report = BenchReport(options, configuration(topo, options))
    report.configuration["engine_timings"] = engine_timings_note(topo, options)
    client = steps.client(options.out_dir / "logs" / "client.log", cpu_cores=client_cores(topo))
    try:
        client.start()  # vLLM's import overlaps the first deployment's start
        if options.rounds > 1:
            _run_rounds(topo, options, events, report, client, steps, spans)
        else:
            hosts_checked = False
            for mode in options.modes:
                mode_topo = mode_topology(topo, options, mode)
                run = ModeRun(mode, topology_hash(mode_topo))
                report.runs.append(run)
                try:
                    _run_mode(mode_topo, options, events, run, client, steps, not hosts_checked, spans)
                except KvpushError as exc:
                    run.error = str(exc)
                    events.mode_failed(mode, run.error)
                finally:
                    hosts_checked = hosts_checked or run.up_s is not None  # `up` returned: doctor passed
                    _tear_down(mode_topo, options, events, run, steps)
    except KeyboardInterrupt:
        report.interrupted = True
    finally:
        client.close()
        report.finished_at = time.time()
        write_outputs(report)
    return report
