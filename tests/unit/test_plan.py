"""The plan is a pure function of the topology, with exact argv/env per process."""
from __future__ import annotations

import json

import pytest

from kvpush.common.errors import UsageError
from kvpush.deploy.plan.plan import build_plan
from kvpush.deploy.plan.vllm_launch import kv_transfer_config
from kvpush.deploy.topology.topology import parse_topology
from kvpush.router.config import RouterConfig
from kvpush.templates import template_names, template_text

TWO_HOSTS = """
name: t
model: {path: /m/tiny, served_name: tiny, max_model_len: 1024}
connector: {type: %s}
hosts:
  a: {address: 127.0.0.2, ssh_port: 2222, user: root, venv: /opt/venv}
  b: {address: 127.0.0.3, ssh_port: 2222, user: root, venv: /opt/venv}
prefill: [{host: a, cpu_cores: "0", kv_cache_gib: 1}]
decode: [{host: b, cpu_cores: "1"}]
router: {host: a, port: 9000}
env: {GLOBAL: "1"}
"""


def plan_for(connector: str = "kvpush"):
    return build_plan(parse_topology(TWO_HOSTS % connector))


def router_config_of(plan, host: str, tmp_path) -> RouterConfig:
    """The config the router reads: router.json and the instance list it names, as written on the host."""
    config_file, instances_file = plan.host(host).files
    assert config_file.path.endswith("/router.json") and instances_file.path.endswith("/router-instances.json")
    (tmp_path / "router.json").write_text(config_file.content)
    (tmp_path / "router-instances.json").write_text(instances_file.content)
    return RouterConfig.from_file(tmp_path / "router.json")


def test_plan_is_deterministic():
    assert plan_for().to_json() == plan_for().to_json()


def test_vllm_argv_and_env_for_kvpush():
    plan = plan_for("kvpush")
    prefill = plan.process("prefill-0")
    # CPU cores given: the whole instance runs on them (taskset), not only vLLM's OpenMP threads
    assert prefill.host == "a" and prefill.argv[:6] == ["taskset", "--cpu-list", "0", "/opt/venv/bin/python", "-m",
                                                        "vllm.entrypoints.openai.api_server"]
    assert plan.process("decode-0").argv[:3] == ["taskset", "--cpu-list", "1"]
    argv = prefill.argv
    assert argv[argv.index("--port") + 1] == "8100"
    assert argv[argv.index("--host") + 1] == "127.0.0.2"
    config = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert config["kv_connector"] == "KVPushConnector"
    assert config["kv_connector_module_path"] == "kvpush.connector"
    assert config["kv_role"] == "kv_producer"
    assert config["engine_id"] == "t.prefill-0"
    assert config["kv_connector_extra_config"]["allowed_engines"] == ["t.decode-0"]
    assert prefill.env["VLLM_CPU_OMP_THREADS_BIND"] == "0"
    assert argv[argv.index("--kv-cache-memory-bytes") + 1] == str(1 << 30)
    assert "VLLM_CPU_KVCACHE_SPACE" not in prefill.env  # whole GiB only; the flag takes any size
    assert "--kv-cache-memory-bytes" not in plan.process("decode-0").argv  # no kv_cache_gib: vLLM's default
    assert prefill.env["GLOBAL"] == "1"
    assert prefill.env["NIXL_LOG_LEVEL"] == "WARN"
    assert prefill.log_path == "~/.kvpush/t/logs/prefill-0.log"
    decode = plan.process("decode-0")
    decode_config = json.loads(decode.argv[decode.argv.index("--kv-transfer-config") + 1])
    assert decode_config["kv_role"] == "kv_consumer"
    assert decode.health_url == "http://127.0.0.3:8200/health"
    for proc in (prefill, decode):  # the router's probes and the scrapes stay out of the instance's log
        assert proc.argv[proc.argv.index("--disable-access-log-for-endpoints") + 1] == "/health,/metrics"


@pytest.mark.parametrize("connector,name", [("nixl-push", "NixlPushConnector"), ("nixl-pull", "NixlConnector")])
def test_vllm_connectors(connector, name):
    decode = plan_for(connector).process("decode-0")
    config = json.loads(decode.argv[decode.argv.index("--kv-transfer-config") + 1])
    assert config["kv_connector"] == name and config["kv_role"] == "kv_both"
    assert decode.env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == str(decode.side_channel_ports[0])


