"""`kvpush tunnel`: the router (and its /metrics) on a port of this machine, through SSH to its host.

For a router its clients cannot reach: bound to its host's loopback, or behind a bastion. The
forward goes to the address the router's own host reaches it at (the plan's `router_url`), over the
same SSH connection kvpush's other commands use (ProxyJump, ProxyCommand and all).
"""
from __future__ import annotations

import socket
from dataclasses import dataclass

from kvpush.common.errors import KvpushError

from ..plan.plan_model import Plan
from ..runners import Runner, SshOptions
from ..runners.http import split_url
from ..runners.ssh_tunnel import LOOPBACK, LocalForward
from .hosts import runner_for_record
from .state import DeploymentState, HostRecord

CHANNEL_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class RouterEndpoint:
    host: str
    record: HostRecord
    address: str  # as the router's host reaches the router
    port: int

    @property
    def url(self) -> str:
        return f"http://{self.address}:{self.port}"


def router_endpoint(deployment: str, state: DeploymentState | None, plan: Plan | None) -> RouterEndpoint:
    """Where the router runs: as recorded by `up`, else as planned."""
    if state is not None:
        routers = [p for p in state.processes.values() if p.role == "router"]
        if routers and routers[0].host in state.hosts:
            host, port, _ = split_url(routers[0].base_url)
            return RouterEndpoint(routers[0].host, state.hosts[routers[0].host], host, port)
    if plan is not None:
        router = next(p for p in plan.processes() if p.role == "router")
        host, port, _ = split_url(plan.router_url)
        return RouterEndpoint(router.host, HostRecord.from_plan(plan.host(router.host)), host, port)
    raise KvpushError(f"deployment {deployment}: no router recorded or planned; give its topology with --file")


def free_local_port(preferred: int) -> int:
    """`preferred` where nothing on this machine's loopback holds it, else 0 (any free port)."""
    with socket.socket() as probe:
        try:
            probe.bind((LOOPBACK, preferred))
            return preferred
        except OSError:
            return 0


def open_tunnel(endpoint: RouterEndpoint, options: SshOptions, local_port: int | None) -> tuple[LocalForward, Runner]:
    """A listening forward to the router through its host's SSH connection (connected first, so a
    host that cannot be reached fails here, not at the first request). The caller closes both."""
    from ..runners.ssh import SshRunner

    runner = runner_for_record(endpoint.host, endpoint.record, options)
    if not isinstance(runner, SshRunner):
        runner.close()
        raise KvpushError(f"host {endpoint.host} is not reached over SSH (it is this machine or a Slurm node); "
                          f"the router needs no tunnel: use {endpoint.url}")
    try:
        runner.connect()
        forward = LocalForward(lambda _peer: runner.channel_to(endpoint.address, endpoint.port, CHANNEL_TIMEOUT_S),
                               free_local_port(endpoint.port) if local_port is None else local_port)
    except BaseException:
        runner.close()
        raise
    return forward, runner
