"""What a host says about the processes recorded on it: up, hung, restarting or dead, and what a
dead one left behind (PIDs still alive in its process group, the ports they listen on).

`status` shows it; `up` decides from it what to start again. Reads only, changes nothing.
"""
from __future__ import annotations

import shlex
import time
from dataclasses import dataclass, field

from kvpush.deploy.runners import ProcessInfo, Runner, fan_out, values_or_raise

from .changes import is_running
from .state import DeploymentState, ProcessRecord
from .supervise import SupervisorStatus

# Supervisor states in which the process counts as up: `up` leaves it alone.
SUPERVISOR_UP_STATES = ("running", "restarting")


@dataclass(frozen=True)
class Leftover:
    pid: int
    command: str | None
    ports: list[int] = field(default_factory=list)

    def describe(self) -> str:
        held = (
            f" holding port{'s' if len(self.ports) > 1 else ''} {', '.join(map(str, self.ports))}" if self.ports else ""
        )
        return f"pid {self.pid} ({self.command or '?'}){held}"


@dataclass
class ProcessView:
    record: ProcessRecord
    leader: ProcessInfo  # its supervisor; the process itself for a record started without one
    supervisor: SupervisorStatus | None
    members: list[ProcessInfo]  # live (not zombie) processes in its process group now
    leftovers: list[Leftover] = field(default_factory=list)  # filled for a process that is not up

    @property
    def leader_running(self) -> bool:
        return is_running(self.record, self.leader)

    @property
    def stopped_members(self) -> list[ProcessInfo]:
        return [m for m in self.members if m.stopped]

    @property
    def state(self) -> str:
        """running | hung | restarting | dead | zombie."""
        if not self.leader_running:
            return "zombie" if self.leader.state == "zombie" else "dead"
        sup = self.supervisor
        if sup is not None and sup.state not in SUPERVISOR_UP_STATES:
            return "dead"  # its command ended; the supervisor is cleaning up or about to exit
        if sup is not None and sup.state == "restarting":
            return "restarting"
        return "hung" if self.stopped_members else "running"

    @property
    def up(self) -> bool:
        """Counts as running for `up`: alive (even hung), or being restarted by its supervisor."""
        return self.state in ("running", "hung", "restarting")

    @property
    def main_pid(self) -> int:
        """The supervised command's PID (what users see in `ps`; the last one if it ended), else the leader's."""
        if self.supervisor is not None and self.supervisor.child_pid:
            return self.supervisor.child_pid
        return self.record.pid

    @property
    def supervisor_restarts(self) -> int:
        return self.supervisor.restarts if self.supervisor is not None else 0

    def why(self) -> str | None:
        """What is wrong with it, in one sentence (status prints it after the name); None when up and running."""
        sup, state = self.supervisor, self.state
        if state == "running":
            return None
        if state == "hung":
            stopped = ", ".join(f"pid {m.pid} ({m.command or '?'})" for m in self.stopped_members)
            return (f"hung: {stopped} stopped (SIGSTOP or a debugger), it answers nothing until it gets SIGCONT "
                    f"(kill -CONT {self.stopped_members[0].pid})")
        if state == "restarting":
            assert sup is not None, "only a supervisor says its process is restarting"
            return f"ended ({sup.last_exit}); its supervisor is starting it again (restart {sup.restarts})"
        if sup is not None and sup.last_exit is not None:
            when = f" at {time.strftime('%H:%M:%S', time.localtime(sup.last_exit_at))}" if sup.last_exit_at else ""
            died = f"died{when} (pid {sup.child_pid}: {sup.last_exit})"
        else:
            died = f"died (pid {self.record.pid} is {'a zombie' if state == 'zombie' else 'gone'})"
        if self.leftovers:
            left = "; ".join(x.describe() for x in self.leftovers)
            if self.leader_running and sup is not None:  # cleaning-up or stopping: it is on it
                return f"{died}; its supervisor is stopping what it left behind: {left}"
            return f"{died}; left behind: {left}; `kvpush up` stops them and starts it again"
        gave_up = f"; its supervisor gave up after {sup.restarts} restart(s)" if sup and sup.state == "gave-up" else ""
        cleaned = f"; its supervisor stopped {', '.join(sup.cleaned_up)}" if sup and sup.cleaned_up else ""
        return f"{died}{gave_up}{cleaned}; nothing of it is left; `kvpush up` starts it again"