@pytest.mark.parametrize("platform,module", [("cpu", "kvpush.connector.vllm_nixl"), ("cuda", None)])
def test_vllm_connectors_on_cpu_load_kvpush_quiet_subclasses(platform, module):
    """Same class names (vLLM keys behaviour on them); on CPU from kvpush's module, on GPU stock."""
    text = TWO_HOSTS % "nixl-push"
    if platform == "cuda":
        text = "platform: cuda\n" + text.replace('cpu_cores: "0", kv_cache_gib: 1', "devices: [0]").replace('cpu_cores: "1"', "devices: [0]")
    decode = build_plan(parse_topology(text)).process("decode-0")
    config = json.loads(decode.argv[decode.argv.index("--kv-transfer-config") + 1])
    assert config["kv_connector"] == "NixlPushConnector"
    assert config.get("kv_connector_module_path") == module


def test_colocated_has_no_connector_and_router_spreads_over_all(tmp_path):
    plan = plan_for("colocated")
    for proc in plan.processes():
        assert "--kv-transfer-config" not in proc.argv
        assert not proc.side_channel_ports
    config = router_config_of(plan, "a", tmp_path)
    assert config.protocol == "colocated"
    assert [u.name for u in config.decode] == ["prefill-0", "decode-0"]


def test_router_process_and_config_file(tmp_path):
    plan = plan_for()
    router = plan.process("router")
    assert router.host == "a"
    assert router.argv == ["/opt/venv/bin/python", "-m", "kvpush.router", "--config", "~/.kvpush/t/router.json"]
    # The instances in a file of their own, which the router reads again on SIGHUP
    assert router.reload_files == ["~/.kvpush/t/router-instances.json"]
    assert RouterConfig.model_validate_json(plan.host("a").files[0].content).instances_file == "router-instances.json"
    config = router_config_of(plan, "a", tmp_path)
    assert config.port == 9000 and config.protocol == "kvpush" and config.workers == 1
    assert config.prefill[0].url == "http://127.0.0.2:8100"
    assert config.decode[0].engine_id == "t.decode-0"
    assert plan.router_url == "http://127.0.0.1:9000"


def test_process_digest_changes_only_for_the_changed_process():
    before = plan_for()
    after = build_plan(parse_topology((TWO_HOSTS % "kvpush").replace('cpu_cores: "1"', 'cpu_cores: "1", env: {X: "2"}')))
    assert before.process("prefill-0").digest() == after.process("prefill-0").digest()
    assert before.process("decode-0").digest() != after.process("decode-0").digest()


def test_cpu_instances_run_their_worker_inside_the_engine_process():
    plan = plan_for()
    assert {plan.process(n).env["VLLM_ENABLE_V1_MULTIPROCESSING"] for n in ("prefill-0", "decode-0")} == {"0"}
    kept = build_plan(parse_topology((TWO_HOSTS % "kvpush").replace('GLOBAL: "1"', 'VLLM_ENABLE_V1_MULTIPROCESSING: "1"')))
    assert kept.process("decode-0").env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"
    gpu = build_plan(parse_topology(template_text("p5en-1p1d"))).process("decode-0")
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in gpu.env


def test_only_the_instances_file_changes_when_an_instance_is_added():
    before = plan_for()
    after = build_plan(parse_topology((TWO_HOSTS % "kvpush").replace(
        'decode: [{host: b, cpu_cores: "1"}]', 'decode: [{host: b, cpu_cores: "1"}, {host: b, cpu_cores: "0"}]')))
    assert before.process("router").digest() == after.process("router").digest()
    (config_before, list_before), (config_after, list_after) = before.host("a").files, after.host("a").files
    assert config_before == config_after and list_before != list_after


def test_cpu_tensor_parallel_instance_binds_each_rank_to_its_cores(tmp_path):
    plan = build_plan(parse_topology(template_text("local-cpu-tp2")))
    prefill = plan.process("prefill-0")
    assert prefill.argv[:3] == ["taskset", "--cpu-list", "0-1"]  # the whole tree on the union
    assert prefill.env["VLLM_CPU_OMP_THREADS_BIND"] == "0|1"  # each rank's OpenMP threads on its own
    at = prefill.argv.index("--tensor-parallel-size")
    assert prefill.argv[at:at + 4] == ["--tensor-parallel-size", "2", "--distributed-executor-backend", "mp"]
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in prefill.env  # the ranks are worker processes anyway
    assert prefill.side_channel_ports == [5600, 5601]
    assert plan.process("decode-0").side_channel_ports == []  # kvpush's decode dials prefill; it binds none
    config = router_config_of(plan, "local", tmp_path)
    assert [u.tp_size for u in config.prefill + config.decode] == [2, 2]


