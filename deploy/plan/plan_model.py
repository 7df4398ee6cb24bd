"""The launch plan's data: what build_plan (plan.py) returns and every later stage reads.

Kept apart from build_plan so that what renders a plan (slurm_render.py, redact.py) and what
records or compares one (state, changes, secrets) read these types without importing the
function that builds it.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Literal

from kvpush.deploy.topology.host_address import HostAddress, base_url
from kvpush.deploy.topology.placement import SecretKind

ProcessRole = Literal["prefill", "decode", "router"]


@dataclass(frozen=True)
class ProcessPlan:
    name: str
    role: ProcessRole
    host: str
    argv: list[str]
    env: dict[str, str]  # added to the host's environment
    cwd: str
    log_path: str
    http_port: int
    health_url: str
    side_channel_ports: list[int] = field(default_factory=list)
    env_file: str | None = None  # a 0600 file of secret variables the launch sources (written by `up`)
    env_file_names: list[str] = field(default_factory=list)  # the variables it holds (their names only)
    # What argv runs under (kvpush.deploy.lifecycle.supervise: the tree dies with it, restarts, status file).
    supervisor: list[str] = field(default_factory=list)
    status_path: str = ""
    # Host files the process reads again on SIGHUP (the router's instance list): `up` rewrites them
    # and signals it, instead of restarting it.
    reload_files: list[str] = field(default_factory=list)

    @property
    def base_url(self) -> str:
        return base_url(self.health_url)

    @property
    def launch_argv(self) -> list[str]:
        """What a launcher starts: argv under its supervisor."""
        return self.supervisor + self.argv

    def digest(self) -> str:
        """Changes whenever anything about how this process is launched changes (what it reloads
        is not how it is launched)."""
        launch = asdict(self)
        del launch["reload_files"]
        return digest(launch)


@dataclass(frozen=True)
class FilePlan:
    path: str
    content: str


@dataclass(frozen=True)
class SecretFilePlan:
    path: str
    kind: SecretKind
    used_by: list[str]  # processes that read it at start: a new content restarts them


@dataclass(kw_only=True)
class HostPlan(HostAddress):
    name: str
    workdir: str
    python: str
    files: list[FilePlan]
    processes: list[ProcessPlan]
    secret_files: list[SecretFilePlan] = field(default_factory=list)
    slurm: dict | None = None  # launcher slurm: job_id, node, srun_options (deploy/plan/slurm_render.py)


@dataclass(frozen=True)
class Plan:
    deployment: str
    connector: str
    platform: str
    model_path: str
    served_model_name: str
    router_url: str  # as the router's own host reaches it (health check, `up`'s proof)
    router_client_url: str  # as clients where kvpush runs reach it (router_address.py)
    hosts: list[HostPlan]
    topology_digest: str
    slurm: dict | None = None  # launcher slurm: sbatch options and script, each process's srun line
    warnings: list[str] = field(default_factory=list)  # one line each: what `plan` and `up` say before launching

    def processes(self) -> list[ProcessPlan]:
        return [p for h in self.hosts for p in h.processes]

    def instance_names(self) -> set[str]:
        """The vLLM instances (what the router's instance list names)."""
        return {p.name for p in self.processes() if p.role != "router"}

    def process(self, name: str) -> ProcessPlan:
        for proc in self.processes():
            if proc.name == name:
                return proc
        raise KeyError(name)

    def router_url_from_here(self) -> str:
        """The router's URL for a client where kvpush runs."""
        return self.router_client_url

    def host(self, name: str) -> HostPlan:
        for host in self.hosts:
            if host.name == name:
                return host
        raise KeyError(name)

    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)



def digest(obj: object) -> str:
    """A short, stable hash of a JSON-able value (what `up` compares to see a launch changed)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]
