"""The per-process steps of `up` and `down`: prepare a host, start processes under their supervisor,
wait until they are ready, stop them (their whole process group)."""
from __future__ import annotations

import shlex
import time

from kvpush.common.errors import KvpushError
from kvpush.deploy.plan.plan_model import HostPlan
from kvpush.deploy.runners import Runner, fan_out, values_or_raise
from kvpush.deploy.topology.topology import Topology

from .changes import is_running, launch_digest, reload_digest
from .secrets import AccessKeys
from .state import ProcessRecord
from .tiny_model import MARKER as TINY_MODEL_MARKER

LOG_TAIL_LINES = 30


class Events:
    """What lifecycle operations tell the user; the CLI renders it. Default: silent."""

    def note(self, message: str) -> None: ...

    def process(self, name: str, status: str, done: bool = False) -> None: ...

    def log_tail(self, name: str, host: str, text: str) -> None: ...


class StartFailure(KvpushError):
    pass


def by_host(records: list[ProcessRecord]) -> dict[str, list[ProcessRecord]]:
    grouped: dict[str, list[ProcessRecord]] = {}
    for r in records:
        grouped.setdefault(r.host, []).append(r)
    return grouped


# -- stopping ----------------------------------------------------------------------------------


def _live_members(runner: Runner, records: list[ProcessRecord]) -> dict[str, list[int]]:
    """Per process: PIDs still alive (zombies are dead) in its group, if the group is still ours."""
    members = runner.group_members([r.pgid for r in records])
    leaders = runner.inspect([r.pid for r in records])
    live: dict[str, list[int]] = {}
    for r in records:
        leader = leaders.get(r.pid)
        if leader and leader.state == "alive" and r.pid == r.pgid and not is_running(r, leader):
            continue  # PID and group id were reused by an unrelated process
        pids = [m.pid for m in members.get(r.pgid, []) if m.state == "alive"]
        if pids:
            live[r.name] = pids
    return live


def stop_processes(runner: Runner, records: list[ProcessRecord], timeout_s: float) -> list[str]:
    """TERM each process group, wait, KILL what is left; returns names still alive afterwards."""
    if not records:
        return []
    by_name = {r.name: r for r in records}
    live = _live_members(runner, records)
    if live:
        runner.signal_groups([by_name[n].pgid for n in live], "TERM")
        runner.signal_groups(
            [by_name[n].pgid for n in live], "CONT"
        )  # a stopped (hung) process acts on TERM only once it runs
    for sig, wait_s in (("KILL", timeout_s), (None, 5.0)):
        end = time.monotonic() + wait_s
        while live and time.monotonic() < end:
            time.sleep(0.1)
            live = _live_members(runner, [by_name[n] for n in live])
        if live and sig:
            runner.signal_groups([by_name[n].pgid for n in live], sig)
    return sorted(live)


def stop_records(runners: dict[str, Runner], records: list[ProcessRecord], timeout_s: float) -> dict[str, list[str]]:
    """stop_processes on every host at once; per host, the names still alive (all of them where it failed)."""
    grouped = by_host(records)
    results = fan_out([h for h in grouped if h in runners], lambda h: stop_processes(runners[h], grouped[h], timeout_s))
    return {h: (r.ok_value if r.ok else [p.name for p in grouped[h]]) for h, r in results.items()}


# -- starting ----------------------------------------------------------------------------------


def prepare_host(runner: Runner, host: HostPlan, topo: Topology) -> None:
    for f in host.files:
        runner.write_file(f.path, f.content.encode())
    if topo.model.tiny is not None and any(p.role != "router" for p in host.processes):
        model = runner.expand(topo.model.path)
        py = shlex.quote(runner.expand(host.python))
        spec = shlex.quote(topo.model.tiny.model_dump_json())
        runner.run(
            f"test -f {shlex.quote(model + '/' + TINY_MODEL_MARKER)} || "
            f"{py} -m kvpush.deploy.lifecycle.tiny_model {shlex.quote(model)} --spec {spec}", timeout=600,
        ).check(f"making the tiny model at {topo.model.path}")


def start_on_host(runner: Runner, host: HostPlan, names: list[str]) -> dict[str, ProcessRecord]:
    """Start the named processes of this host, each under its supervisor (the record's PID is the supervisor's)."""
    started = {}
    for proc in host.processes:
        if proc.name in names:
            s = runner.start_detached(proc.launch_argv, proc.env, proc.cwd, proc.log_path, env_file=proc.env_file)
            started[proc.name] = ProcessRecord(
                name=proc.name, role=proc.role, host=host.name, pid=s.pid, pgid=s.pgid, start_time=s.start_time,
                http_port=proc.http_port, health_url=proc.health_url, log_path=proc.log_path,
                digest=launch_digest(host, proc), started_at=time.time(), status_path=proc.status_path,
                reload_digest=reload_digest(host, proc),
            )
    return started


def _probe_health(runner: Runner, records: list[ProcessRecord], keys: AccessKeys) -> dict[str, str]:
    """Per process: 'ready', 'dead', or a short waiting reason."""
    infos = runner.inspect([r.pid for r in records])
    out = {}
    for r in records:
        info = infos.get(r.pid)
        if not is_running(r, info):
            out[r.name] = "dead: " + _why_not_running(r, info)
            continue
        try:
            status = runner.http("GET", r.health_url, timeout=3, headers=keys.headers(r.role)).status
            out[r.name] = "ready" if status == 200 else f"health answers {status}"
        except OSError as exc:  # refused while the server is still loading; anything else is shown
            out[r.name] = "starting" if isinstance(exc, ConnectionError) else f"waiting ({exc or type(exc).__name__})"
    return out


def _why_not_running(record: ProcessRecord, info) -> str:
    if info is None or info.state == "dead":
        return f"pid {record.pid} is gone"
    if info.state != "alive":
        return f"pid {record.pid} is a {info.state}"
    return f"pid {record.pid} now belongs to a process started at {info.start_time}, not {record.start_time}"


def wait_ready(runners: dict[str, Runner], records: list[ProcessRecord], timeout_s: float, events: Events,
               since: float, keys: AccessKeys = AccessKeys()) -> dict[str, float]:
    pending = {r.name: r for r in records}
    ready: dict[str, float] = {}
    end = time.monotonic() + timeout_s
    while pending:
        grouped = by_host(list(pending.values()))
        results = values_or_raise(fan_out(list(grouped.items()), name=lambda item: item[0],
                                          fn=lambda item: _probe_health(runners[item[0]], item[1], keys)))
        for host_states in results.values():
            for name, status in host_states.items():
                record = pending[name]
                if status.startswith("dead"):
                    events.log_tail(name, record.host, runners[record.host].tail(record.log_path, LOG_TAIL_LINES))
                    raise StartFailure(f"process {name} on host {record.host} exited before it became ready "
                                       f"({status[len('dead: '):]}); its log is {record.log_path} (last lines above)")
                if status == "ready":
                    ready[name] = time.monotonic() - since
                    events.process(name, f"ready after {ready[name]:.1f} s", done=True)
                    del pending[name]
                else:
                    events.process(name, status)
        if pending and time.monotonic() > end:
            name, record = next(iter(pending.items()))
            events.log_tail(name, record.host, runners[record.host].tail(record.log_path, LOG_TAIL_LINES))
            raise StartFailure(
                f"process {name} on host {record.host} was not ready within {timeout_s:.0f} s "
                f"({record.health_url}); its log is {record.log_path} (last lines above); raise --timeout if it is "
                "just slow"
            )
        if pending:
            time.sleep(0.5)
    return ready
