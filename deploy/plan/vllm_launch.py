"""How a vLLM instance of the topology is started: its command line, its environment and the KV
transfer config that loads the connector the topology names (plan.py wraps them in the instance's
ProcessPlan)."""
from __future__ import annotations

import json

from pydantic import ValidationError

from kvpush.common.errors import UsageError
from kvpush.common.instance_auth import KEY_VARIABLE, MIDDLEWARE_PATH, PUBLIC_PATHS_VARIABLE
from kvpush.connector.settings import ConnectorExtraConfig
from kvpush.deploy.topology.placement import bind_address, on_cores, secret_path
from kvpush.deploy.topology.topology import InstanceSpec, Role, Topology, core_list_text, parse_core_list

from .engine_tracing import tracing_argv, tracing_env

VLLM_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
QUIET_ENDPOINTS = "/health,/metrics"  # paths the instance's access log leaves out
KVPUSH_CONNECTOR_CLASS = "KVPushConnector"
KVPUSH_CONNECTOR_MODULE = "kvpush.connector"
# vLLM's NIXL connectors with a sleeping progress thread and no re-pinning (see the module): on a
# CPU host those two cost a core each; on GPU hosts vLLM's stock classes run unchanged.
VLLM_NIXL_CPU_MODULE = "kvpush.connector.vllm_nixl"

# Environment every vLLM process gets, whatever the topology says.
BASE_VLLM_ENV = {
    "PYTHONUNBUFFERED": "1",
    "NIXL_LOG_LEVEL": "WARN",  # NIXL's Python logger writes INFO to stdout otherwise
    "VLLM_LOGGING_LEVEL": "INFO",
}


def engine_id(topo: Topology, spec: InstanceSpec) -> str:
    """Stable engine identity: the connector's allowlists name peers by it."""
    return f"{topo.name}.{spec.name}"


def kv_transfer_config(topo: Topology, role: Role, spec: InstanceSpec) -> dict | None:
    kind = topo.connector.type
    if kind == "colocated":
        return None
    buffer_device = "cpu" if topo.platform == "cpu" else "cuda"
    if kind == "kvpush":
        peers = topo.decode if role == "prefill" else topo.prefill
        extra = connector_settings(topo, spec, peers)
        return {
            "kv_connector": KVPUSH_CONNECTOR_CLASS,
            "kv_connector_module_path": KVPUSH_CONNECTOR_MODULE,
            "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
            "kv_buffer_device": buffer_device,
            "engine_id": engine_id(topo, spec),
            "kv_connector_extra_config": extra.to_json_dict(),
        }
    config = {
        "kv_connector": "NixlPushConnector" if kind == "nixl-push" else "NixlConnector",
        "kv_role": "kv_both",
        "kv_buffer_device": buffer_device,
        "engine_id": engine_id(topo, spec),
        "kv_connector_extra_config": {"backends": [topo.connector.backend], **topo.connector.extra_config},
    }
    if topo.platform == "cpu" and not topo.connector.stock_vllm:
        config["kv_connector_module_path"] = VLLM_NIXL_CPU_MODULE
    return config


def connector_settings(topo: Topology, spec: InstanceSpec, peers: list[InstanceSpec]) -> ConnectorExtraConfig:
    """The kvpush connector's settings for one instance: the topology's connector section and
    extra_config, then what kvpush derives from the deployment (the topology's loader refuses
    those in extra_config; were one to get through, kvpush's would still win)."""
    host = topo.hosts[spec.resolved_host]
    try:
        return ConnectorExtraConfig.model_validate({
            "backend": topo.connector.backend,
            "transfer_timeout_s": topo.connector.transfer_timeout_s,
            **topo.connector.extra_config,
            "side_channel_host": bind_address(host),
            "side_channel_port": spec.side_channel_port,
            "allowed_engines": sorted(engine_id(topo, p) for p in peers),
            # where each peer's side channel is: decode dials these and nothing a request names
            "peer_side_channels": {
                engine_id(topo, p): f"{bind_address(topo.hosts[p.resolved_host])}:{p.side_channel_port}"
                for p in sorted(peers, key=lambda p: p.resolved_name)},
            "secret_file": secret_path(topo, host, "deployment-secret"),  # a path on that host (~ expanded there)
        })
    except ValidationError as exc:  # the topology's checks refuse a bad extra_config first (topology_checks.py)
        error = exc.errors()[0]
        raise UsageError(f"connector.extra_config.{error['loc'][0]}: {error['msg']}") from None


