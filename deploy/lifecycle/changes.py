"""What `up` must do to turn the recorded deployment into the plan: a pure comparison."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from kvpush.deploy.plan.plan_model import HostPlan, Plan, ProcessPlan
from kvpush.deploy.runners import ProcessInfo

from .state import DeploymentState, ProcessRecord

START_TIME_TOLERANCE_S = 1.5


def launch_digest(host: HostPlan, proc: ProcessPlan) -> str:
    """The process digest plus the content of the host files its argv names (e.g. router.json)."""
    h = hashlib.sha256(proc.digest().encode())
    for f in sorted(host.files, key=lambda f: f.path):
        if f.path in proc.argv:
            h.update(f.path.encode() + b"\0" + f.content.encode())
    return h.hexdigest()[:16]


def reload_digest(host: HostPlan, proc: ProcessPlan) -> str:
    """The content of the host files the process reads again on SIGHUP; "" for one that reads none."""
    if not proc.reload_files:
        return ""
    h = hashlib.sha256()
    for f in sorted(host.files, key=lambda f: f.path):
        if f.path in proc.reload_files:
            h.update(f.path.encode() + b"\0" + f.content.encode())
    return h.hexdigest()[:16]


def is_running(record: ProcessRecord, info: ProcessInfo | None) -> bool:
    """Alive and the same process that was started (a reused PID has another start time)."""
    if info is None or info.state != "alive":
        return False
    if record.start_time is None or info.start_time is None:
        return True
    return abs(record.start_time - info.start_time) <= START_TIME_TOLERANCE_S


@dataclass
class Changes:
    keep: list[str] = field(default_factory=list)
    start: list[str] = field(default_factory=list)  # new in the plan
    restart: list[str] = field(default_factory=list)  # launch settings changed
    reload: list[str] = field(default_factory=list)  # running, unchanged, but a file it reloads changed
    revive: list[str] = field(default_factory=list)  # recorded but no longer running
    stop: list[str] = field(default_factory=list)  # recorded but gone from the plan

    @property
    def nothing_to_do(self) -> bool:
        return not (self.start or self.restart or self.revive or self.stop or self.reload)

    @property
    def to_launch(self) -> list[str]:
        return self.start + self.restart + self.revive

    def lines(self) -> list[str]:
        labels = [("start", "start (new)"), ("restart", "restart (changed)"), ("revive", "start again (not running)"),
                  ("stop", "stop (removed)"), ("reload", "reload (instance list changed)"),
                  ("keep", "keep (unchanged, running)")]
        return [f"{label}: {', '.join(getattr(self, attr))}" for attr, label in labels if getattr(self, attr)]


def diff_deployment(plan: Plan, state: DeploymentState | None, running: dict[str, bool]) -> Changes:
    changes = Changes()
    recorded = state.processes if state else {}
    for host in plan.hosts:
        for proc in host.processes:
            record = recorded.get(proc.name)
            if record is None:
                changes.start.append(proc.name)
            elif record.digest != launch_digest(host, proc) or record.host != host.name:
                changes.restart.append(proc.name)
            elif not running.get(proc.name, False):
                changes.revive.append(proc.name)
            elif record.reload_digest != reload_digest(host, proc):
                changes.reload.append(proc.name)
            else:
                changes.keep.append(proc.name)
    planned = {p.name for p in plan.processes()}
    changes.stop = [name for name in recorded if name not in planned]
    return changes
