"""Every metric `kvpush monitor`'s dashboard reads exists in real /metrics output, parsed by
Prometheus's own text parser: a router process serving requests, and the connector's metrics
registered through vLLM's real KV-connector Prometheus hook."""
from __future__ import annotations

import signal
import subprocess
import sys
import urllib.request

import pytest
import yaml
from kvpush.deploy.plan.dashboard import metric_names
from prometheus_client.parser import text_string_to_metric_families
from router_process_harness import completion, config_file, fake_instances, wait_http

PORTS = {"decode": 18560, "prefill": 18561, "router": 18562}
SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"),
            "gauge": ("",), "summary": ("", "_sum", "_count", "_created")}

# vLLM's stats logger builds the connector's metrics through KVConnectorProm, with
# prometheus_client's classes and the default registry, as an API server does.
CONNECTOR_METRICS = """
from prometheus_client import REGISTRY, generate_latest
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorProm
from kvpush.common.instance_auth import refused_counter
from kvpush.deploy.plan.vllm_launch import KVPUSH_CONNECTOR_CLASS, KVPUSH_CONNECTOR_MODULE

class Config:
    kv_transfer_config = KVTransferConfig(kv_connector=KVPUSH_CONNECTOR_CLASS, kv_connector_module_path=KVPUSH_CONNECTOR_MODULE,
                                          kv_role="kv_both")

prom = KVConnectorProm(Config(), ["model_name", "engine"], {0: ["tiny", "0"]})
prom.per_engine_stat_loggers = {}
prom.observe({"sends_ok": 2, "recvs_ok": 1, "send_bytes": [4096.0], "recv_bytes": [4096.0], "write_s": [0.002],
              "prefill_end_to_done_s": [0.003], "registration_wait_s": [0.001], "layer_wait_s": [0.0005],
              "dropped": {"expired": 1}})
refused_counter().labels("no_key").inc()
print(generate_latest(REGISTRY).decode())
"""


def exposed_names(text: str) -> set[str]:
    """Every sample name the text exposes, and every name a family declared in it can expose (a
    labelled counter with no child yet has HELP and TYPE lines but no sample)."""
    names = set()
    for family in text_string_to_metric_families(text):
        names |= {sample.name for sample in family.samples}
        names |= {family.name + suffix for suffix in SUFFIXES.get(family.type, ("",))}
    return names


@pytest.fixture(scope="module")
def router_metrics(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("router")
    with fake_instances(PORTS):
        proc = subprocess.Popen([sys.executable, "-m", "kvpush.router", "--config", str(config_file(tmp_path, PORTS))],
                                stderr=subprocess.PIPE)
        try:
            assert wait_http(f"http://127.0.0.1:{PORTS['router']}/health", proc) == 200
            for prompt in ("hello", "the cache block moves"):
                completion(PORTS["router"], prompt)
            with urllib.request.urlopen(f"http://127.0.0.1:{PORTS['router']}/metrics", timeout=10) as r:
                yield r.read().decode()
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=15)


@pytest.fixture(scope="module")
def connector_metrics():
    return subprocess.run([sys.executable, "-c", CONNECTOR_METRICS], capture_output=True, text=True, timeout=300,
                          check=True).stdout


def test_every_router_metric_of_the_dashboard_is_exposed_by_a_router_process(router_metrics):
    wanted = {n for n in metric_names() if n.startswith("kvpush_router_")}
    exposed = exposed_names(router_metrics)
    assert wanted and not wanted - exposed, f"not exposed: {sorted(wanted - exposed)}"
    assert any(s.name == "kvpush_router_requests_total" and s.value >= 2
               for f in text_string_to_metric_families(router_metrics) for s in f.samples)


def test_every_connector_metric_of_the_dashboard_is_exposed_through_vllms_hook(connector_metrics):
    wanted = {n for n in metric_names() if n.startswith("vllm:kvpush_")}
    exposed = exposed_names(connector_metrics)
    assert wanted and not wanted - exposed, f"not exposed: {sorted(wanted - exposed)}"
    samples = {(s.name, s.labels.get("engine")): s.value for f in text_string_to_metric_families(connector_metrics)
               for s in f.samples}
    assert samples[("vllm:kvpush_pushes_sent_total", "0")] == 2  # observed values arrive, per engine


def test_monitor_writes_valid_yaml_targeting_the_planned_processes(tmp_path, state_dir):
    from cli_in_process import run_cli
    from kvpush.deploy.plan.plan import build_plan
    from kvpush.deploy.topology.topology import parse_topology
    from kvpush.templates import template_text

    (tmp_path / "t.yaml").write_text(template_text("local-cpu"))
    result = run_cli("monitor", str(tmp_path / "t.yaml"), "--out", str(tmp_path / "m"))
    assert result.returncode == 0, result.stderr
    config = yaml.safe_load((tmp_path / "m" / "prometheus.yml").read_text())
    targets = {t for job in config["scrape_configs"] for c in job["static_configs"] for t in c["targets"]}
    plan = build_plan(parse_topology(template_text("local-cpu")))
    assert targets == {p.base_url.removeprefix("http://") for p in plan.processes()}