def kv_cache_bytes(gib: float) -> int:
    """A rank's KV cache size in bytes, in whole MiB: a flag rather than VLLM_CPU_KVCACHE_SPACE, which
    takes whole GiB only."""
    return round(gib * 1024) * 1024 * 1024


def vllm_argv(topo: Topology, spec: InstanceSpec, kv_config: dict | None) -> list[str]:
    """The instance's command line: vLLM's OpenAI server with the model, its ports and parallelism,
    the KV transfer config, and on a CPU host with cores of its own, the whole of it on them."""
    host = topo.hosts[spec.resolved_host]
    model = topo.model
    argv = [
        host.interpreter, "-m", VLLM_SERVER_MODULE,
        "--model", model.path,
        "--served-model-name", model.name,
        "--host", bind_address(host),
        "--port", str(spec.http_port),
        "--dtype", model.dtype,
        # The router probes /health twice a second and bench and status scrape /metrics: left in,
        # their lines would bury the requests in the instance's log.
        "--disable-access-log-for-endpoints", QUIET_ENDPOINTS,
    ]
    if model.max_model_len:
        argv += ["--max-model-len", str(model.max_model_len)]
    if model.block_size:
        argv += ["--block-size", str(model.block_size)]
    if model.enforce_eager:
        argv.append("--enforce-eager")
    if spec.tensor_parallel_size > 1:
        argv += ["--tensor-parallel-size", str(spec.tensor_parallel_size)]
        if topo.platform == "cpu":  # one worker process per rank; vLLM's CPU build has no ray
            argv += ["--distributed-executor-backend", "mp"]
    if spec.data_parallel_size > 1:
        argv += ["--data-parallel-size", str(spec.data_parallel_size)]
    if topo.platform == "cpu" and spec.kv_cache_gib is not None:
        argv += ["--kv-cache-memory-bytes", str(kv_cache_bytes(spec.kv_cache_gib))]
    if kv_config is not None:
        argv += ["--kv-transfer-config", json.dumps(kv_config, separators=(",", ":"), sort_keys=True)]
    argv += tracing_argv(topo)
    argv += model.extra_args + spec.extra_args
    # Last, so vLLM adds it last: the outermost of the app's middleware, before any route or the
    # user's own --middleware sees a request without the instance key.
    argv += ["--middleware", MIDDLEWARE_PATH]
    if topo.platform == "cpu" and spec.cpu_cores is not None:
        # The whole instance on its cores, not only vLLM's OpenMP threads: otherwise its API server
        # and engine loop float onto the other instance's core. Measured: a decode engine stepping
        # every ms while it waits for pushed KV took half of prefill's core (benchmarks/notes/cpu-placement.md,
        # "Pin the whole instance, not only its OpenMP threads").
        argv = on_cores(core_list_text(parse_core_list(spec.cpu_cores)), argv)
    return argv


def vllm_env(topo: Topology, role: Role, spec: InstanceSpec, kv_config: dict | None) -> dict[str, str]:
    """What the instance's environment gets on top of its host's: the base, the topology's `env`,
    the side channel, CPU or GPU placement, the engine's tracing (if asked for), then the instance's own
    `env`."""
    host = topo.hosts[spec.resolved_host]
    env = dict(BASE_VLLM_ENV)
    env.update(topo.env)
    if kv_config is not None:
        env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = bind_address(host)
        env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(spec.side_channel_port)
    if topo.platform == "cpu":
        if spec.tensor_parallel_size == 1:
            # One worker: run it inside the engine process (vLLM's "uni" executor) instead of a
            # worker process behind a shared-memory queue whose reader yield-spins. Measured on
            # the 2-core host: a decode waiting for pushed KV used 0.98 of its core with the worker
            # process (engine 0.84, spinning) and 0.15 without; TPOT fell from 12-13 ms to 9-10 ms
            # in both push and pull (benchmarks/notes/cpu-placement.md, "One process per engine on CPU").
            # The topology's `env` may set it to "1".
            env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        if spec.cpu_cores is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = spec.cpu_cores
    else:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(d) for d in spec.devices)
    env.update(tracing_env(topo, role, spec))
    env.update(spec.env)
    env[PUBLIC_PATHS_VARIABLE] = ",".join(topo.instance_public_paths)  # the instance key itself: the env file
    return env


def instance_env_names(topo: Topology) -> list[str]:
    """The variables of an instance's env file (`up` writes it, the launch sources it): the
    instance key and the topology's `secrets`, by name; their values are never in the plan."""
    return [KEY_VARIABLE, *sorted(topo.secrets)]
