"""Run a bench: for each mode, `up` its topology, drive each rate with `vllm bench serve`, scrape
/metrics around it, `down` again (also on Ctrl-C or failure). Reports through BenchEvents."""
from __future__ import annotations

import dataclasses
import json
import os
import signal
import threading
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from kvpush.common.errors import KvpushError, UsageError
from ..hosts import connected
from ..lifecycle import Events, LifecycleOptions, down, prove_kv_transfer, up
from ..plan import build_plan
from ..runners import LocalRunner, Runner
from ..secrets import AccessKeys, client_api_key, kept_secret
from ..state import HostRecord, load_state
from ..tiny_model import describe, make_tiny_model
from ..topology import Topology
from . import environment
from .client import BenchClient, LoadSpec
from .idle_cpu import idle_cores
from .modes import DEFAULT_BASELINE, ROUNDS_NEED_PORT_BASE, bench_topology, kv_bytes_per_token, topology_hash
from .plots import write_plots
from .results import (ModeRun, RatePoint, RequestSamples, paired_ratios, parse_client_result, parse_request_samples,
                      point_to_dict, pool_points, ratios_vs_baseline)
from .scrape import instance_figures, out_of_rotation, router_figures

RESULT_FILE = "bench.json"
MAX_ROUNDS = 50
ROTATION_TIMEOUT_S = 30.0
ROUND_SEED_STRIDE = 100_000
WARMUP_REQUESTS = 2  # one per instance of a 1P1D / 2-server deployment, through the router


@dataclass(frozen=True)
class BenchOptions:
    modes: list[str]
    rates: list[float]
    input_len: int
    output_len: int
    num_prompts: int
    out_dir: Path
    kv_heavy: bool = False
    baseline: str = DEFAULT_BASELINE
    port_base: int | None = None
    rounds: int = 1  # > 1: every mode up at once, the rates run `rounds` times with the modes interleaved
    seed: int = 0
    tokenizer: str | None = None
    client_timeout_s: float = 900.0
    lifecycle: LifecycleOptions = field(default_factory=LifecycleOptions)

    def validate(self) -> None:
        for name in ("input_len", "output_len", "num_prompts"):
            if getattr(self, name) < 1:
                raise UsageError(f"--{name.replace('_', '-')} must be at least 1 (got {getattr(self, name)})")
        if not 1 <= self.rounds <= MAX_ROUNDS:
            raise UsageError(f"--rounds must be between 1 and {MAX_ROUNDS} (got {self.rounds})")
        if self.rounds > 1 and self.port_base is None:
            raise UsageError(ROUNDS_NEED_PORT_BASE)
        if self.baseline not in self.modes:
            raise UsageError(f"--baseline {self.baseline} is not among --modes {','.join(self.modes)}; add it or choose "
                             f"another baseline")


class BenchEvents:
    """What a bench tells the user while it runs; the CLI renders it. Default: silent."""

    def mode(self, mode: str, status: str) -> None: ...

    def rate_started(self, mode: str, rate: float, expected_s: float) -> None: ...

    def rate_done(self, mode: str, point: RatePoint) -> None: ...

    def mode_failed(self, mode: str, error: str) -> None: ...

    def lifecycle(self) -> Events:
        return Events()


def seed_for(base: int, rate_index: int, round_index: int = 0) -> int:
    """Every rate (and every round) gets its own prompts; every mode gets the same prompts at the same rate
    and round (fair comparison: each mode has its own servers, so nothing is cached from another mode)."""
    return base + 1000 * (rate_index + 1) + ROUND_SEED_STRIDE * round_index


def mode_topology(topo: Topology, options: BenchOptions, mode: str) -> Topology:
    """What the bench deploys for `mode`: with --rounds every mode has a name and ports of its own."""
    index = options.modes.index(mode) if options.rounds > 1 else None
    return bench_topology(topo, mode, kv_heavy=options.kv_heavy, port_base=options.port_base, mode_index=index)


