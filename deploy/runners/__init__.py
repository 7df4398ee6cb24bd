"""Runners: how kvpush drives a host (locally or over SSH), and parallel fan-out across hosts."""
from __future__ import annotations

from kvpush.deploy.topology.host_address import HostAddress

from .base import CommandResult, HostError, HttpResponse, ProcessInfo, Runner, Started
from .fanout import FanOutError, HostResult, fan_out, values_or_raise
from .local import LocalRunner
from .options import SshOptions

__all__ = [
    "CommandResult", "FanOutError", "HostError", "HostResult", "HttpResponse", "LocalRunner",
    "ProcessInfo", "Runner", "SshOptions", "SshRunner", "Started", "fan_out", "runner_for",
    "values_or_raise",
]


def runner_for(name: str, host: HostAddress, options: SshOptions = SshOptions()) -> Runner:
    if host.is_local:
        return LocalRunner(name)
    from .ssh import SshRunner  # paramiko costs ~0.7 s to import: only when a host needs it

    return SshRunner(name, host, options)


def __getattr__(name: str):
    if name == "SshRunner":
        from .ssh import SshRunner

        return SshRunner
    raise AttributeError(name)
