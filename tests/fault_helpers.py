"""Helpers shared by the e2e tests that break, change or tear down a deployment of real vLLM: what
`status` sees of its processes, an instance's process tree (to stop all of it as a hung GPU would),
and whether a port is free again."""
from __future__ import annotations

import socket
import time

from kvpush.deploy.observe import deployment_status, require_state
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


def port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False