@dataclass
class BenchReport:
    options: BenchOptions
    configuration: dict
    runs: list[ModeRun] = field(default_factory=list)
    started_at: float = field(default_factory=time.time)
    finished_at: float | None = None
    interrupted: bool = False
    files: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        o = self.options
        return {
            "kvpush_bench": 1,
            "started_at": self.started_at,
            "finished_at": self.finished_at,
            "wall_s": None if self.finished_at is None else self.finished_at - self.started_at,
            "interrupted": self.interrupted,
            "options": {"modes": o.modes, "rates": o.rates, "input_len": o.input_len, "output_len": o.output_len,
                        "num_prompts": o.num_prompts, "kv_heavy": o.kv_heavy, "baseline": o.baseline, "seed": o.seed,
                        "port_base": o.port_base, "rounds": o.rounds},
            "configuration": self.configuration,
            "runs": [{"mode": r.mode, "topology_hash": r.topology_hash, "up_s": r.up_s, "error": r.error,
                      "idle_cores": r.idle_cores, "phases_s": r.phases_s,
                      "points": [point_to_dict(p) for p in r.points],
                      "round_points": [point_to_dict(p) for p in r.round_points]} for r in self.runs],
            "ratios_vs_baseline": {m: {f"{rate:g}": v for rate, v in by_rate.items()}
                                   for m, by_rate in ratios_vs_baseline(self.runs, o.baseline).items()},
            "paired_ratios_vs_baseline": {m: {f"{rate:g}": v for rate, v in by_rate.items()}
                                          for m, by_rate in paired_ratios(self.runs, o.baseline).items()},
        }


def configuration(topo: Topology, options: BenchOptions) -> dict:
    base = mode_topology(topo, options, options.modes[0])
    model = base.model
    config = {
        "versions": environment.versions(),
        "machine": environment.machine(),
        "topology": {"name": topo.name, "bench_deployment": base.name, "platform": topo.platform,
                     "prefill": len(topo.prefill), "decode": len(topo.decode),
                     "instances": [s.model_dump(mode="json", include={"name", "host", "cpu_cores", "kv_cache_gib"})
                                   for _, _, s in base.instances()]},
        "topology_hashes": {m: topology_hash(mode_topology(topo, options, m)) for m in options.modes},
        "model": {"path": model.path, "served_name": model.name, "max_model_len": model.max_model_len,
                  "dtype": model.dtype, "tiny": model.tiny.model_dump() if model.tiny else None,
                  "description": describe(model.tiny) if model.tiny else None,
                  "kv_bytes_per_token": kv_bytes_per_token(model.tiny) if model.tiny else None},
        "client": {"tool": "vllm bench serve", "process": "one warm process runs its CLI entry point for every rate",
                   "dataset": "random", "arrivals": "poisson", "ignore_eos": True,
                   "temperature": 0, "seeds": {f"{r:g}": [seed_for(options.seed, i, k) for k in range(options.rounds)]
                                               for i, r in enumerate(options.rates)}},
    }
    per_token = config["model"]["kv_bytes_per_token"]
    if per_token:
        config["model"]["kv_bytes_per_prompt"] = per_token * options.input_len
    return config


# -- talking to a running deployment -----------------------------------------------------------


@dataclass(frozen=True)
class Endpoint:
    name: str
    role: str  # prefill | decode | router
    host: str
    metrics_url: str


def _endpoints(deployment: str) -> list[Endpoint]:
    state = load_state(deployment)
    if state is None:
        raise KvpushError(f"deployment {deployment}: no state after `up`; nothing to measure")
    return [Endpoint(r.name, r.role, r.host, r.health_url.rsplit("/", 1)[0] + "/metrics") for r in state.processes.values()]


def router_base_url(topo: Topology) -> str:
    host = topo.hosts[topo.router.host]
    plan_url = build_plan(topo).router_url
    return plan_url if host.is_local else f"http://{host.address}:{topo.router.port}"


def _scrape(runners: dict[str, Runner], endpoints: list[Endpoint], keys: AccessKeys) -> dict[str, str]:
    pages = {}
    for e in endpoints:
        response = runners[e.host].http("GET", e.metrics_url, timeout=15, headers=keys.headers(e.role))
        if response.status != 200:
            raise KvpushError(f"{e.name} on host {e.host}: {e.metrics_url} answered HTTP {response.status}")
        pages[e.name] = response.text()
    return pages


def _wait_in_rotation(runner: Runner, router: Endpoint, timeout_s: float, keys: AccessKeys) -> None:
    end = time.monotonic() + timeout_s
    while True:
        response = runner.http("GET", router.metrics_url, timeout=15, headers=keys.headers("router"))
        left = out_of_rotation(response.text()) if response.status == 200 else ["(router /metrics unavailable)"]
        if not left:
            return
        if time.monotonic() > end:
            raise KvpushError(f"the router still has {', '.join(left)} out of rotation {timeout_s:.0f} s after every "
                              f"process was ready; see `kvpush logs router`")
        time.sleep(0.2)


