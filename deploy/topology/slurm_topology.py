"""The topology rules of `launcher: slurm`, and binding a topology to the nodes of one allocation.

With Slurm, a host of the topology is one node of the job's allocation: `node:` names it, or,
left out, the host takes any node the allocation has (so a topology can ask for node counts).
Binding is pure: given the job and its nodes, each host gets its node and the node's address.
"""
from __future__ import annotations

import sys
from typing import Callable

from kvpush.common.errors import UsageError

from .topology_schema import SlurmSpec, Topology

SSH_ONLY_FIELDS = ("ssh_port", "user", "key")


def used_hosts(topo: Topology) -> list[str]:
    """Hosts that run something, in the topology's order: each needs a node of the allocation."""
    used = {spec.host for _, _, spec in topo.instances()} | {topo.router.host}
    return [name for name in topo.hosts if name in used]


def check_slurm_fields(topo: Topology, fail: Callable[[tuple, str], None]) -> None:
    """Rules between the launcher and the fields that only one launcher reads."""
    if topo.launcher != "slurm":
        if topo.slurm is not None:
            fail(("slurm",), "applies to launcher: slurm only; add 'launcher: slurm' or remove the slurm: section")
        for name, host in topo.hosts.items():
            if host.node is not None:
                fail(("hosts", name, "node"), "names a Slurm node, which needs launcher: slurm; add it or remove node")
        return
    if topo.slurm is None:
        topo.slurm = SlurmSpec()
    nodes: dict[str, str] = {}
    for name, host in topo.hosts.items():
        for field in SSH_ONLY_FIELDS:
            if getattr(host, field) is not None:
                fail(
                    ("hosts", name, field),
                    "is an SSH setting; with launcher: slurm kvpush reaches nodes through srun, remove it",
                )
        if host.python is None and host.venv is None:
            # Slurm nodes share the submit host's filesystem as a rule: run what kvpush runs with.
            host.python = sys.executable
        if host.node is not None:
            if host.node in nodes:
                fail(
                    ("hosts", name, "node"),
                    f"node '{host.node}' is also host '{nodes[host.node]}'; give each host its own node",
                )
            nodes[host.node] = name


def node_count(topo: Topology) -> int:
    return len(used_hosts(topo))


def bind_allocation(topo: Topology, job_id: str, nodes: list[str], addresses: dict[str, str]) -> Topology:
    """A copy of the topology whose hosts are nodes of job `job_id` (nodes in nodelist order).

    Named nodes must be in the allocation; the other hosts take the remaining nodes in order. A
    host's address becomes its node's NodeAddr unless the topology gave one of its own.
    """
    bound = topo.model_copy(deep=True)
    assert bound.slurm is not None
    bound.slurm.job_id = job_id
    names = used_hosts(bound)
    named = {bound.hosts[h].node for h in names if bound.hosts[h].node}
    shown = ",".join(nodes) or "no nodes"
    for h in names:
        node = bound.hosts[h].node
        if node and node not in nodes:
            raise UsageError(f"hosts.{h}.node: node '{node}' is not in Slurm job {job_id}'s allocation ({shown}); "
                             "name one of those nodes or leave node out")
    free = [n for n in nodes if n not in named]
    unnamed = [h for h in names if not bound.hosts[h].node]
    if len(unnamed) > len(free):
        raise UsageError(
            f"hosts: {len(names)} hosts need a node each, but Slurm job {job_id} has {len(nodes)} ({shown}); "
            "allocate more nodes or put more processes on one host"
        )
    for h, node in zip(unnamed, free):
        bound.hosts[h].node = node
    for h in names:
        host = bound.hosts[h]
        node = host.node
        assert node is not None, f"hosts.{h} was given no node"  # named, or given a free one above
        if host.address in (h, node):  # not an address the user chose: the one Slurm knows
            host.address = addresses.get(node, node)
    return bound
