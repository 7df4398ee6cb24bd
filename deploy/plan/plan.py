"""The launch plan: a pure function of the topology.

For every host: the files to write and, for every process, the exact argv, environment, working
directory, log file, ports and health URL. `kvpush plan` prints it; `kvpush up` executes exactly
this, and nothing else. How a vLLM instance is started lives in vllm_launch.py, where things go on
a host in placement.py; this module assembles them, with the router's config and process.
"""
from __future__ import annotations

from kvpush.deploy.lifecycle.supervise import supervisor_argv
from kvpush.deploy.topology.host_address import HEALTH_PATH, http_url
from kvpush.deploy.topology.placement import bind_address, deployment_dir, on_cores, secret_path
from kvpush.deploy.topology.topology import (
    ROUTER_PROCESS_NAME,
    HostSpec,
    InstanceSpec,
    RestartSpec,
    Role,
    Topology,
    listening_side_channel_ports,
)
from kvpush.router.config import PrefixAwareSettings, RouterConfig, Timeouts, Upstream
from kvpush.router.instances import InstanceList

from . import slurm_render
from .plan_model import FilePlan, HostPlan, Plan, ProcessPlan, SecretFilePlan, digest
from .router_address import client_router_url, loopback_bind_warning
from .vllm_launch import engine_id, instance_env_names, kv_transfer_config, vllm_argv, vllm_env

ROUTER_INSTANCES_FILE = "router-instances.json"
ROUTER_MODULE = "kvpush.router"


def _supervision(host: HostSpec, workdir: str, name: str, restart: RestartSpec) -> dict:
    status_path = f"{workdir}/run/{name}.json"
    argv = supervisor_argv(host.interpreter, name, status_path, restart.policy, restart.max_restarts, restart.window_s)
    return {"supervisor": argv, "status_path": status_path}


def _vllm_process(topo: Topology, role: Role, spec: InstanceSpec) -> ProcessPlan:
    host = topo.hosts[spec.resolved_host]
    workdir = deployment_dir(topo, host)
    kv_config = kv_transfer_config(topo, role, spec)
    return ProcessPlan(
        name=spec.resolved_name,
        role=role,
        host=spec.resolved_host,
        argv=vllm_argv(topo, spec, kv_config),
        env=vllm_env(topo, role, spec, kv_config),
        cwd=workdir,
        log_path=f"{workdir}/logs/{spec.name}.log",
        http_port=spec.resolved_http_port,
        health_url=http_url(bind_address(host), spec.resolved_http_port, HEALTH_PATH),
        side_channel_ports=listening_side_channel_ports(role, spec, topo.connector.type),
        env_file=secret_path(topo, host, "instance-env"),
        env_file_names=instance_env_names(topo),
        **_supervision(host, workdir, spec.resolved_name, spec.restart),
    )


def router_instance_list(topo: Topology) -> InstanceList:
    """The instances the router sends legs to (colocated: every instance serves whole requests)."""
    def upstream(spec: InstanceSpec) -> Upstream:
        host = topo.hosts[spec.resolved_host]
        return Upstream(
            name=spec.name,
            url=http_url(bind_address(host), spec.resolved_http_port),
            engine_id=engine_id(topo, spec),
            side_channel_host=bind_address(host),
            side_channel_port=spec.side_channel_port,
            tp_size=spec.tensor_parallel_size,
        )

    if topo.connector.type == "colocated":
        return InstanceList(prefill=[], decode=[upstream(s) for _, _, s in topo.instances()])
    return InstanceList(prefill=[upstream(s) for s in topo.prefill], decode=[upstream(s) for s in topo.decode])


def router_config(topo: Topology) -> RouterConfig:
    """The router's config with its instances inline (`kvpush router TOPOLOGY`); `up` writes them
    to a file of their own (router_files)."""
    r = topo.router
    router_host = topo.hosts[r.resolved_host]
    instances = router_instance_list(topo)
    return RouterConfig(
        bind=r.bind,
        port=r.port,
        protocol=topo.connector.type,
        policy=r.policy,
        prefix_aware=PrefixAwareSettings(prefix_weight=r.prefix_weight, load_weight=r.load_weight),
        served_model_name=topo.model.name,
        # Keys travel as files on the router's host, written by `up` (an env var of the machine
        # running kvpush would not reach a remote router).
        api_key_file=secret_path(topo, router_host, "router-client-key") if has_client_key(topo) else None,
        instance_api_key_file=secret_path(topo, router_host, "router-upstream-key"),
        transfer_params_key_file=(secret_path(topo, router_host, "router-params-key")
                                  if topo.connector.type == "kvpush" else None),
        public_paths=r.public_paths,
        max_prompt_chars=r.max_prompt_chars,
        workers=r.workers,
        retry_deadline_s=r.retry_deadline_s,
        max_connections=r.max_connections,
        header_timeout_s=r.header_timeout_s,
        body_timeout_s=r.body_timeout_s,
        keepalive_timeout_s=r.keepalive_timeout_s,
        timeouts=Timeouts(connect_s=r.connect_timeout_s, prefill_s=r.prefill_timeout_s, decode_s=r.decode_timeout_s,
                          health_s=r.health_timeout_s),
        prefill=instances.prefill,
        decode=instances.decode,
    )


