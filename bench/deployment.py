"""One mode's deployment for measuring: up, ready, warm; and its logs kept after it came down.

`deploy_mode` runs `up` (whose proof waits until the router has every instance in rotation), waits
for the router to be ready (also when there was no proof), warms it up and samples idle CPU. Its
host connections stay open in the caller's ExitStack for measuring.
"""
from __future__ import annotations

import dataclasses
import signal
import threading
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from kvpush.common.errors import KvpushError, UsageError
from kvpush.deploy.lifecycle.client import COMPLETIONS_PATH, completion_body
from kvpush.deploy.lifecycle.hosts import connected
from kvpush.deploy.lifecycle.lifecycle import up
from kvpush.deploy.lifecycle.router_ready import wait_router_ready
from kvpush.deploy.lifecycle.secrets import AccessKeys, client_api_key, kept_secret
from kvpush.deploy.lifecycle.state import HostRecord, load_state
from kvpush.deploy.lifecycle.tiny_model import make_tiny_model
from kvpush.deploy.plan.plan import build_plan
from kvpush.deploy.runners import LocalRunner, Runner
from kvpush.deploy.topology.topology import Topology

from .idle_cpu import idle_cores
from .options import BenchEvents, BenchOptions
from .results import ModeRun
from .span_receiver import SpanReceiver

ROTATION_TIMEOUT_S = 30.0
WARMUP_REQUESTS = 2  # one per instance of a 1P1D / 2-server deployment, through the router


@dataclass(frozen=True)
class Endpoint:
    name: str
    role: str  # prefill | decode | router
    host: str
    metrics_url: str


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
    spans: SpanReceiver | None = None  # where its instances send their request spans, if they do


def deploy_mode(topo: Topology, options: BenchOptions, events: BenchEvents, run: ModeRun, stack: ExitStack,
                doctor: bool = True) -> Deployed:
    """`up` one mode and make it ready to measure; its host connections stay open in `stack`."""
    events.mode(run.mode, "starting the deployment")
    # Doctor's checks (~5 s) look at the hosts, which every mode shares: once per bench is enough.
    lifecycle = dataclasses.replace(options.lifecycle, doctor=options.lifecycle.doctor and doctor)
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
    plan = build_plan(topo)
    deployed = Deployed(
        topo,
        run,
        endpoints,
        router,
        plan.router_url_from_here(),
        resolve_tokenizer(topo, options.tokenizer),
        runners,
        keys,
    )
    with timed(run, "rotation"):
        wait_router_ready(runners[router.host], plan.router_url, ROTATION_TIMEOUT_S, keys,
                          instances=plan.instance_names())
    events.mode(run.mode, "warming up")
    with timed(run, "warm_up"):
        _warm_up(runners[router.host], deployed.base_url, topo.model.name, keys)
    events.mode(run.mode, "sampling idle CPU")
    with timed(run, "idle_cpu"):
        run.idle_cores = _idle_cores(runners, state)
    return deployed


def _endpoints(deployment: str) -> list[Endpoint]:
    state = load_state(deployment)
    if state is None:
        raise KvpushError(f"deployment {deployment}: no state after `up`; nothing to measure")
    return [Endpoint(r.name, r.role, r.host, r.base_url + "/metrics") for r in state.processes.values()]


def _warm_up(runner: Runner, base_url: str, model: str, keys: AccessKeys) -> None:
    for i in range(WARMUP_REQUESTS):
        body = completion_body(model, f"warm up {i} {time.time()}", max_tokens=2)
        response = runner.http("POST", base_url + COMPLETIONS_PATH, body, timeout=300, headers=keys.headers("router"))
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
def no_interrupts() -> Iterator[None]:
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


def client_cores(topo: Topology) -> str | None:
    """The load generator runs beside the router when the router is on this machine and pinned:
    on a small host it then never takes compute from a prefill instance, in any mode."""
    return topo.router.cpu_cores if topo.hosts[topo.router.resolved_host].is_local else None
