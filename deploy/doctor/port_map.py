"""Which ports each host must have free, and which ports each host must reach: pure, from the topology."""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from kvpush.deploy.topology.placement import bind_address
from kvpush.deploy.topology.topology import Topology, listening_side_channel_ports


@dataclass(frozen=True)
class PortClaim:
    host: str
    addr: str
    port: int
    label: str  # e.g. "prefill-0 side channel", "router HTTP"
    process: str


@dataclass(frozen=True)
class ReachTarget:
    source: str  # host that connects
    target: str  # host that listens
    addr: str
    port: int
    label: str
    why: str  # "decode -> prefill side channel", "router -> instance HTTP"


def port_claims(topo: Topology, running: frozenset[str] = frozenset()) -> list[PortClaim]:
    """Every port a process binds, except those of processes already running (they hold them)."""
    claims: list[PortClaim] = []
    for role, _, spec in topo.instances():
        name, host = spec.resolved_name, spec.resolved_host
        if name in running:
            continue
        addr = bind_address(topo.hosts[host])
        claims.append(PortClaim(host, addr, spec.resolved_http_port, f"{name} HTTP", name))
        for rank, port in enumerate(listening_side_channel_ports(role, spec, topo.connector.type)):
            suffix = f" rank {rank}" if rank else ""
            claims.append(PortClaim(host, addr, port, f"{name} side channel{suffix}", name))
    if "router" not in running:
        claims.append(PortClaim(topo.router.resolved_host, topo.router.bind, topo.router.port, "router HTTP", "router"))
    return claims


def reach_targets(topo: Topology) -> list[ReachTarget]:
    """Decode hosts reach prefill side channels (and prefill hosts decode's, where decode listens);
    the router host reaches every instance."""
    seen: set[tuple[str, str, int]] = set()
    targets: list[ReachTarget] = []

    def add(source: str, target_host: str, port: int, label: str, why: str) -> None:
        addr = bind_address(topo.hosts[target_host])
        if (source, addr, port) not in seen:
            seen.add((source, addr, port))
            targets.append(ReachTarget(source, target_host, addr, port, label, why))

    kind = topo.connector.type
    for p in topo.prefill:
        for d in topo.decode:
            for rank, port in enumerate(listening_side_channel_ports("prefill", p, kind)):
                add(
                    d.resolved_host,
                    p.resolved_host,
                    port,
                    f"{p.name} side channel" + (f" rank {rank}" if rank else ""),
                    "decode -> prefill side channel",
                )
            for rank, port in enumerate(listening_side_channel_ports("decode", d, kind)):
                add(
                    p.resolved_host,
                    d.resolved_host,
                    port,
                    f"{d.name} side channel" + (f" rank {rank}" if rank else ""),
                    "prefill -> decode side channel",
                )
    for _, _, spec in topo.instances():
        add(topo.router.resolved_host, spec.resolved_host, spec.resolved_http_port, f"{spec.name} HTTP",
            "router -> instance HTTP")
    return targets


def expected_incoming(targets: list[ReachTarget], listening: set[tuple[str, int]]) -> dict[str, int]:
    """Connections each host's temporary listener should see (only to ports it listens on)."""
    counts: dict[str, int] = defaultdict(int)
    for t in targets:
        if (t.target, t.port) in listening:
            counts[t.target] += 1
    return dict(counts)