def router_files(topo: Topology) -> tuple[FilePlan, FilePlan]:
    """router.json (what the router is started with: a change restarts it) and the instance list it
    names (a change is a reload: `up` rewrites it and sends the router SIGHUP)."""
    workdir = deployment_dir(topo, topo.hosts[topo.router.resolved_host])
    config_path, instances_path = f"{workdir}/router.json", f"{workdir}/{ROUTER_INSTANCES_FILE}"
    # Relative: the router reads it beside its config, wherever the host's workdir lies.
    config = router_config(topo).model_copy(
        update={"instances_file": ROUTER_INSTANCES_FILE, "prefill": [], "decode": []}
    )
    return (FilePlan(path=config_path, content=config.to_file_json(indent=2)),
            FilePlan(path=instances_path, content=router_instance_list(topo).model_dump_json(indent=2)))


def _router_process(topo: Topology) -> tuple[ProcessPlan, tuple[FilePlan, FilePlan]]:
    host = topo.hosts[topo.router.resolved_host]
    workdir = deployment_dir(topo, host)
    files = router_files(topo)
    config_path = files[0].path
    env = {"PYTHONUNBUFFERED": "1", **topo.env}
    proc = ProcessPlan(
        name=ROUTER_PROCESS_NAME,
        role="router",
        host=topo.router.resolved_host,
        argv=on_cores(topo.router.cpu_cores, [host.interpreter, "-m", ROUTER_MODULE, "--config", config_path]),
        env=env,
        cwd=workdir,
        log_path=f"{workdir}/logs/router.log",
        http_port=topo.router.port,
        health_url=http_url(
            "127.0.0.1" if topo.router.bind in ("0.0.0.0", "::") else topo.router.bind, topo.router.port, HEALTH_PATH
        ),
        **_supervision(host, workdir, ROUTER_PROCESS_NAME, topo.router.restart),
        reload_files=[files[1].path],
    )
    return proc, files


def has_client_key(topo: Topology) -> bool:
    """Whether clients must send the router a key (router.api_key_env or router.api_key_file)."""
    return topo.router.api_key_env is not None or topo.router.api_key_file is not None


def _secret_files(topo: Topology, processes: list[ProcessPlan]) -> list[SecretFilePlan]:
    """Every host of the deployment holds the secret; vLLM hosts their key as an env file, the
    router's host the router's keys."""
    if not processes:
        return []
    host = topo.hosts[processes[0].host]
    instances = [p.name for p in processes if p.role != "router"]
    files = [SecretFilePlan(secret_path(topo, host, "deployment-secret"), "deployment-secret",
                            instances if topo.connector.type == "kvpush" else [])]
    if instances:
        files.append(SecretFilePlan(secret_path(topo, host, "instance-env"), "instance-env", instances))
    if any(p.role == "router" for p in processes):
        files.append(
            SecretFilePlan(secret_path(topo, host, "router-upstream-key"), "router-upstream-key", [ROUTER_PROCESS_NAME])
        )
        if topo.connector.type == "kvpush":
            files.append(
                SecretFilePlan(secret_path(topo, host, "router-params-key"), "router-params-key", [ROUTER_PROCESS_NAME])
            )
        if has_client_key(topo):
            files.append(
                SecretFilePlan(secret_path(topo, host, "router-client-key"), "router-client-key", [ROUTER_PROCESS_NAME])
            )
    return files


def build_plan(topo: Topology) -> Plan:
    processes: dict[str, list[ProcessPlan]] = {name: [] for name in topo.hosts}
    files: dict[str, list[FilePlan]] = {name: [] for name in topo.hosts}
    for role, _, spec in topo.instances():
        processes[spec.resolved_host].append(_vllm_process(topo, role, spec))
    router, router_host_files = _router_process(topo)
    processes[router.host].append(router)
    files[router.host] += router_host_files

    hosts = [
        HostPlan(
            **spec.address_fields(),
            name=name,
            workdir=deployment_dir(topo, spec),
            python=spec.interpreter,
            files=files[name],
            processes=processes[name],
            secret_files=_secret_files(topo, processes[name]),
            slurm=slurm_render.host_fields(topo, name),
        )
        for name, spec in topo.hosts.items()
        if processes[name] or files[name]
    ]
    router_host = next(h for h in hosts if h.name == router.host)
    loopback = loopback_bind_warning(router.host, router_host, topo.router.bind, topo.router.port)
    return Plan(
        deployment=topo.name,
        connector=topo.connector.type,
        platform=topo.platform,
        model_path=topo.model.path,
        served_model_name=topo.model.name,
        router_url=router.base_url,
        router_client_url=client_router_url(router_host, router.base_url),
        hosts=hosts,
        topology_digest=digest(topo.model_dump(mode="json")),
        slurm=slurm_render.plan_fields(topo, hosts),
        warnings=[loopback] if loopback else [],
    )
