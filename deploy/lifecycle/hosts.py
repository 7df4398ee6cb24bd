"""Open one runner per host for a command, in parallel, and close them all at the end."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from kvpush.deploy.runners import HostResult, Runner, SshOptions, fan_out, runner_for

from .state import HostRecord


def _connect(runner: Runner) -> Runner:
    runner.connect()
    return runner


def runner_for_record(name: str, h: HostRecord, options: SshOptions) -> Runner:
    """The runner a recorded (or planned) host is driven through: SSH/local, or a Slurm node."""
    if h.slurm is not None:
        from kvpush.deploy.runners.slurm import SlurmRunner

        return SlurmRunner(name, h.address, h.slurm.get("job_id"), h.slurm.get("node"), h.slurm.get("srun_options"))
    return runner_for(name, h, options)


@contextmanager
def connected(hosts: dict[str, HostRecord], options: SshOptions) -> Iterator[tuple[dict[str, Runner], dict[str, str]]]:
    """(runners for reachable hosts, one-line error per unreachable host); closed on exit."""
    runners = {name: runner_for_record(name, h, options) for name, h in hosts.items()}
    results: dict[str, HostResult[Runner]] = fan_out(list(runners), lambda name: _connect(runners[name]))
    try:
        yield ({n: r.ok_value for n, r in results.items() if r.ok},
               {n: r.failure for n, r in results.items() if not r.ok})
    finally:
        for runner in runners.values():
            runner.close()