def _warm_up(runner: Runner, base_url: str, model: str, keys: AccessKeys) -> None:
    for i in range(WARMUP_REQUESTS):
        body = json.dumps({"model": model, "prompt": f"warm up {i} {time.time()}", "max_tokens": 2, "temperature": 0}).encode()
        response = runner.http("POST", base_url + "/v1/completions", body, timeout=300, headers=keys.headers("router"))
        if response.status != 200:
            raise KvpushError(f"warm-up request through the router {base_url} answered HTTP {response.status}: "
                              f"{response.text()[:200]}; see `kvpush logs`")


def _idle_cores(runners: dict[str, Runner], state) -> dict[str, float]:
    """Per vLLM instance: cores used while no request is in flight (a spinning thread shows as ~1)."""
    out: dict[str, float] = {}
    for host in {r.host for r in state.processes.values()}:
        groups = {r.name: r.pgid for r in state.processes.values() if r.host == host and r.role != "router"}
        if groups:
            out.update(idle_cores(runners[host], groups))
    return {name: round(cores, 3) for name, cores in sorted(out.items())}


def save_logs(topo: Topology, options: BenchOptions, mode: str) -> None:
    """Keep each process's log of this mode (also when `up` failed): the next mode reuses the log paths."""
    logs_dir = options.out_dir / "logs"
    logs_dir.mkdir(parents=True, exist_ok=True)
    plan = build_plan(topo)
    # On Slurm the job has ended with `down`: the nodes' files are read where kvpush runs, as
    # clusters share the workdir's filesystem between nodes and login node.
    remote = {h.name: HostRecord.from_plan(h) for h in plan.hosts if h.slurm is None}
    with connected(remote, options.lifecycle.ssh) as (runners, _):
        runners = {**{h.name: LocalRunner(h.name) for h in plan.hosts if h.slurm is not None}, **runners}
        for host in plan.hosts:
            for proc in host.processes:
                try:
                    data = runners[host.name].read_file(proc.log_path) if host.name in runners else None
                except KvpushError:
                    continue
                if data is not None:
                    (logs_dir / f"{mode}-{proc.name}.log").write_bytes(data)


def resolve_tokenizer(topo: Topology, given: str | None) -> str:
    if given:
        return given
    path = Path(topo.model.path).expanduser()
    if (path / "tokenizer.json").is_file() or (path / "tokenizer_config.json").is_file():
        return str(path)
    if topo.model.tiny is not None:
        make_tiny_model(path, topo.model.tiny)  # same spec -> the same tokenizer the hosts use
        return str(path)
    raise UsageError(f"vllm bench serve needs the tokenizer of {topo.model.path} on this machine; pass --tokenizer DIR")


@contextmanager
def _no_interrupts() -> Iterator[None]:
    """Teardown must finish even if Ctrl-C is pressed again or a SIGTERM follows."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


# -- the bench ----------------------------------------------------------------------------------


@contextmanager
def timed(run: ModeRun, phase: str) -> Iterator[None]:
    """Record how long a phase of a mode took (also when it fails)."""
    started = time.monotonic()
    try:
        yield
    finally:
        run.phases_s[phase] = round(time.monotonic() - started, 2)


@dataclass
class Deployed:
    """One mode's running deployment, as the measuring loop needs it."""

    topo: Topology
    run: ModeRun
    endpoints: list[Endpoint]
    router: Endpoint
    base_url: str
    tokenizer: str
    runners: dict[str, Runner]
    keys: AccessKeys = AccessKeys()


