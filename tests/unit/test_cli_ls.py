"""`kvpush ls`, and `down`/`status`/`logs` naming the recorded deployments when theirs has no state."""
from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from cli_in_process import run_cli
from kvpush.cli import ls_cmd
from kvpush.cli.main import app
from kvpush.deploy.lifecycle.observe import ProcessStatus
from kvpush.deploy.lifecycle.state import DeploymentState, HostRecord, ProcessRecord, save_state, state_path


def _record(name: str, role: str, host: str, port: int) -> ProcessRecord:
    return ProcessRecord(name, role, host, 4242, 4242, None, port, f"http://127.0.0.1:{port}/health", f"/w/{name}.log", "", 0.0)


def _save(deployment: str, router_host: str = "local") -> DeploymentState:
    state = DeploymentState(deployment, hosts={
        "local": HostRecord(address="127.0.0.1", workdir="/w"),
        "gpu-1": HostRecord(address="10.0.0.7", user="ubuntu", workdir="/w")})
    for record in (_record(f"{deployment}-prefill-0", "prefill", "gpu-1", 8100),
                   _record(f"{deployment}-decode-0", "decode", "gpu-1", 8200),
                   _record("router", "router", router_host, 8000)):
        state.processes[record.name] = record
    save_state(state)
    return state


def _row(name: str, process: str = "running", health: str = "ok") -> ProcessStatus:
    return ProcessStatus(name, "decode", "gpu-1", 1, process, health, 0, 0, 0.0, 1.0, 0)


@pytest.fixture
def two_deployments(state_dir, monkeypatch):
    _save("alpha")
    _save("beta", router_host="gpu-1")

    def status(state, ssh, keys):
        return [_row(n, "dead", "-") if n == "beta-decode-0" else _row(n) for n in state.processes]

    monkeypatch.setattr(ls_cmd, "deployment_status", status)


def test_ls_lists_every_deployment_with_hosts_processes_and_router(two_deployments):
    result = CliRunner().invoke(app, ["ls"])
    assert result.exit_code == 0, result.output
    text = result.stdout
    for expected in ("alpha", "beta", "3/3 up", "2/3 up; down: beta-decode-0 (dead)", "gpu-1 (ubuntu@10.0.0.7)",
                     "http://127.0.0.1:8000", "http://10.0.0.7:8000"):
        assert expected in text, text


def test_ls_json_gives_the_router_url_clients_use_and_each_process(two_deployments):
    result = CliRunner().invoke(app, ["ls", "--json"])
    assert result.exit_code == 0, result.output
    alpha, beta = json.loads(result.stdout)["deployments"]
    assert (alpha["deployment"], alpha["up"], alpha["down"], alpha["router"]) == ("alpha", 3, 0, "http://127.0.0.1:8000")
    # a router on a remote host is reached at that host's address, not the loopback it reports itself on
    assert beta["router"] == "http://10.0.0.7:8000" and (beta["up"], beta["down"]) == (2, 1)
    assert beta["hosts"] == {"local": "127.0.0.1", "gpu-1": "ubuntu@10.0.0.7"}
    assert [(p["name"], p["healthy"]) for p in beta["processes"]] == [
        ("beta-prefill-0", True), ("beta-decode-0", False), ("router", True)]


def test_ls_no_check_contacts_no_host(state_dir, monkeypatch):
    _save("alpha")
    monkeypatch.setattr(ls_cmd, "deployment_status", lambda *a: pytest.fail("--no-check contacted a host"))
    result = CliRunner().invoke(app, ["ls", "--no-check", "--json"])
    (alpha,) = json.loads(result.stdout)["deployments"]
    assert alpha["checked"] is False and alpha["up"] is None
    assert [p["name"] for p in alpha["processes"]] == ["alpha-prefill-0", "alpha-decode-0", "router"]
    assert "3 recorded (not checked)" in CliRunner().invoke(app, ["ls", "--no-check"]).stdout


def test_ls_shows_an_unreadable_state_among_the_others(state_dir, monkeypatch):
    _save("alpha")
    state_path("broken").write_text("[]")
    monkeypatch.setattr(ls_cmd, "deployment_status", lambda state, ssh, keys: [_row(n) for n in state.processes])
    result = CliRunner().invoke(app, ["ls", "--json"])
    assert result.exit_code == 0, result.output
    alpha, broken = json.loads(result.stdout)["deployments"]
    assert alpha["up"] == 3 and "not a kvpush deployment state" in broken["error"]


def test_ls_with_nothing_recorded_says_so(state_dir):
    result = CliRunner().invoke(app, ["ls"])
    assert result.exit_code == 0 and "no deployments recorded on this machine" in result.stdout
    assert json.loads(CliRunner().invoke(app, ["ls", "--json"]).stdout) == {"deployments": []}


def test_down_of_nothing_exits_0_and_names_the_recorded_deployments(state_dir, tmp_path):
    _save("alpha")
    _save("beta")
    result = run_cli("down", cwd=tmp_path)  # no topology: the built-in local-cpu, which has no state
    assert result.returncode == 0, result.stderr
    assert "local-cpu: nothing running (no state recorded)" in result.stdout
    assert "local-cpu: recorded on this machine: alpha, beta" in result.stdout


@pytest.mark.parametrize("command", [["status"], ["status", "--json"], ["logs"]])
def test_status_and_logs_without_state_name_the_recorded_deployments(state_dir, tmp_path, command):
    _save("alpha")
    result = run_cli(*command, cwd=tmp_path)
    assert result.returncode == 1
    message = json.loads(result.stdout)["error"] if "--json" in command else result.stderr
    assert "deployment local-cpu is not running (no state recorded)" in message
    assert "recorded on this machine: alpha (choose one with -d NAME" in message


def test_without_any_state_the_hint_is_the_plain_one(state_dir, tmp_path):
    result = run_cli("status", cwd=tmp_path)
    assert result.returncode == 1 and "recorded on this machine" not in result.stderr
    assert "start it with `kvpush up`" in result.stderr


def test_ls_counts_a_deployment_with_nothing_running_as_0_of_0(state_dir, monkeypatch):
    save_state(DeploymentState("empty", hosts={"local": HostRecord(address="127.0.0.1", workdir="/w")}))
    monkeypatch.setattr(ls_cmd, "deployment_status", lambda *a: pytest.fail("no process to look at"))
    (empty,) = json.loads(CliRunner().invoke(app, ["ls", "--json"]).stdout)["deployments"]
    assert (empty["checked"], empty["up"], empty["down"], empty["router"]) == (True, 0, 0, None)
    assert "0/0 up" in CliRunner().invoke(app, ["ls"]).stdout