def test_router_public_paths_reach_the_router_config():
    text = (TWO_HOSTS % "kvpush").replace("router: {host: a, port: 9000}", "router: {host: a, port: 9000, public_paths: [/health, /metrics]}")
    plan = build_plan(parse_topology(text))
    config = RouterConfig.model_validate_json(plan.host("a").files[0].content)
    assert config.public_paths == ["/health", "/metrics"]


def test_router_timeouts_reach_the_router_config():
    text = (TWO_HOSTS % "kvpush").replace("router: {host: a, port: 9000}",
                                           "router: {host: a, port: 9000, health_timeout_s: 4, connect_timeout_s: 2}")
    config = RouterConfig.model_validate_json(build_plan(parse_topology(text)).host("a").files[0].content)
    assert (config.timeouts.health_s, config.timeouts.connect_s) == (4.0, 2.0)
    default = RouterConfig.model_validate_json(build_plan(parse_topology(TWO_HOSTS % "kvpush")).host("a").files[0].content)
    assert default.timeouts.health_s == 1.0


def test_router_retry_deadline_reaches_the_router_config():
    text = (TWO_HOSTS % "kvpush").replace("router: {host: a, port: 9000}",
                                           "router: {host: a, port: 9000, retry_deadline_s: 12.5}")
    config = RouterConfig.model_validate_json(build_plan(parse_topology(text)).host("a").files[0].content)
    assert config.retry_deadline_s == 12.5
    default = RouterConfig.model_validate_json(build_plan(parse_topology(TWO_HOSTS % "kvpush")).host("a").files[0].content)
    assert default.retry_deadline_s == RouterConfig.model_fields["retry_deadline_s"].default == 60.0


def test_a_router_retry_deadline_that_is_not_positive_is_refused_naming_the_field():
    text = (TWO_HOSTS % "kvpush").replace("router: {host: a, port: 9000}",
                                           "router: {host: a, port: 9000, retry_deadline_s: 0}")
    with pytest.raises(UsageError, match="retry_deadline_s"):
        parse_topology(text)


def test_router_policy_and_its_weights_reach_the_router_config():
    text = (TWO_HOSTS % "kvpush").replace("router: {host: a, port: 9000}",
                                           "router: {host: a, port: 9000, policy: prefix-aware, prefix_weight: 2, "
                                           "load_weight: 0.5}")
    config = RouterConfig.model_validate_json(build_plan(parse_topology(text)).host("a").files[0].content)
    assert (config.policy, config.prefix_aware.prefix_weight, config.prefix_aware.load_weight) == ("prefix-aware", 2.0, 0.5)
    default = RouterConfig.model_validate_json(build_plan(parse_topology(TWO_HOSTS % "kvpush")).host("a").files[0].content)
    assert default.policy == RouterConfig.model_fields["policy"].default == "prefix-aware"
    assert (default.prefix_aware.prefix_weight, default.prefix_aware.load_weight) == (1.0, 0.5)
    least = (TWO_HOSTS % "kvpush").replace("router: {host: a, port: 9000}", "router: {host: a, port: 9000, policy: least-loaded}")
    assert RouterConfig.model_validate_json(build_plan(parse_topology(least)).host("a").files[0].content).policy == "least-loaded"


@pytest.mark.parametrize("field", ["policy: nearest", "load_weight: -1", "prefix_weight: true"])
def test_a_bad_router_policy_or_weight_is_refused_naming_the_field(field):
    text = (TWO_HOSTS % "kvpush").replace("router: {host: a, port: 9000}", "router: {host: a, port: 9000, %s}" % field)
    with pytest.raises(UsageError, match=field.split(":")[0]):
        parse_topology(text)


def test_hetero_template_pairs_prefill_tp2_with_decode_tp1():
    topo = parse_topology(template_text("local-cpu-hetero"))
    assert [s.tensor_parallel_size for _, _, s in topo.instances()] == [2, 1]


def test_cuda_instance_gets_visible_devices():
    topo = parse_topology(template_text("p5en-1p1d"))
    plan = build_plan(topo)
    prefill = plan.process("prefill-0")
    assert prefill.env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3,4,5,6,7"
    assert "--tensor-parallel-size" in prefill.argv
    config = json.loads(prefill.argv[prefill.argv.index("--kv-transfer-config") + 1])
    assert config["kv_buffer_device"] == "cuda"
    assert config["kv_connector_extra_config"]["backend"] == "LIBFABRIC"
    assert prefill.env["FI_PROVIDER"] == "efa"