def _deploy(topo: Topology, options: BenchOptions, events: BenchEvents, run: ModeRun, stack: ExitStack,
            doctor: bool = True) -> Deployed:
    """`up` one mode and make it ready to measure; its host connections stay open in `stack`."""
    events.mode(run.mode, "starting the deployment")
    # `up` proves KV moves right after every /health is 200, but the router takes instances it
    # ejected while they started back only at its next probe: prove once the router has them.
    # Doctor's checks (~5 s) look at the hosts, which every mode shares: once per bench is enough.
    lifecycle = dataclasses.replace(options.lifecycle, prove=False, doctor=options.lifecycle.doctor and doctor)
    with timed(run, "up"):
        up(topo, lifecycle, events.lifecycle())
    run.up_s = run.phases_s["up"]
    endpoints = _endpoints(topo.name)
    router = next(e for e in endpoints if e.role == "router")
    state = load_state(topo.name)
    assert state is not None
    (options.out_dir / "logs").mkdir(parents=True, exist_ok=True)
    runners, unreachable = stack.enter_context(
        connected({h: state.hosts[h] for h in {e.host for e in endpoints}}, options.lifecycle.ssh))
    if unreachable:
        raise KvpushError("cannot reach " + "; ".join(unreachable.values()))
    keys = AccessKeys.of(kept_secret(topo.name), client_api_key(topo))  # `up` just made or checked both
    deployed = Deployed(topo, run, endpoints, router, router_base_url(topo), resolve_tokenizer(topo, options.tokenizer),
                        runners, keys)
    with timed(run, "rotation"):
        _wait_in_rotation(runners[router.host], router, ROTATION_TIMEOUT_S, keys)
    if options.lifecycle.prove and topo.connector.type != "colocated":
        events.mode(run.mode, "proving KV moves")
        with timed(run, "prove"):
            prove_kv_transfer(runners, build_plan(topo), keys=keys)
    events.mode(run.mode, "warming up")
    with timed(run, "warm_up"):
        _warm_up(runners[router.host], deployed.base_url, topo.model.name, keys)
    events.mode(run.mode, "sampling idle CPU")
    with timed(run, "idle_cpu"):
        run.idle_cores = _idle_cores(runners, state)
    return deployed


def _measure(d: Deployed, options: BenchOptions, events: BenchEvents, client: BenchClient, rate_index: int,
             round_index: int = 0) -> tuple[RatePoint, Path]:
    """Drive one rate against one deployment; /metrics scraped before and after. Returns the point and
    the client's result file."""
    rate = options.rates[rate_index]
    seed = seed_for(options.seed, rate_index, round_index)
    name = f"{d.run.mode}-rate{rate:g}" + (f"-round{round_index + 1}" if options.rounds > 1 else "")
    raw_dir = options.out_dir / "raw"
    load = LoadSpec(base_url=d.base_url, served_model=d.topo.model.name, tokenizer=d.tokenizer, rate=rate,
                    num_prompts=options.num_prompts, input_len=options.input_len, output_len=options.output_len,
                    seed=seed, result_dir=str(raw_dir), result_filename=f"{name}.json")
    before = _scrape(d.runners, d.endpoints, d.keys)
    events.rate_started(d.run.mode, rate, options.num_prompts / rate)
    with timed(d.run, f"rate {rate:g}" + (f" round {round_index + 1}" if options.rounds > 1 else "")):
        path = client.run(load, options.out_dir / "logs" / f"{name}.log", options.client_timeout_s, d.keys.client)
    after = _scrape(d.runners, d.endpoints, d.keys)
    (raw_dir / f"{name}-metrics.json").write_text(json.dumps({"before": before, "after": after}))
    text = path.read_text()
    point = RatePoint(
        mode=d.run.mode, rate=rate, seed=seed, client=parse_client_result(text, str(path)),
        router=router_figures(before[d.router.name], after[d.router.name]),
        instances=[instance_figures(e.name, e.role, before[e.name], after[e.name]) for e in d.endpoints if e.role != "router"],
        round=round_index,
    )
    events.rate_done(d.run.mode, point)
    return point, path


def _run_mode(topo: Topology, options: BenchOptions, events: BenchEvents, run: ModeRun, client: BenchClient,
              doctor: bool = True) -> None:
    with ExitStack() as stack:
        deployed = _deploy(topo, options, events, run, stack, doctor)
        for index in range(len(options.rates)):
            point, _ = _measure(deployed, options, events, client, index)
            run.points.append(point)


def _tear_down(mode_topo: Topology, options: BenchOptions, events: BenchEvents, run: ModeRun) -> None:
    events.mode(run.mode, "stopping the deployment")
    with _no_interrupts():
        with timed(run, "down"):
            result = down(mode_topo.name, options.lifecycle)
        try:
            save_logs(mode_topo, options, run.mode)
        except KvpushError as exc:
            events.mode_failed(run.mode, f"could not keep its logs: {exc}")
    if not result.complete:
        raise KvpushError(f"deployment {mode_topo.name}: could not stop {', '.join(result.left_running) or 'every process'}"
                          f" ({'; '.join(result.unreachable.values())}); run `kvpush down` for it")
    events.mode(run.mode, "done" if run.error is None else "failed")


