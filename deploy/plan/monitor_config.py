"""A Prometheus scrape config for a deployment, from its plan: the router's /metrics and every
vLLM instance's, each with the key its /metrics needs.

Targets are the addresses a Prometheus beside kvpush reaches (the router as clients reach it).
Every target carries the labels the dashboard (dashboard.py) filters and groups by:
`deployment`, `process` (the plan's process name) and `role`. Keys are never in the config: a
target that needs one names a file holding it (`credentials_file`), which `kvpush monitor` writes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal
from urllib.parse import urlsplit

from kvpush.deploy.topology.topology import Topology

from .dashboard import DEPLOYMENT_LABEL, PROCESS_LABEL
from .plan import has_client_key
from .plan_model import Plan
from .router_address import client_router_url

METRICS_PATH = "/metrics"
SCRAPE_INTERVAL = "15s"
KeyKind = Literal["router-client", "instance"]


@dataclass(frozen=True)
class ScrapeTarget:
    process: str
    role: str
    address: str  # host:port
    key: KeyKind | None  # the key its /metrics needs, if any


def _host_port(url: str) -> str:
    return urlsplit(url).netloc


def scrape_targets(topo: Topology, plan: Plan) -> list[ScrapeTarget]:
    """The router first, then every instance, in plan order."""
    router_key: KeyKind | None = (
        "router-client" if has_client_key(topo) and METRICS_PATH not in topo.router.public_paths else None
    )
    instance_key: KeyKind | None = None if METRICS_PATH in topo.instance_public_paths else "instance"
    targets: list[ScrapeTarget] = []
    for proc in plan.processes():
        if proc.role == "router":
            url = client_router_url(plan.host(proc.host), proc.base_url)
            targets.insert(0, ScrapeTarget(proc.name, proc.role, _host_port(url), router_key))
        else:
            targets.append(ScrapeTarget(proc.name, proc.role, _host_port(proc.base_url), instance_key))
    return targets


def job_name(deployment: str, role: str) -> str:
    return f"kvpush-{deployment}-{'router' if role == 'router' else 'instances'}"


def scrape_config(deployment: str, targets: list[ScrapeTarget], key_files: dict[str, str]) -> dict:
    """prometheus.yml's content: one job for the router, one for the instances. `key_files` maps
    each key kind a target needs to the file holding it."""
    jobs: dict[str, dict] = {}
    for target in targets:
        name = job_name(deployment, target.role)
        job = jobs.setdefault(name, {"job_name": name, "metrics_path": METRICS_PATH, "static_configs": []})
        if target.role == "router":
            # the router's series carry an `instance` label of their own (the vLLM instance a
            # leg went to): keep it rather than renaming it exported_instance
            job["honor_labels"] = True
        if target.key is not None:
            job["authorization"] = {"type": "Bearer", "credentials_file": key_files[target.key]}
        job["static_configs"].append({"targets": [target.address],
                                      "labels": {DEPLOYMENT_LABEL: deployment, PROCESS_LABEL: target.process,
                                                 "role": target.role}})
    return {"global": {"scrape_interval": SCRAPE_INTERVAL}, "scrape_configs": list(jobs.values())}
