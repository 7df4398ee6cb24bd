"""`kvpush up | down | status | logs` as a user runs them, against a state directory of the test's own."""
from __future__ import annotations

import json
import os
import subprocess

import pytest
from typer.testing import CliRunner

from cli_in_process import run_cli
from kvpush.cli import lifecycle_cmd
from kvpush.cli.main import app
from kvpush.deploy.lifecycle.observe import ProcessStatus
from kvpush.deploy.lifecycle.state import DeploymentState, HostRecord, ProcessRecord, save_state


def kvpush(*args: str, state_dir, cwd=None) -> subprocess.CompletedProcess:
    return run_cli(*args, cwd=cwd, env={**os.environ, "KVPUSH_STATE_DIR": str(state_dir)})


def test_deployment_name_cannot_leave_the_state_directory(tmp_path):
    victim = tmp_path / "victimdir" / "important.json"
    victim.parent.mkdir()
    victim.write_text("{}")
    result = kvpush("down", "-d", "../victimdir/important", state_dir=tmp_path / "state")
    assert result.returncode == 2, result.stderr
    assert "--deployment: '../victimdir/important' is not a deployment name" in result.stderr
    assert victim.exists()


def test_status_interval_must_be_positive(tmp_path):
    result = kvpush("status", "-d", "t", "--watch", "--interval", "-1", state_dir=tmp_path)
    assert result.returncode == 2 and "--interval: must be more than 0 seconds (got -1)" in result.stderr


@pytest.mark.parametrize("watch", [[], ["--watch"]], ids=["once", "watch"])
def test_status_json_of_a_stopped_deployment_is_still_json(tmp_path, watch):
    result = kvpush("status", "-d", "t", "--json", *watch, state_dir=tmp_path)
    assert result.returncode == 1
    document = json.loads(result.stdout)
    assert document["deployment"] == "t" and document["healthy"] is False and "not running" in document["error"]


def test_status_watch_json_prints_one_document_per_refresh(monkeypatch):
    row = ProcessStatus("decode-0", "decode", "local", 42, "running", "ok", 0, 0, 0.1, 5.0, 0)
    monkeypatch.setattr(lifecycle_cmd, "require_state", lambda name: DeploymentState(name))
    monkeypatch.setattr(lifecycle_cmd, "deployment_status", lambda state, ssh, keys: [row])
    sleeps = []

    def sleep(seconds):
        sleeps.append(seconds)
        if len(sleeps) == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(lifecycle_cmd.time, "sleep", sleep)
    result = CliRunner().invoke(app, ["status", "-d", "t", "--watch", "--json", "--interval", "0.5"])
    documents = [json.loads(line) for line in result.stdout.splitlines()]
    assert sleeps == [0.5, 0.5] and len(documents) == 2
    assert documents[0]["healthy"] is True and documents[0]["processes"][0]["name"] == "decode-0"


def test_logs_print_bracketed_lines_as_written(tmp_path, monkeypatch):
    log = tmp_path / "prefill-0.log"
    lines = ["INFO 05-01 [api_utils.py:347] Started server", "WARNING cannot open [/tmp] [bold]x"]
    log.write_text("\n".join(lines) + "\n")
    state = DeploymentState("t", hosts={"local": HostRecord(address="127.0.0.1", workdir=str(tmp_path))})
    state.processes["prefill-0"] = ProcessRecord("prefill-0", "prefill", "local", 1, 1, None, 8100,
                                                 "http://127.0.0.1:8100/health", str(log), "", 0.0)
    monkeypatch.setenv("KVPUSH_STATE_DIR", str(tmp_path / "state"))
    save_state(state)
    result = kvpush("logs", "-d", "t", state_dir=tmp_path / "state")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [f"prefill-0 | {line}" for line in lines]