def _run_rounds(topo: Topology, options: BenchOptions, events: BenchEvents, report: BenchReport, client: BenchClient) -> None:
    """Every mode's deployment up at once, then `rounds` passes over the rates, each pass running every
    mode in turn (the order rotating by one per round) on prompts of its own. Modes measured minutes
    apart instead of a whole mode's run apart: drift of the machine hits them alike. A mode that
    fails is stopped at once (it would otherwise share the cores with the modes still measured)."""
    topos = {mode: mode_topology(topo, options, mode) for mode in options.modes}
    running: list[ModeRun] = []  # started and not yet stopped
    failures: list[str] = []
    samples: dict[tuple[str, float], list[RequestSamples]] = {}

    def stop(runs: list[ModeRun]) -> None:
        with _no_interrupts():  # every deployment up must come down, even on a second Ctrl-C
            for run in runs:
                running.remove(run)
                try:
                    _tear_down(topos[run.mode], options, events, run)
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
                    deployed.append(_deploy(topos[mode], options, events, run, stack, doctor=True))
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
                            point, path = _measure(d, options, events, client, rate_index, round_index)
                            got = parse_request_samples(path.read_text(), str(path))
                        except KvpushError as exc:
                            failed(d.run, str(exc))
                            continue
                        d.run.round_points.append(point)
                        samples.setdefault((d.run.mode, rate), []).append(got)
    finally:
        stop(list(running))
        for run in report.runs:
            for rate in options.rates:
                points = [p for p in run.round_points if p.rate == rate]
                if points:
                    run.points.append(pool_points(points, samples[(run.mode, rate)]))
    if failures:
        raise KvpushError("; ".join(failures))


def client_cores(topo: Topology) -> str | None:
    """The load generator runs beside the router when the router is on this machine and pinned:
    on a small host it then never takes compute from a prefill instance, in any mode."""
    return topo.router.cpu_cores if topo.hosts[topo.router.host].is_local else None


def run_bench(topo: Topology, options: BenchOptions, events: BenchEvents = BenchEvents()) -> BenchReport:
    options.validate()
    client_api_key(topo)  # an unset router key is bad input before any deployment starts, not a failure per mode
    options.out_dir.mkdir(parents=True, exist_ok=True)
    report = BenchReport(options, configuration(topo, options))
    client = BenchClient(options.out_dir / "logs" / "client.log", cpu_cores=client_cores(topo))
    try:
        client.start()  # vLLM's import overlaps the first deployment's start
        if options.rounds > 1:
            _run_rounds(topo, options, events, report, client)
        else:
            hosts_checked = False
            for mode in options.modes:
                mode_topo = mode_topology(topo, options, mode)
                run = ModeRun(mode, topology_hash(mode_topo))
                report.runs.append(run)
                try:
                    _run_mode(mode_topo, options, events, run, client, doctor=not hosts_checked)
                except KvpushError as exc:
                    run.error = str(exc)
                    events.mode_failed(mode, run.error)
                finally:
                    hosts_checked = hosts_checked or run.up_s is not None  # `up` returned: doctor passed
                    _tear_down(mode_topo, options, events, run)
    except KeyboardInterrupt:
        report.interrupted = True
    finally:
        client.close()
        report.finished_at = time.time()
        write_outputs(report)
    return report


def write_outputs(report: BenchReport) -> None:
    out = report.options.out_dir
    if hasattr(os, "getloadavg"):
        report.configuration.setdefault("machine", {})["load_average_at_end"] = list(os.getloadavg())
    model = report.configuration.get("model", {})
    subtitle = (f"{model.get('served_name')}, {report.options.input_len} in / {report.options.output_len} out tokens, "
                f"{report.options.num_prompts} prompts per rate")
    if any(r.points for r in report.runs):
        try:
            report.files += [str(p) for p in write_plots(report.runs, out, subtitle)]
        except ImportError:  # the JSON and tables still carry every figure
            report.configuration["plots"] = "not drawn: matplotlib is not installed (pip install 'kvpush[bench]')"
    path = out / RESULT_FILE
    report.files.insert(0, str(path))
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(report.to_dict(), indent=2, default=_json_default) + "\n")
    os.replace(tmp, path)


def _json_default(value: object) -> object:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, float) and value != value:
        return None
    raise TypeError(f"cannot serialize {type(value).__name__}")
