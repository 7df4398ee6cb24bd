"""The router's URL as clients here reach it, and the warning for a remote router bound to loopback."""
from __future__ import annotations

import pytest
from kvpush.deploy.plan.plan import build_plan
from kvpush.deploy.plan.router_address import client_router_url, loopback_bind_warning
from kvpush.deploy.topology.host_address import HostAddress
from kvpush.deploy.topology.topology import parse_topology
from kvpush.templates import template_text

REMOTE = HostAddress(address="10.0.1.1", user="ubuntu")
LOCAL = HostAddress(address="127.0.0.1")


@pytest.mark.parametrize("host, router_url, expected", [
    (LOCAL, "http://127.0.0.1:8000", "http://127.0.0.1:8000"),  # this machine: as its own host reaches it
    (REMOTE, "http://127.0.0.1:8000", "http://10.0.1.1:8000"),  # wildcard (or loopback) bind: the host's address
    (REMOTE, "http://10.0.1.9:8000", "http://10.0.1.9:8000"),  # bound to one address: that one
    (HostAddress(address="fd00::7"), "http://[::1]:8000", "http://[fd00::7]:8000"),
])
def test_client_url(host, router_url, expected):
    assert client_router_url(host, router_url) == expected


def test_loopback_bind_on_a_remote_host_warns_naming_the_field_and_the_fix():
    warning = loopback_bind_warning("gpu-1", REMOTE, "127.0.0.1", 8000)
    assert warning is not None and "\n" not in warning
    assert warning.startswith("router.bind: 127.0.0.1 on host 'gpu-1'")
    assert "set router.bind to 0.0.0.0" in warning and "kvpush tunnel" in warning
    assert loopback_bind_warning("gpu-1", REMOTE, "0.0.0.0", 8000) is None
    assert loopback_bind_warning("gpu-1", REMOTE, "10.0.1.1", 8000) is None
    assert loopback_bind_warning("local", LOCAL, "127.0.0.1", 8000) is None
    # a test host on a loopback address of this machine, its router bound to that address: reachable here
    assert loopback_bind_warning("h1", HostAddress(address="127.0.0.3", ssh_port=2222), "127.0.0.3", 8000) is None


def test_xpyd_template_plans_the_router_hosts_address_and_no_warning():
    plan = build_plan(parse_topology(template_text("xpyd")))
    assert plan.router_client_url == "http://10.0.1.1:8000" == plan.router_url_from_here()
    assert plan.warnings == []
    assert plan.to_dict()["router_client_url"] == "http://10.0.1.1:8000"


def test_a_remote_router_on_the_default_loopback_bind_plans_with_a_warning():
    text = template_text("xpyd").replace("  bind: 0.0.0.0\n", "")
    plan = build_plan(parse_topology(text))
    assert plan.router_client_url == "http://10.0.1.1:8000"
    assert len(plan.warnings) == 1 and plan.warnings[0].startswith("router.bind: 127.0.0.1 on host 'gpu-1' (10.0.1.1)")


def test_the_built_in_local_topology_keeps_loopback():
    plan = build_plan(parse_topology(template_text("local-cpu")))
    assert plan.router_client_url == plan.router_url == "http://127.0.0.1:8000" and plan.warnings == []


def test_plan_prints_the_client_url_and_the_warning_on_stderr(tmp_path):
    from cli_in_process import run_cli

    path = tmp_path / "x.yaml"
    path.write_text(template_text("xpyd").replace("  bind: 0.0.0.0\n", ""))
    result = run_cli("plan", str(path))
    assert result.returncode == 0, result.stderr
    assert "router http://10.0.1.1:8000" in result.stdout.splitlines()[0]
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "router.bind: 127.0.0.1 on host 'gpu-1'" in warnings[0]


def test_status_gives_the_router_url_clients_here_use(monkeypatch):
    import json

    from kvpush.cli import lifecycle_cmd
    from kvpush.cli.main import app
    from kvpush.deploy.lifecycle.state import DeploymentState, HostRecord, ProcessRecord
    from typer.testing import CliRunner

    state = DeploymentState("t", hosts={"gpu-1": HostRecord(address="10.0.1.1", user="ubuntu", workdir="/w")})
    state.processes["router"] = ProcessRecord("router", "router", "gpu-1", 1, 1, None, 8000,
                                              "http://127.0.0.1:8000/health", "/w/router.log", "", 0.0)
    monkeypatch.setattr(lifecycle_cmd, "require_state", lambda name: state)
    monkeypatch.setattr(lifecycle_cmd, "deployment_status", lambda state, ssh, keys=None: [])
    result = CliRunner().invoke(app, ["status", "-d", "t", "--json"])
    assert json.loads(result.stdout)["router"] == "http://10.0.1.1:8000"
    result = CliRunner().invoke(app, ["status", "-d", "t"])
    assert "router: http://10.0.1.1:8000" in result.stdout
