"""A chaos deployment's life: made from its shape (tests/chaos_topologies.py), brought up by `up`,
and taken down by `down`, after which nothing of it may be left (no process, no port held)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from chaos_topologies import chaos_topology
from e2e_instances import KV_CACHE_GIB
from fault_helpers import port_free
from kvpush.deploy.lifecycle.lifecycle import LifecycleOptions, down, up
from kvpush.deploy.plan.plan import build_plan
from kvpush.deploy.plan.plan_model import Plan
from kvpush.deploy.topology.topology import Topology, parse_topology
from lifecycle_helpers import kill_leftovers, processes_under

# provision off: the instances run this checkout's venv; doctor's gate on, as a user's `up` runs it
OPTIONS = LifecycleOptions(provision=False, ready_timeout_s=600, stop_timeout_s=15)


@dataclass(frozen=True)
class ChaosDeployment:
    shape: str
    topology_text: str
    topo: Topology
    plan: Plan
    workdir: Path

    @property
    def name(self) -> str:
        return self.topo.name

    def log_paths(self) -> dict[str, Path]:
        return {p.name: Path(p.log_path) for p in self.plan.processes()}


def make_deployment(shape: str, model: Path, workdir: Path, port_base: int) -> ChaosDeployment:
    text = chaos_topology(shape, f"chaos-{shape}", str(model), str(workdir), port_base, KV_CACHE_GIB)
    topo = parse_topology(text)
    return ChaosDeployment(shape, text, topo, build_plan(topo), workdir)


def bring_up(deployment: ChaosDeployment) -> float:
    """`up`; its seconds."""
    return up(deployment.topo, OPTIONS).total_s


def take_down(deployment: ChaosDeployment) -> list[str]:
    """`down`, then what is wrong: processes left (killed), ports still held."""
    ports = [p for proc in deployment.plan.processes() for p in [proc.http_port, *proc.side_channel_ports]]
    stopped = down(deployment.name, OPTIONS)
    left = processes_under(str(deployment.workdir))
    kill_leftovers(str(deployment.workdir))
    problems = [] if stopped.complete else [f"`down` incomplete: {stopped}"]
    problems += [f"left running: {' '.join(p.info['cmdline'][:3])}" for p in left]
    problems += [f"port {p} still held" for p in ports if not port_free(p)]
    return problems