def read_supervisor_statuses(runner: Runner, paths: list[str]) -> dict[str, SupervisorStatus]:
    """Each status file that exists and parses, by path as given: one command for all of them."""
    if not paths:
        return {}
    script = "; ".join(
        f"echo '@@ {i}'; cat {shlex.quote(runner.expand(p))} 2>/dev/null; echo" for i, p in enumerate(paths)
    )
    text = runner.run(script + "; true", timeout=30).check("reading supervisor status files").stdout
    found: dict[str, SupervisorStatus] = {}
    for chunk in text.split("@@ ")[1:]:
        index, _, body = chunk.partition("\n")
        status = SupervisorStatus.from_json(body.strip()) if body.strip() else None
        if status is not None:
            found[paths[int(index)]] = status
    return found


def view_processes(runner: Runner, records: list[ProcessRecord]) -> dict[str, ProcessView]:
    """Every record's view on this host (four commands at most, whatever the number of processes)."""
    if not records:
        return {}
    leaders = runner.inspect([r.pid for r in records])
    groups = runner.group_members([r.pgid for r in records])
    statuses = read_supervisor_statuses(runner, [r.status_path for r in records if r.status_path])
    views: dict[str, ProcessView] = {}
    for r in records:
        leader = leaders.get(r.pid) or ProcessInfo(r.pid, "dead")
        status = statuses.get(r.status_path)
        if status is not None and status.supervisor_pid != r.pid:
            status = None  # a file left by an earlier start of this process
        members = [m for m in groups.get(r.pgid, []) if m.state == "alive"]
        if leader.state == "alive" and r.pid == r.pgid and not is_running(r, leader):
            members = []  # the PID (and so the group id) now belongs to an unrelated process
        views[r.name] = ProcessView(r, leader, status, members)
    left_behind = {
        v.record.name: [m for m in v.members if not _is_supervisor_part(m, v)] for v in views.values() if not v.up
    }
    pids = [m.pid for members in left_behind.values() for m in members]
    ports = runner.listening_ports(pids) if pids else {}
    for name, members in left_behind.items():
        views[name].leftovers = [Leftover(m.pid, m.command, ports.get(m.pid, [])) for m in members]
    return views


def view_deployment(runners: dict[str, Runner], state: DeploymentState) -> dict[str, ProcessView]:
    """view_processes on every host of the state at once; a host that fails raises (FanOutError)."""
    grouped: dict[str, list[ProcessRecord]] = {}
    for r in state.processes.values():
        grouped.setdefault(r.host, []).append(r)
    views: dict[str, ProcessView] = {}
    for host_views in values_or_raise(
        fan_out(list(grouped), lambda h: view_processes(runners[h], grouped[h]))
    ).values():
        views.update(host_views)
    return views


def _is_supervisor_part(member: ProcessInfo, view: ProcessView) -> bool:
    """The supervisor and its watcher, while they finish cleaning up, are not leftovers."""
    sup = view.supervisor
    return view.leader_running and sup is not None and member.pid in (sup.supervisor_pid, sup.watcher_pid)


def deployment_pids(runners: dict[str, Runner], state: DeploymentState) -> dict[str, dict[int, str]]:
    """Per host: every live PID in the process groups of the deployment's recorded processes (a
    running one's tree, or what a dead one left behind) -> that process's name. Records on hosts
    without a runner are left out; a host that fails raises (FanOutError)."""
    reachable = DeploymentState(
        state.deployment, processes={n: r for n, r in state.processes.items() if r.host in runners}
    )
    owned: dict[str, dict[int, str]] = {}
    for view in view_deployment(runners, reachable).values():
        for member in view.members:
            owned.setdefault(view.record.host, {})[member.pid] = view.record.name
    return owned
