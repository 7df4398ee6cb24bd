"""`kvpush exec`: which host a name means, and the shell text that runs the command there."""
from __future__ import annotations

import subprocess

import pytest

from kvpush.common.errors import UsageError
from kvpush.deploy.lifecycle.hosts_exec import ExecTarget, exec_command, exec_target
from kvpush.deploy.lifecycle.state import DeploymentState, HostRecord, ProcessRecord
from kvpush.deploy.plan.plan import build_plan
from kvpush.deploy.topology.topology import resolve_topology


def _plan():
    return build_plan(resolve_topology(None)[0])  # the built-in local-cpu: host `local`, prefill-0, decode-0, router


def test_a_host_name_means_its_workdir_and_a_process_name_its_host_cwd_and_plan_env():
    plan = _plan()
    host = exec_target("local", "local-cpu", None, plan)
    assert (host.host, host.cwd, host.env, host.process) == ("local", plan.host("local").workdir, {}, None)
    decode = exec_target("decode-0", "local-cpu", None, plan)
    planned = plan.process("decode-0")
    assert (decode.host, decode.cwd, decode.process) == (planned.host, planned.cwd, "decode-0")
    assert decode.env == {**planned.env, "KVPUSH_PROCESS": "decode-0"}


def test_recorded_hosts_win_and_a_recorded_process_without_a_plan_gets_its_host_workdir():
    record = HostRecord(address="10.0.0.5", workdir="/srv/kv", slurm={"job_id": "7", "node": "n1"})
    process = ProcessRecord("decode-0", "decode", "gpu", 1, 1, None, 8100, "http://10.0.0.5:8100/health",
                            "/srv/kv/logs/decode-0.log", "d", 0.0)
    state = DeploymentState("x", hosts={"gpu": record}, processes={"decode-0": process})
    target = exec_target("decode-0", "x", state, None)
    assert (target.host, target.record.slurm["job_id"], target.cwd, target.env) == ("gpu", "7", "/srv/kv",
                                                                                   {"KVPUSH_PROCESS": "decode-0"})
    with pytest.raises(UsageError, match=r"'nope' is neither a host nor a process of deployment x; choose one of gpu, decode-0"):
        exec_target("nope", "x", state, None)


def _run(text: str, tmp_path) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", text], capture_output=True, text=True, cwd=tmp_path, timeout=30)


def test_one_word_is_a_shell_line_several_words_pass_as_they_are(tmp_path):
    workdir = tmp_path / "work dir"
    workdir.mkdir()
    target = ExecTarget("h", HostRecord(address="127.0.0.1", workdir=str(workdir)), str(workdir), {"A": "x y", "B": "$HOME"})
    shell = _run(exec_command(target, ['echo "$A" | tr " " _; pwd; exit 4']), tmp_path)
    assert (shell.returncode, shell.stdout) == (4, f"x_y\n{workdir}\n")
    words = _run(exec_command(target, ["printf", "%s|", "a b", "$B", ";"]), tmp_path)
    assert words.stdout == "a b|$B|;|"  # the variable's value arrives literally, each word whole
    missing = ExecTarget("h", target.record, str(tmp_path / "not-made-yet"))
    assert _run(exec_command(missing, ["pwd"]), tmp_path).stdout == f"{tmp_path}\n"  # stays where the shell starts
    with pytest.raises(UsageError, match="no command given; put it after `--`"):
        exec_command(target, [])
