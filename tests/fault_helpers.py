"""Helpers shared by the e2e tests that break, change or tear down a deployment of real vLLM: what
`status` sees of its processes, the faults themselves (SIGKILL of a process, SIGSTOP of an
instance's whole process tree as a hung GPU would), and whether a port is free again."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from typing import Callable, TypeVar

from kvpush.deploy.lifecycle.observe import deployment_status, require_state
from kvpush.deploy.runners import SshOptions


def status_rows(name: str) -> dict:
    """Deployment `name`'s processes as `kvpush status` sees them, by process name."""
    return {r.name: r for r in deployment_status(require_state(name), SshOptions())}


def wait_healthy(name: str, process: str, timeout_s: float) -> float:
    """Poll until `process` of deployment `name` is healthy; return when it was."""
    deadline = time.monotonic() + timeout_s
    while not (row := status_rows(name)[process]).healthy:
        assert time.monotonic() < deadline, row
        time.sleep(0.5)
    return time.monotonic()


def instance_pids(pid: int) -> list[int]:
    """The process and everything below it (vLLM's API server and its engine core)."""
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        try:
            with open(f"/proc/{p}/task/{p}/children") as f:
                todo += [int(c) for c in f.read().split()]
        except FileNotFoundError:
            pass
    return found


Checked = TypeVar("Checked")


def cli_status(name: str) -> subprocess.CompletedProcess:
    """`kvpush status -d NAME` as a user runs it: its exit code, tables and what it says."""
    return subprocess.run([sys.executable, "-m", "kvpush.cli.main", "status", "-d", name], capture_output=True, text=True,
                          timeout=60)


def kill_until_shown_dead(name: str, victim: str, pid: int, within_s: float = 15.0) -> float:
    """SIGKILL `pid`, process `victim` of deployment `name`; once `status` sees it dead (or a
    zombie), return when it was killed."""
    killed_at = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    while (row := status_rows(name)[victim]).process not in ("dead", "zombie"):
        assert time.monotonic() < killed_at + within_s, row
        time.sleep(0.2)
    return killed_at


def hang_instance(pid: int, for_s: float, check_after_s: float, check: Callable[[], Checked]) -> tuple[float, Checked]:
    """SIGSTOP the instance whose top process is `pid` with everything below it (its API server and
    engine core, as a hung GPU would), run check() `check_after_s` into the stop and SIGCONT it all
    `for_s` after the stop (also when check() fails); return when the stop hit and what check() gave."""
    target = instance_pids(pid)
    stopped_at = time.monotonic()
    for p in target:
        os.kill(p, signal.SIGSTOP)
    try:
        time.sleep(check_after_s)
        checked = check()
        time.sleep(max(0.0, for_s - (time.monotonic() - stopped_at)))
    finally:
        for p in target:
            os.kill(p, signal.SIGCONT)
    return stopped_at, checked


def port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False
