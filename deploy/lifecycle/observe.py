"""`status` and `logs`: observe a recorded deployment through its hosts, changing nothing."""
from __future__ import annotations

import shlex
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

from kvpush.common.errors import KvpushError, UsageError
from kvpush.common.vllm_metrics import vllm_load
from kvpush.deploy.runners import Runner, SshOptions, fan_out

from .hosts import connected
from .process_view import view_processes
from .secrets import AccessKeys
from .slurm_allocation import ended_message
from .state import DeploymentState, ProcessRecord, load_state
from .supervise import SupervisorStatus

HEALTH_BOUND_S = 2.0  # a /health that has not answered by then is reported as not answering


@dataclass
class ProcessStatus:
    name: str
    role: str
    host: str
    pid: int  # the process itself (under its supervisor), as `ps` shows it
    process: str  # running | hung | restarting | dead | zombie | unreachable
    health: str  # ok | HTTP <code> | no answer | -
    running: int | None  # requests the engine runs now, and holds waiting (vLLM's gauges)
    waiting: int | None
    kv_usage: float | None
    uptime_s: float | None
    restarts: int  # by `up` and by its supervisor together
    error: str | None = None  # what is wrong, in one sentence
    supervisor_pid: int | None = None
    last_exit: str | None = None  # how it last ended ("killed by SIGKILL"), where its supervisor saw it
    leftovers: list[dict] = field(default_factory=list)  # {pid, command, ports} still alive of a dead process

    @property
    def healthy(self) -> bool:
        return self.process == "running" and self.health == "ok"

    def to_dict(self) -> dict:
        return {**asdict(self), "healthy": self.healthy}


def require_state(deployment: str) -> DeploymentState:
    state = load_state(deployment)
    if state is None or not state.processes:
        raise KvpushError(f"deployment {deployment} is not running (no state recorded); start it with `kvpush up`")
    return state


def _host_status(runner: Runner, records: list[ProcessRecord], keys: AccessKeys) -> list[ProcessStatus]:
    views = view_processes(runner, records)
    now = time.time()
    rows = []
    for r in records:
        view = views[r.name]
        sup = view.supervisor
        alive = view.state in ("running", "hung")
        started = sup.child_started_at if sup is not None and sup.child_started_at else r.start_time
        row = ProcessStatus(r.name, r.role, r.host, view.main_pid, view.state, "-", None, None, None,
                            (now - started) if alive and started else None, r.restarts + view.supervisor_restarts,
                            view.why(), supervisor_pid=r.pid if r.status_path else None,
                            last_exit=sup.last_exit if sup is not None else None,
                            leftovers=[asdict(x) for x in view.leftovers])
        if alive:
            try:
                headers = keys.headers(r.role)
                code = runner.http("GET", r.health_url, timeout=HEALTH_BOUND_S, headers=headers).status
                row.health = "ok" if code == 200 else f"HTTP {code}"
                if r.role != "router" and code == 200:
                    metrics_url = r.base_url + "/metrics"
                    load = vllm_load(runner.http("GET", metrics_url, timeout=HEALTH_BOUND_S, headers=headers).text())
                    row.running, row.waiting = (None if n is None else round(n) for n in (load.running, load.waiting))
                    row.kv_usage = load.kv_usage
            except OSError as exc:
                row.health = "no answer"
                row.error = row.error or _not_answering(sup, r, exc, now)
        rows.append(row)
    return rows


def _not_answering(sup: SupervisorStatus | None, record: ProcessRecord, exc: OSError, now: float) -> str:
    what = (f"/health did not answer within {HEALTH_BOUND_S:g} s ({record.health_url})" if isinstance(exc, TimeoutError)
            else f"/health: {exc}")
    if sup is not None and sup.restarts and sup.last_exit and sup.child_started_at:
        # Restarted by its supervisor and still loading, most likely: say so first.
        return (f"ended ({sup.last_exit}); its supervisor started it again {now - sup.child_started_at:.0f} s ago "
                f"(restart {sup.restarts}); {what}")
    return what


def deployment_status(state: DeploymentState, ssh: SshOptions, keys: AccessKeys = AccessKeys()) -> list[ProcessStatus]:
    ended = ended_message(state)
    if ended is not None:
        raise KvpushError(ended)
    by_host: dict[str, list[ProcessRecord]] = {}
    for r in state.processes.values():
        by_host.setdefault(r.host, []).append(r)
    rows: list[ProcessStatus] = []
    with connected({h: state.hosts[h] for h in by_host}, ssh) as (runners, unreachable):
        results = fan_out(list(runners), lambda h: _host_status(runners[h], by_host[h], keys))
        failures = dict(unreachable)
        failures.update({h: r.failure for h, r in results.items() if not r.ok})
        for result in results.values():
            if result.ok:
                rows += result.ok_value
    for host, error in failures.items():
        rows += [
            ProcessStatus(r.name, r.role, host, r.pid, "unreachable", "-", None, None, None, None, r.restarts, error)
            for r in by_host[host]
        ]
    order = {n: i for i, n in enumerate(state.processes)}
    return sorted(rows, key=lambda row: order[row.name])


def select_processes(state: DeploymentState, selector: str | None) -> list[ProcessRecord]:
    records = list(state.processes.values())
    if selector is None:
        return records
    chosen = [r for r in records if selector in (r.name, r.role)]
    if not chosen:
        names = ", ".join(sorted({r.name for r in records} | {r.role for r in records}))
        raise UsageError(
            f"no process or role named '{selector}' in deployment {state.deployment}; choose one of {names}"
        )
    return chosen


def stream_logs(state: DeploymentState, selector: str | None, lines: int, follow: bool, ssh: SshOptions,
                emit: Callable[[str, str], None], stop: threading.Event | None = None) -> None:
    """emit(process_name, line) for the last `lines` lines of each chosen log, then new lines if follow."""
    records = select_processes(state, selector)
    stop = stop or threading.Event()
    with connected({r.host: state.hosts[r.host] for r in records}, ssh) as (runners, unreachable):
        for error in unreachable.values():
            emit("kvpush", f"cannot read logs on {error}")
        reachable = [r for r in records if r.host in runners]
        if not follow:
            results = fan_out(reachable, lambda r: runners[r.host].tail(r.log_path, lines), name=lambda r: r.name)
            for name, result in results.items():
                for line in (result.ok_value.splitlines() if result.ok else [f"[{result.error}]"]):
                    emit(name, line)
            return
        threads = []
        for r in reachable:
            runner = runners[r.host]
            command = f"tail -n {int(lines)} -F {shlex.quote(runner.expand(r.log_path))} 2>&1"
            t = threading.Thread(
                target=runner.follow, args=(command, lambda line, n=r.name: emit(n, line), stop), daemon=True
            )
            t.start()
            threads.append(t)
        try:
            while any(t.is_alive() for t in threads) and not stop.is_set():
                time.sleep(0.2)
        finally:
            stop.set()
            for t in threads:
                t.join(2)