@pytest.mark.parametrize("name", template_names())
def test_every_template_validates_and_plans(name):
    topo = parse_topology(template_text(name), f"<template {name}>")
    plan = build_plan(topo)
    json.loads(plan.to_json())
    assert {p.role for p in plan.processes()} == {"prefill", "decode", "router"}


def test_required_templates_are_shipped():
    assert {"local-cpu", "local-cpu-tp2", "local-cpu-hetero", "local-gpu", "p5en-1p1d", "xpyd"} <= set(template_names())


def test_local_gpu_template_shares_one_gpu_between_prefill_and_decode():
    plan = build_plan(parse_topology(template_text("local-gpu")))
    instances = [p for p in plan.processes() if p.role != "router"]
    assert {p.env["CUDA_VISIBLE_DEVICES"] for p in instances} == {"0"}
    assert all("--kv-cache-memory-bytes" in p.argv for p in instances)
    assert len({p.argv[p.argv.index("--port") + 1] for p in instances}) == 2


def test_a_gpu_is_shared_only_where_every_instance_sharing_it_says_so():
    text = template_text("local-gpu")
    with pytest.raises(Exception, match="also given to prefill.*share_gpus: true"):
        parse_topology(text.replace("share_gpus: true", "share_gpus: false", 1).replace("share_gpus: true", "share_gpus: true"))


def test_xpyd_spreads_over_four_hosts():
    plan = build_plan(parse_topology(template_text("xpyd")))
    roles = sorted(p.role for p in plan.processes() if p.role != "router")
    assert roles == ["decode", "decode", "prefill", "prefill"]
    assert len({p.host for p in plan.processes()}) == 4


def test_kv_transfer_config_none_for_colocated():
    topo = parse_topology((TWO_HOSTS % "colocated"))
    assert kv_transfer_config(topo, "prefill", topo.prefill[0]) is None


def test_pinned_router_runs_under_taskset_beside_an_instance():
    plan = build_plan(parse_topology(TWO_HOSTS.replace("router: {host: a, port: 9000}",
                                                       "router: {host: a, port: 9000, cpu_cores: '0'}") % "kvpush"))
    assert plan.process("router").argv[:4] == ["taskset", "--cpu-list", "0", "/opt/venv/bin/python"]


def test_router_workers_reach_the_router_config():
    plan = build_plan(parse_topology(TWO_HOSTS.replace("router: {host: a, port: 9000}",
                                                       "router: {host: a, port: 9000, workers: 3}") % "kvpush"))
    assert RouterConfig.model_validate_json(plan.host("a").files[0].content).workers == 3


def test_local_cpu_template_keeps_router_off_the_prefill_core():
    topo = parse_topology(template_text("local-cpu"))
    assert topo.router.cpu_cores == topo.decode[0].cpu_cores != topo.prefill[0].cpu_cores



def test_secrets_appear_in_the_plan_as_paths_only():
    topo = parse_topology("name: t\nmodel: {path: /m}\nrouter: {api_key_env: MY_KEY}\nprefill: [{}]\ndecode: [{}]\n")
    plan = build_plan(topo)
    prefill, router = plan.process("prefill-0"), plan.process("router")
    config = json.loads(prefill.argv[prefill.argv.index("--kv-transfer-config") + 1])
    assert config["kv_connector_extra_config"]["secret_file"] == "~/.kvpush/t/deployment.secret"
    assert prefill.env_file == "~/.kvpush/t/instance-api-key.env" and "VLLM_API_KEY" not in prefill.env
    assert router.env_file is None
    router_config = json.loads(plan.host("local").files[0].content)
    assert router_config["api_key_env"] is None  # the router's host may not have this machine's environment
    assert router_config["api_key_file"] == "~/.kvpush/t/router-client.key"
    assert router_config["instance_api_key_file"] == "~/.kvpush/t/router-upstream.key"
    without_key = json.loads(build_plan(parse_topology("name: t\nmodel: {path: /m}\nprefill: [{}]\ndecode: [{}]\n"))
                             .host("local").files[0].content)
    assert without_key["api_key_file"] is None and without_key["instance_api_key_file"] == "~/.kvpush/t/router-upstream.key"


def test_vllms_own_connectors_get_no_secret_file():
    topo = parse_topology("name: t\nmodel: {path: /m}\nconnector: {type: nixl-pull}\nprefill: [{}]\ndecode: [{}]\n")
    prefill = build_plan(topo).process("prefill-0")
    config = json.loads(prefill.argv[prefill.argv.index("--kv-transfer-config") + 1])
    assert "secret_file" not in config["kv_connector_extra_config"] and prefill.env_file is not None


