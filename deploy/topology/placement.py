"""Where a deployment's pieces go on a host: its directory, its secret files, the address its
processes bind and the cores they run on. Pure functions of the topology, shared by the launch
plan of vLLM instances (vllm_launch.py) and of the router (plan.py)."""
from __future__ import annotations

from typing import Literal

from .topology import HostSpec, Topology

# Files `up` writes (mode 0600) from the deployment secret; the plan names them, never their content.
SecretKind = Literal[
    "deployment-secret", "instance-env", "router-upstream-key", "router-client-key", "router-params-key"
]
SECRET_FILE_NAMES: dict[SecretKind, str] = {
    "deployment-secret": "deployment.secret",  # the secret itself (the connector derives its keys)
    "instance-env": "instance-api-key.env",  # VLLM_API_KEY=..., sourced by each vLLM launch
    "router-upstream-key": "router-upstream.key",  # the same key, for the router's requests to the instances
    "router-client-key": "router-client.key",  # the key clients send to the router (router.api_key_env/_file)
    "router-params-key": "router-params.key",  # the key the router signs kv_transfer_params with (derived)
}


def deployment_dir(topo: Topology, host: HostSpec) -> str:
    return f"{host.workdir.rstrip('/')}/{topo.name}"


def bind_address(host: HostSpec) -> str:
    return "127.0.0.1" if host.address == "localhost" else host.address


def on_cores(cores: str | None, argv: list[str]) -> list[str]:
    """`argv` run on the given cores ("0-3,8") with taskset, so every process and thread it
    starts stays there; unchanged when no cores are given."""
    return argv if cores is None else ["taskset", "--cpu-list", cores, *argv]


def secret_path(topo: Topology, host: HostSpec, kind: SecretKind) -> str:
    return f"{deployment_dir(topo, host)}/{SECRET_FILE_NAMES[kind]}"


def secret_paths_in(workdir: str) -> list[str]:
    """Every secret file a host of the deployment whose directory is `workdir` may hold (`down` removes them)."""
    return [f"{workdir.rstrip('/')}/{name}" for name in SECRET_FILE_NAMES.values()]
