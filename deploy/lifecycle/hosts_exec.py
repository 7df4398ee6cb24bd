"""`kvpush exec HOST|PROCESS -- CMD`: which host a name means, and the shell text that runs CMD there.

A host runs CMD in its workdir; a process's name means its host, its working directory and the
variables its plan gives it (not the secrets of its env file), plus KVPUSH_PROCESS. The command
goes through the runner the deployment's other commands use: SSH, this machine, or a job step
in the deployment's Slurm allocation.
"""
from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from typing import BinaryIO

from kvpush.common.errors import UsageError

from ..plan.plan_model import Plan
from ..runners import SshOptions
from ..runners.base import shell_word
from .hosts import runner_for_record
from .state import DeploymentState, HostRecord


@dataclass(frozen=True)
class ExecTarget:
    host: str
    record: HostRecord
    cwd: str
    env: dict[str, str] = field(default_factory=dict)
    process: str | None = None


def exec_target(name: str, deployment: str, state: DeploymentState | None, plan: Plan | None) -> ExecTarget:
    """The host or process `name` of the deployment: the recorded hosts where it runs (a Slurm
    host's allocation is known only there), else the plan's."""
    hosts = (
        dict(state.hosts)
        if state is not None
        else {h.name: HostRecord.from_plan(h) for h in plan.hosts}
        if plan
        else {}
    )
    if name in hosts:
        return ExecTarget(name, hosts[name], hosts[name].workdir)
    planned = {p.name: p for p in plan.processes()} if plan is not None else {}
    recorded = state.processes if state is not None else {}
    if name in planned and planned[name].host in hosts:
        process = planned[name]
        return ExecTarget(process.host, hosts[process.host], process.cwd, {**process.env, "KVPUSH_PROCESS": name}, name)
    if name in recorded and recorded[name].host in hosts:
        host = recorded[name].host
        return ExecTarget(host, hosts[host], hosts[host].workdir, {"KVPUSH_PROCESS": name}, name)
    choices = sorted(hosts) + sorted(set(planned) | set(recorded))
    raise UsageError(f"'{name}' is neither a host nor a process of deployment {deployment}; "
                     f"choose one of {', '.join(choices) or 'none (nothing planned or recorded)'}")


def exec_command(target: ExecTarget, command: list[str]) -> str:
    """Shell text for the host: into the working directory where it exists, the variables, then
    CMD. One word is a shell command line (`"ls | wc -l"`, as `ssh HOST 'ls | wc -l'`); several
    are argv, each word passed as it is."""
    if not command:
        raise UsageError("exec: no command given; put it after `--`, e.g. kvpush exec HOST -- uptime")
    text = command[0] if len(command) == 1 else shlex.join(command)
    cwd = shell_word(target.cwd)
    exports = "".join(f"export {k}={shell_word(v)}; " for k, v in sorted(target.env.items()))
    return f"if [ -d {cwd} ]; then cd {cwd}; fi; {exports}{text}"


def run_on(target: ExecTarget, command: list[str], options: SshOptions, stdout: BinaryIO, stderr: BinaryIO) -> int:
    """Run CMD on the target's host, streaming its output; its exit status."""
    runner = runner_for_record(target.host, target.record, options)
    try:
        runner.connect()
        return runner.stream(exec_command(target, command), stdout, stderr)
    finally:
        runner.close()
