"""Defaults that depend on other fields: instance names and hosts, HTTP and side-channel ports."""
from __future__ import annotations

from typing import Callable

from .process_specs import InstanceSpec
from .topology_schema import ConnectorType, Role, Topology

DEFAULT_PREFILL_HTTP_PORT = 8100
DEFAULT_DECODE_HTTP_PORT = 8200
DEFAULT_SIDE_CHANNEL_PORT = 5600

Fail = Callable[[tuple, str], None]  # (path of the field, what is wrong and the fix): raises


def side_channel_ports(spec: InstanceSpec, connector: ConnectorType = "kvpush") -> list[int]:
    """The ports an instance's side channel is numbered over (what defaults leave room for).

    kvpush's connector listens on one port per tensor-parallel rank of each data-parallel rank
    (base + dp_rank * tp + tp_rank); vLLM's NIXL connectors on one per data-parallel rank, in the
    engine process (base + dp_rank).
    """
    count = spec.data_parallel_size * (spec.tensor_parallel_size if connector == "kvpush" else 1)
    return [spec.resolved_side_channel_port + i for i in range(count)]


def listening_side_channel_ports(role: Role, spec: InstanceSpec, connector: ConnectorType) -> list[int]:
    """The side-channel ports an instance's processes bind: kvpush's decode binds none (it dials its
    prefill peers; its side_channel_port only names it in the push's parameters), and colocated
    instances have no side channel."""
    if connector == "colocated" or (connector == "kvpush" and role == "decode"):
        return []
    return side_channel_ports(spec, connector)


def apply_defaults(topo: Topology, fail: Fail) -> None:
    """Fill names, hosts and ports so the plan never has to guess."""
    host_names = list(topo.hosts)
    if not host_names:
        fail(
            ("hosts",),
            "defines no hosts; add one, e.g. 'local: {address: 127.0.0.1}', or remove hosts: to use this machine",
        )
    if topo.router.host is None:
        if len(host_names) == 1:
            topo.router.host = host_names[0]
        else:
            fail(
                ("router",),
                f"names no host and the topology has {len(host_names)}; add 'host: <one of {', '.join(host_names)}>'",
            )
    next_http = {"prefill": DEFAULT_PREFILL_HTTP_PORT, "decode": DEFAULT_DECODE_HTTP_PORT}
    next_side = DEFAULT_SIDE_CHANNEL_PORT
    for role, index, spec in topo.instances():
        if spec.name is None:
            spec.name = f"{role}-{index}"
        if spec.host is None:
            if len(host_names) == 1:
                spec.host = host_names[0]
            else:
                fail(
                    (role, index),
                    f"names no host and the topology has {len(host_names)}; add 'host: <one of "
                    f"{', '.join(host_names)}>'",
                )
        if spec.http_port is None:
            spec.http_port = next_http[role] + index
        if spec.side_channel_port is None:
            spec.side_channel_port = next_side
        next_side = max(next_side, spec.side_channel_port + len(side_channel_ports(spec, topo.connector.type)))
