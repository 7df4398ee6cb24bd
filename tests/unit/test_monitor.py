"""`kvpush monitor`'s scrape config and dashboard, from the plan (what /metrics really exposes is
tests/integration/test_monitor_metrics.py's)."""
from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import yaml
from cli_in_process import run_cli
from kvpush.deploy.lifecycle.secrets import AccessKeys, ensure_local_secret
from kvpush.deploy.plan.dashboard import dashboard, metric_names
from kvpush.deploy.plan.monitor_config import scrape_config, scrape_targets
from kvpush.deploy.plan.plan import build_plan
from kvpush.deploy.topology.topology import parse_topology
from kvpush.templates import template_text


def _jobs(config: dict) -> dict:
    return {job["job_name"]: job for job in config["scrape_configs"]}


def test_xpyd_targets_the_router_as_clients_reach_it_and_every_instance():
    topo = parse_topology(template_text("xpyd"))
    targets = scrape_targets(topo, build_plan(topo))
    assert [(t.process, t.address, t.key) for t in targets] == [
        ("router", "10.0.1.1:8000", "router-client"),  # the router takes a client key and /metrics is not public
        ("prefill-0", "10.0.1.1:8100", None), ("prefill-1", "10.0.1.2:8101", None),
        ("decode-0", "10.0.1.3:8200", None), ("decode-1", "10.0.1.4:8201", None)]
    config = scrape_config("xpyd", targets, {"router-client": "/m/router-client.key"})
    jobs = _jobs(config)
    router = jobs["kvpush-xpyd-router"]
    assert router["authorization"] == {"type": "Bearer", "credentials_file": "/m/router-client.key"}
    assert router["honor_labels"] is True
    assert "authorization" not in jobs["kvpush-xpyd-instances"]  # instance /metrics is open by default
    labels = [c["labels"] for c in jobs["kvpush-xpyd-instances"]["static_configs"]]
    assert labels[0] == {"deployment": "xpyd", "process": "prefill-0", "role": "prefill"}


def test_instance_metrics_closed_to_strangers_are_scraped_with_the_instance_key():
    topo = parse_topology(template_text("local-cpu") + "instance_public_paths: [/health]\n")
    targets = scrape_targets(topo, build_plan(topo))
    assert [(t.process, t.key) for t in targets] == [("router", None), ("prefill-0", "instance"), ("decode-0", "instance")]


def test_every_dashboard_query_names_a_kvpush_metric_and_filters_on_the_deployment():
    model = dashboard("xpyd")
    exprs = [t["expr"] for p in model["panels"] if p["type"] == "timeseries" for t in p["targets"]]
    assert exprs and all('deployment=~"$deployment"' in e for e in exprs)
    names = metric_names()
    assert any(n.startswith("kvpush_router_") for n in names) and any(n.startswith("vllm:kvpush_") for n in names)
    ids = [p["id"] for p in model["panels"]]
    assert len(ids) == len(set(ids))
    json.dumps(model)  # serialisable as is


def test_monitor_writes_config_dashboard_and_the_keys_it_names(state_dir, tmp_path, monkeypatch):
    topo_text = template_text("xpyd").replace("name: xpyd", "name: mon") + "instance_public_paths: [/health]\n"
    (tmp_path / "t.yaml").write_text(topo_text)
    monkeypatch.setenv("KVPUSH_API_KEY", "client-key-1")
    secret, _ = ensure_local_secret("mon")  # what `up` keeps on this machine
    result = run_cli("monitor", str(tmp_path / "t.yaml"), "--out", str(tmp_path / "m"))
    assert result.returncode == 0, result.stderr
    config = yaml.safe_load((tmp_path / "m" / "prometheus.yml").read_text())
    jobs = _jobs(config)
    router_key = jobs["kvpush-mon-router"]["authorization"]["credentials_file"]
    instance_key = jobs["kvpush-mon-instances"]["authorization"]["credentials_file"]
    assert Path(router_key).read_text().strip() == "client-key-1"
    assert Path(instance_key).read_text().strip() == AccessKeys.of(secret, None).instance
    for path in (router_key, instance_key):
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert "client-key-1" not in (tmp_path / "m" / "prometheus.yml").read_text()
    assert json.loads((tmp_path / "m" / "grafana-dashboard.json").read_text())["title"] == "kvpush mon"
    assert "10.0.1.1:8000" in result.stdout


def test_monitor_without_a_kept_secret_says_to_run_up_first(state_dir, tmp_path):
    (tmp_path / "t.yaml").write_text(template_text("local-cpu") + "instance_public_paths: [/health]\n")
    result = run_cli("monitor", str(tmp_path / "t.yaml"), "--out", str(tmp_path / "m"))
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 1 and len(errors) == 1 and "run `kvpush up` first" in errors[0], result.stderr


def test_router_url_replaces_the_router_target_and_bad_ones_are_one_line(state_dir, tmp_path):
    (tmp_path / "t.yaml").write_text(template_text("xpyd").replace("  api_key_env: KVPUSH_API_KEY", ""))
    result = run_cli("monitor", str(tmp_path / "t.yaml"), "--out", str(tmp_path / "m"), "--router-url", "http://127.0.0.1:18000")
    assert result.returncode == 0, result.stderr
    config = yaml.safe_load((tmp_path / "m" / "prometheus.yml").read_text())
    assert _jobs(config)["kvpush-xpyd-router"]["static_configs"][0]["targets"] == ["127.0.0.1:18000"]
    bad = run_cli("monitor", str(tmp_path / "t.yaml"), "--out", str(tmp_path / "m"), "--router-url", "127.0.0.1:18000")
    errors = [line for line in bad.stderr.splitlines() if line.startswith("error:")]
    assert bad.returncode == 2 and len(errors) == 1 and errors[0].startswith("error: --router-url:"), bad.stderr