def test_status_into_a_pipe_prints_every_name_and_value_whole(monkeypatch):
    """Captured output has no terminal width: nothing may be cut to fit one (rich would shorten
    a name to `pre…` to fit a width it guessed)."""
    name = "prefill-with-a-long-descriptive-name-0"
    rows = [ProcessStatus(name, "prefill", "gpu-host-with-a-long-name", 4242, "dead", "-", None, None, None, None, 2,
                          "died at 10:00:00 (pid 4242: killed by SIGKILL); left behind: pid 4250 (VLLM::EngineCor) holding port 5600",
                          supervisor_pid=4240, last_exit="killed by SIGKILL"),
            ProcessStatus("decode-0", "decode", "gpu-host-with-a-long-name", 4300, "running", "ok", 3, 1, 0.25, 61.0, 0)]
    monkeypatch.setattr(lifecycle_cmd, "require_state", lambda name: DeploymentState(name))
    monkeypatch.setattr(lifecycle_cmd, "deployment_status", lambda state, ssh, keys=None: rows)
    result = CliRunner().invoke(app, ["status", "-d", "t"])
    assert result.exit_code == 1
    table = result.stdout
    assert "…" not in table and name in table and "gpu-host-with-a-long-name" in table and "running" in table
    assert f"{name}: died at 10:00:00 (pid 4242: killed by SIGKILL); left behind: pid 4250 (VLLM::EngineCor) holding port 5600" in result.stderr



def test_down_removes_the_secret_files_on_the_hosts_and_keeps_this_machine_s_secret_unless_asked(tmp_path, monkeypatch):
    from kvpush.deploy.topology.placement import secret_paths_in
    from kvpush.deploy.lifecycle.secrets import ensure_local_secret, local_secret_path

    monkeypatch.setenv("KVPUSH_STATE_DIR", str(tmp_path / "state"))
    workdir = tmp_path / "w" / "t"
    workdir.mkdir(parents=True)
    (workdir / "router.json").write_text("{}")
    for path in secret_paths_in(str(workdir)):
        open(path, "w").write("x\n")
    ensure_local_secret("t")
    save_state(DeploymentState("t", hosts={"local": HostRecord(address="127.0.0.1", workdir=str(workdir))}))

    help_text = kvpush("down", "--help", state_dir=tmp_path / "state").stdout
    assert "secret" in help_text and "--forget-secret" in help_text
    result = kvpush("down", "-d", "t", state_dir=tmp_path / "state")
    assert result.returncode == 0, result.stderr
    assert "t: removed its secret files on local" in result.stdout
    assert sorted(p.name for p in workdir.iterdir()) == ["router.json"] and local_secret_path("t").exists()

    save_state(DeploymentState("t", hosts={"local": HostRecord(address="127.0.0.1", workdir=str(workdir))}))
    result = kvpush("down", "-d", "t", "--forget-secret", state_dir=tmp_path / "state")
    assert result.returncode == 0 and "deleted the deployment secret kept on this machine" in result.stdout, result.stderr
    assert "removed its secret files" not in result.stdout and not local_secret_path("t").exists()


def test_status_watch_into_a_pipe_prints_a_json_line_each_refresh_while_it_runs(tmp_path, monkeypatch):
    """`kvpush status --watch | tee`: each refresh reaches the pipe when it is made, not at Ctrl-C."""
    import sys

    monkeypatch.setenv("KVPUSH_STATE_DIR", str(tmp_path / "state"))
    state = DeploymentState("t", hosts={"local": HostRecord(address="127.0.0.1", workdir=str(tmp_path))})
    state.processes["decode-0"] = ProcessRecord("decode-0", "decode", "local", 2**22 + 1, 2**22 + 1, None, 8200,
                                                "http://127.0.0.1:8200/health", str(tmp_path / "d.log"), "", 0.0)
    save_state(state)
    watcher = subprocess.Popen([sys.executable, "-m", "kvpush.cli.main", "status", "-d", "t", "--watch", "--interval", "0.2"],
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        documents = [json.loads(watcher.stdout.readline()) for _ in range(2)]
        assert watcher.poll() is None  # still watching: the lines came through the pipe as they were printed
    finally:
        watcher.terminate()
        watcher.wait(timeout=30)
    assert [d["processes"][0]["process"] for d in documents] == ["dead", "dead"]
    assert all(d["deployment"] == "t" and d["healthy"] is False for d in documents)
