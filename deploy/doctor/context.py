"""What every check reads: the topology, its plan, and the facts the probes gathered."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable

from kvpush.deploy.plan.plan_model import Plan, ProcessPlan
from kvpush.deploy.runners.base import ProcessInfo
from kvpush.deploy.topology.topology import Topology

from .facts import HostFacts
from .port_map import PortClaim, ReachTarget
from .probes import ProbeFailure
from .result import CheckResult, Scope, fail, skip

NO_FACTS = "no facts from this host (see the probe row)"


@dataclass(frozen=True)
class TransferOutcome:
    source: str
    target: str
    ok: bool
    byte_exact: bool | None
    nbytes: int
    seconds: float | None
    gbps: float | None
    error: str | None
    evidence: tuple[str, ...] = ()
    command: str = ""


@dataclass
class DoctorContext:
    topo: Topology
    plan: Plan
    facts: dict[str, HostFacts]
    probe_failures: dict[str, ProbeFailure]
    claims: list[PortClaim] = field(default_factory=list)
    targets: list[ReachTarget] = field(default_factory=list)
    transfers: dict[tuple[str, str], TransferOutcome] | None = None  # None: --transfer not given
    port_holders: dict[str, dict[int, list[ProcessInfo]]] = field(
        default_factory=dict
    )  # host -> port in use -> listeners
    own_pids: dict[str, dict[int, str]] = field(default_factory=dict)  # host -> the deployment's PID -> its process
    running: frozenset[str] = frozenset()  # processes already up: their ports and memory are already taken

    @property
    def disaggregated(self) -> bool:
        return self.topo.connector.type != "colocated"

    @property
    def rdma(self) -> bool:
        """Whether transfers need registered memory for an RDMA NIC (memlock, GPUDirect)."""
        return self.topo.connector.backend == "LIBFABRIC" or self.topo.platform == "cuda"

    def probed_hosts(self) -> list[str]:
        return [h.name for h in self.plan.hosts]

    def vllm_hosts(self) -> list[str]:
        return [h.name for h in self.plan.hosts if any(p.role != "router" for p in h.processes)]

    def vllm_processes(self, host: str) -> list[ProcessPlan]:
        return [p for p in self.plan.host(host).processes if p.role != "router"]

    def role_hosts(self, role: str) -> list[str]:
        return sorted({s.host for s in getattr(self.topo, role)})

    def each_host(
        self, check: str, hosts: Iterable[str], decide: Callable[[HostFacts], CheckResult]
    ) -> list[CheckResult]:
        """decide() for every host with facts; a skip naming the probe for the others."""
        out = []
        for host in hosts:
            facts = self.facts.get(host)
            out.append(decide(facts) if facts is not None else skip(check, host, NO_FACTS))
        return out


def hung(check: str, facts: HostFacts, *sections: str) -> CheckResult | None:
    """A fail naming the tool when one of these sections ran past its timeout and was killed."""
    for name in sections:
        section = facts.section(name)
        if section is not None and section.timed_out:
            return fail(check, facts.host, f"`{section.command}` did not finish within its timeout and was killed",
                        f"run `{section.command}` on {facts.host} by hand: it hangs (GPU driver, NFS mount, ...)",
                        section.evidence())
    return None


def agreement(value_by_host: dict[str, str]) -> tuple[str, bool]:
    """How the hosts' values of one thing group, as evidence ("v1 on a, b; v2 on c"), and whether
    they all agree."""
    groups: dict[str, list[str]] = {}
    for host, value in value_by_host.items():
        groups.setdefault(value, []).append(host)
    return "; ".join(f"{value} on {', '.join(hosts)}" for value, hosts in groups.items()), len(groups) <= 1


def tool_commands(topo: Topology, plan: Plan, host: str) -> dict[str, str]:
    """The shell commands whose output the checks parse, by section name (only those needed).
    `df` is added by the probe itself (see df_paths)."""
    host_plan = plan.host(host)
    runs_vllm = any(p.role != "router" for p in host_plan.processes)
    commands = {
        "ulimit_l": "ulimit -l",
        "ulimit_n": "ulimit -Sn",
        "ulimit_hn": "ulimit -Hn",
        "meminfo": "grep -E '^(MemTotal|MemAvailable):' /proc/meminfo",
        "date": "date +%s.%N",
    }
    if runs_vllm:
        commands["infiniband"] = "ls -1 /sys/class/infiniband"
        if topo.platform == "cuda" or topo.connector.backend == "LIBFABRIC":
            # On CPU topologies the sysfs listing is enough to spot an EFA host (ucx-on-efa).
            commands["fi_info_efa"] = "fi_info -p efa"
            commands["ibv_devices"] = "ibv_devices"
        if topo.platform == "cuda":
            commands["nvidia_gpus"] = ("nvidia-smi --query-gpu=index,uuid,name,memory.used,memory.total,pci.bus_id "
                                       "--format=csv,noheader,nounits")
            commands["nvidia_apps"] = ("nvidia-smi --query-compute-apps=gpu_uuid,pid,process_name,used_memory "
                                       "--format=csv,noheader,nounits")
            commands["nvidia_topo"] = "nvidia-smi topo -m"
            commands["kernel_modules"] = "grep -E '^(nvidia_peermem|nv_peer_mem|efa) ' /proc/modules"
    return commands


@dataclass(frozen=True)
class Check:
    name: str
    scope: Scope
    summary: str
    run: Callable[[DoctorContext], list[CheckResult]]


def df_paths(topo: Topology, plan: Plan, host: str) -> list[str]:
    host_plan = plan.host(host)
    runs_vllm = any(p.role != "router" for p in host_plan.processes)
    return [host_plan.workdir] + ([topo.model.path] if runs_vllm else [])