def test_every_process_starts_under_its_supervisor_with_its_restart_policy():
    topo = parse_topology(TWO_HOSTS.replace('decode: [{host: b, cpu_cores: "1"}]',
                                            'decode: [{host: b, cpu_cores: "1", restart: {policy: on-failure, max_restarts: 2, window_s: 60}}]') % "kvpush")
    plan = build_plan(topo)
    decode, prefill = plan.process("decode-0"), plan.process("prefill-0")
    assert decode.launch_argv == decode.supervisor + decode.argv
    assert decode.supervisor == ["/opt/venv/bin/python", "-m", "kvpush.deploy.lifecycle.supervise", "--name", "decode-0",
                                 "--status-file", "~/.kvpush/t/run/decode-0.json", "--restart", "on-failure",
                                 "--max-restarts", "2", "--window-s", "60", "--"]
    assert "--restart" not in prefill.supervisor and prefill.supervisor[-1] == "--"
    assert plan.process("router").status_path == "~/.kvpush/t/run/router.json"
    assert decode.digest() != plan_for().process("decode-0").digest()  # a new policy is a changed launch


def test_tracing_sends_each_instances_request_spans_named_by_instance_deployment_and_role():
    plain = plan_for()
    assert all("--otlp-traces-endpoint" not in p.argv and not any(k.startswith("OTEL_") for k in p.env)
               for p in plain.processes())  # off unless the topology asks
    topo = parse_topology(TWO_HOSTS % "nixl-pull" + "tracing: {otlp_endpoint: 'http://127.0.0.1:4318/v1/traces', "
                                                     "export_delay_ms: 200}\n")
    plan = build_plan(topo)
    for name, role in (("prefill-0", "prefill"), ("decode-0", "decode")):
        proc = plan.process(name)
        flag = proc.argv.index("--otlp-traces-endpoint")
        assert proc.argv[flag + 1] == "http://127.0.0.1:4318/v1/traces"
        assert proc.env["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] == "http/protobuf"
        assert proc.env["OTEL_BSP_SCHEDULE_DELAY"] == "200"
        assert proc.env["OTEL_SERVICE_NAME"] == name
        assert proc.env["OTEL_RESOURCE_ATTRIBUTES"] == f"kvpush.deployment=t,kvpush.role={role}"
    assert "--otlp-traces-endpoint" not in plan.process("router").argv


@pytest.mark.parametrize("endpoint", ["127.0.0.1:4318", "http://a b/v1/traces", "http://host/x?y=1", "file:///tmp/x"])
def test_tracing_endpoint_must_be_a_plain_http_url(endpoint):
    from kvpush.deploy.topology.topology import TopologyError

    with pytest.raises(TopologyError, match="tracing.otlp_endpoint"):
        parse_topology(TWO_HOSTS % "kvpush" + f"tracing: {{otlp_endpoint: '{endpoint}'}}\n")


def test_a_fraction_of_a_gib_of_kv_cache_is_given_to_vllm_in_bytes():
    plan = build_plan(parse_topology(TWO_HOSTS.replace("kv_cache_gib: 1", "kv_cache_gib: 0.25") % "kvpush"))
    argv = plan.process("prefill-0").argv
    assert argv[argv.index("--kv-cache-memory-bytes") + 1] == str(256 * 1024 * 1024)


def test_what_a_router_client_may_hold_reaches_the_router_config_and_a_bad_bound_is_refused_naming_it():
    limits = "max_connections: 500, header_timeout_s: 4, body_timeout_s: 20, keepalive_timeout_s: 15"
    text = (TWO_HOSTS % "kvpush").replace("router: {host: a, port: 9000}", f"router: {{host: a, port: 9000, {limits}}}")
    config = RouterConfig.model_validate_json(build_plan(parse_topology(text)).host("a").files[0].content)
    assert (config.max_connections, config.header_timeout_s, config.body_timeout_s, config.keepalive_timeout_s) == (
        500, 4.0, 20.0, 15.0)
    default = RouterConfig.model_validate_json(build_plan(parse_topology(TWO_HOSTS % "kvpush")).host("a").files[0].content)
    assert default.header_timeout_s == RouterConfig.model_fields["header_timeout_s"].default
    for bad in ("header_timeout_s: .inf", "body_timeout_s: 0", "max_connections: 0"):
        text = (TWO_HOSTS % "kvpush").replace("router: {host: a, port: 9000}", f"router: {{host: a, port: 9000, {bad}}}")
        with pytest.raises(UsageError, match=bad.split(":")[0]):
            parse_topology(text)
