"""up / status / logs / down / doctor on a real two-node Slurm cluster, with light stand-in processes.

Every process is a job step; the cluster (munged, slurmctld, slurmd n1 and n2) is the module's own,
started under a temporary directory and stopped after (tests/slurm_cluster.py).
"""
from __future__ import annotations

import json
import os
import subprocess

import psutil
import pytest

from kvpush.deploy.lifecycle.lifecycle import down, up
from kvpush.deploy.lifecycle.observe import deployment_status, require_state
from kvpush.deploy.runners import SshOptions
from kvpush.deploy.runners.slurm_cli import SlurmClient
from kvpush.deploy.lifecycle.state import load_state
from kvpush.deploy.lifecycle.lifecycle import LifecycleOptions
from lifecycle_helpers import RecordingEvents, kill_leftovers, run_cli, wait_for
from slurm_cluster import slurm_topology_for
from sshd_hosts import write_standin_python

PORTS = iter(range(26400, 26600, 10))  # each test its own block of 10 ports
OPTIONS = LifecycleOptions(ssh=SshOptions(), ready_timeout_s=60, stop_timeout_s=5, provision=False, doctor=False)


@pytest.fixture
def deploy(slurm_cluster, tmp_path, state_dir):
    """Factory for a stand-in topology on the cluster; afterwards: down, no job, no process left."""
    python = str(write_standin_python(tmp_path / "standin-python"))
    made = []

    def make(name="s", **kw):
        topo = slurm_topology_for(slurm_cluster, name, python, tmp_path, port_base=next(PORTS), **kw)
        made.append(topo.name)
        return topo

    yield make
    for name in set(made):
        down(name, OPTIONS)
    left = kill_leftovers(python)
    jobs = slurm_cluster.command("squeue", "-h", "-o", "%i %j").stdout.strip()
    slurm_cluster.command("scancel", "--user", "root", check=False)
    assert not left, f"processes left behind: {[p.pid for p in left]}"
    assert not jobs, f"jobs left queued: {jobs}"



def _steps(cluster) -> dict[str, str]:
    out = cluster.command("squeue", "-h", "-s", "-o", "%i|%j|%N").stdout
    return {name: f"{step}@{node}" for step, name, node in (ln.split("|") for ln in out.split()) if not step.endswith("batch")}


def test_up_launches_every_process_as_a_job_step_and_down_cancels_the_job(deploy, slurm_cluster, capsys):
    topo = deploy()
    events = RecordingEvents()
    result = up(topo, OPTIONS, events)
    assert sorted(result.ready_s) == ["decode-0", "prefill-0", "router"], events.notes
    assert result.proof.external_kv_tokens > 0
    state = load_state("s")
    job = state.slurm_submitted_job
    assert job and any(f"submitted job {job}" in n for n in events.notes)
    steps = _steps(slurm_cluster)
    assert {n: s.split("@")[1] for n, s in steps.items()} == {"prefill-0": "n1", "decode-0": "n2", "router": "n2"}
    assert {r.name: r.pid for r in state.processes.values()} == {n: int(s.split("@")[0].split(".")[1]) for n, s in steps.items()}

    rows = deployment_status(require_state("s"), SshOptions())
    assert [(r.name, r.host, r.process, r.health) for r in rows] == [
        ("prefill-0", "n1", "running", "ok"), ("decode-0", "n2", "running", "ok"), ("router", "n2", "running", "ok")]

    code, out, _ = run_cli(["logs", "prefill", "-d", "s", "-n", "5"], capsys)
    assert code == 0 and out.startswith("prefill-0 | ") and "GET /health" in out

    from kvpush.deploy.lifecycle.hosts import connected

    with connected(state.hosts, SshOptions()) as (runners, _):
        members = runners["n1"].group_members([state.processes["prefill-0"].pgid])[state.processes["prefill-0"].pgid]
    commands = [" ".join(psutil.Process(m.pid).cmdline()) for m in members]
    assert any("vllm.entrypoints.openai.api_server" in c and "--port" in c for c in commands), commands

    again = up(topo, OPTIONS)
    assert again.changes.nothing_to_do  # same job, steps still running: nothing to launch

    from kvpush.deploy.plan.plan import build_plan

    secret_files = sorted(os.path.expanduser(f.path) for h in build_plan(topo).hosts for f in h.secret_files)
    assert all(os.path.exists(p) for p in secret_files) and len(secret_files) == 5
    stopped = down("s", OPTIONS)
    assert stopped.complete and sorted(stopped.stopped) == ["decode-0", "prefill-0", "router"]
    assert stopped.notes == [f"cancelled Slurm job {job}"]
    assert sorted(p for paths in stopped.secrets_removed.values() for p in paths) == secret_files  # removed through steps
    assert not any(os.path.exists(p) for p in secret_files)
    assert slurm_cluster.command("squeue", "-h").stdout.strip() == ""


def test_a_killed_step_is_reported_and_up_relaunches_only_it(deploy, slurm_cluster, capsys):
    topo = deploy()
    up(topo, OPTIONS)
    before = load_state("s")
    prefill = before.processes["prefill-0"]
    slurm_cluster.command("scancel", "--signal=KILL", f"{before.slurm_submitted_job}.{prefill.pid}")
    wait_for("the killed step prefill-0 to leave squeue", lambda: "prefill-0" not in _steps(slurm_cluster), 20,
             lambda: f"steps: {_steps(slurm_cluster)}")
    code, out, _ = run_cli(["status", "-d", "s", "--json"], capsys)
    document = json.loads(out)
    assert code == 1 and not document["healthy"]
    assert {p["name"]: p["process"] for p in document["processes"]} == {"prefill-0": "dead", "decode-0": "running", "router": "running"}

    result = up(topo, OPTIONS)
    assert result.changes.revive == ["prefill-0"] and sorted(result.changes.keep) == ["decode-0", "router"]
    after = load_state("s")
    assert after.processes["prefill-0"].pid != prefill.pid and after.processes["prefill-0"].restarts == 1
    assert {n: after.processes[n].pid for n in ("decode-0", "router")} == {n: before.processes[n].pid for n in ("decode-0", "router")}
    assert after.slurm_submitted_job == before.slurm_submitted_job


def test_scancel_from_outside_status_says_so_in_one_line_and_down_is_a_no_op(deploy, slurm_cluster, capsys):
    topo = deploy()
    up(topo, OPTIONS)
    job = load_state("s").slurm_submitted_job
    slurm_cluster.command("scancel", job)
    assert SlurmClient().wait_gone(job, 30)
    code, out, err = run_cli(["status", "-d", "s"], capsys)
    lines = [ln for ln in (out + err).splitlines() if ln.strip()]
    assert code == 1 and len(lines) == 1, lines
    assert f"Slurm job {job} has ended (CANCELLED)" in lines[0]
    code, out, err = run_cli(["down", "-d", "s"], capsys)
    assert code == 0 and f"Slurm job {job} has ended" in out and "stopped" not in out
    assert load_state("s") is None


def test_up_inside_an_allocation_made_with_salloc_leaves_the_allocation_to_its_owner(deploy, slurm_cluster, monkeypatch):
    allocated = slurm_cluster.command("salloc", "--no-shell", "-N2", "-J", "users-allocation", timeout=60)
    job = next(w for w in allocated.stderr.split() if w.isdigit())
    try:
        monkeypatch.setenv("SLURM_JOB_ID", job)
        topo = deploy(name="inside")
        events = RecordingEvents()
        result = up(topo, OPTIONS, events)
        assert sorted(result.ready_s) == ["decode-0", "prefill-0", "router"]
        assert any(f"deploying into job {job} (SLURM_JOB_ID)" in n for n in events.notes)
        assert load_state("inside").slurm_submitted_job is None
        assert set(_steps(slurm_cluster)) == {"prefill-0", "decode-0", "router"}
        stopped = down("inside", OPTIONS)
        assert stopped.complete and stopped.notes == []
        assert _steps(slurm_cluster) == {}
        assert SlurmClient().job(job).running  # the user's allocation is theirs to end
    finally:
        slurm_cluster.command("scancel", job, check=False)
        SlurmClient().wait_gone(job, 30)


@pytest.mark.parametrize("change, field, words", [
    ({"slurm": {"partition": "nope"}}, "slurm.partition", "invalid partition specified: nope"),
    ({"slurm": {"sbatch_options": ["--bogus-option"]}}, "slurm.sbatch_options", "unrecognized option '--bogus-option'"),
    ({"slurm": {"gpus_per_node": 2}}, "slurm.gpus_per_node", "Invalid generic resource"),
])
def test_bad_slurm_input_is_one_line_naming_the_field_exit_2_and_nothing_queued(deploy, slurm_cluster, tmp_path, capsys,
                                                                                 change, field, words):
    import yaml

    topo = deploy(extra=change)
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(topo.model_dump(mode="json", exclude_defaults=True)))
    code, out, err = run_cli(["up", str(path), "--no-provision", "--skip-doctor"], capsys)
    error = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert code == 2 and len(error) == 1, err
    assert error[0].startswith(f"error: {field}: ") and words in error[0]
    assert slurm_cluster.command("squeue", "-h").stdout.strip() == ""
    assert load_state("s") is None or load_state("s").slurm_submitted_job is None


def test_more_nodes_than_the_partition_has_names_the_hosts(deploy, slurm_cluster, tmp_path, capsys):
    import yaml

    topo = deploy()
    document = topo.model_dump(mode="json", exclude_defaults=True)
    document["hosts"]["n3"] = {"python": document["hosts"]["n1"]["python"]}  # any node: a third one
    document["decode"][0]["host"] = "n3"
    path = tmp_path / "three.yaml"
    path.write_text(yaml.safe_dump(document))
    code, out, err = run_cli(["up", str(path), "--no-provision", "--skip-doctor"], capsys)
    assert code == 2, err
    assert "error: hosts: the deployment needs 3 nodes (one per host); partition debug has 2; Slurm: " in err
    assert "Requested node configuration is not available" in err
    assert slurm_cluster.command("squeue", "-h").stdout.strip() == ""


def _script_job_output(tmp_path, job) -> str:
    path = next(tmp_path.glob(f"kvpush-*-{job}.out"), None)
    return path.read_text(errors="replace") if path else "(no job output file)"


def _submit_script(deploy, slurm_cluster, tmp_path, capsys, name, env):
    """`kvpush plan --slurm-script` for a stand-in topology whose router wants a client key from
    KVPUSH_TEST_CLIENT_KEY; the script submitted with sbatch in env. Returns (topology, script, job)."""
    import yaml

    topo = deploy(name=name, extra={"router": {"api_key_env": "KVPUSH_TEST_CLIENT_KEY"}})
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(topo.model_dump(mode="json", exclude_defaults=True)))
    code, script, err = run_cli(["plan", str(path), "--slurm-script"], capsys)
    assert code == 0 and script.startswith(f"#!/bin/bash\n#SBATCH --job-name=kvpush-{name}"), err
    (tmp_path / "job-tmp").mkdir(exist_ok=True)
    inherited = {k: v for k, v in os.environ.items() if k != "KVPUSH_TEST_CLIENT_KEY"}
    env = {**inherited, "TMPDIR": str(tmp_path / "job-tmp"), **env}  # TMPDIR: where the job keeps its private copies
    submitted = subprocess.run(["sbatch", "--parsable"], input=script, text=True, capture_output=True, check=True,
                               cwd=tmp_path, env=env)
    return topo, script, submitted.stdout.strip()


def test_plan_slurm_script_runs_the_deployment_when_submitted(deploy, slurm_cluster, tmp_path, capsys):
    import urllib.request

    from kvpush.common import deployment_secret as ds
    from kvpush.deploy.plan.plan import build_plan

    client_key = "client-key-" + os.urandom(8).hex()
    topo, script, job = _submit_script(deploy, slurm_cluster, tmp_path, capsys, "script", {"KVPUSH_TEST_CLIENT_KEY": client_key})
    assert client_key not in script and ds.FORMAT not in script  # the job makes its secrets; the script holds none
    try:
        router = f"http://{slurm_cluster.nodes[1].address}:{topo.router.port}"
        body = json.dumps({"model": "tiny", "prompt": "a b c", "max_tokens": 2}).encode()

        def answer():
            request = urllib.request.Request(router + "/v1/completions", body, {"Authorization": f"Bearer {client_key}"})
            try:
                with urllib.request.urlopen(request, timeout=5) as resp:
                    return json.loads(resp.read())["choices"][0]["text"]
            except OSError:
                return None

        text = wait_for(f"the router of job {job} to answer a completion with the client key", answer, 60,
                        lambda: f"steps {_steps(slurm_cluster)}; job output: {_script_job_output(tmp_path, job)}")
        assert text == " stand-in answer"
        assert set(_steps(slurm_cluster)) >= {"prefill-0", "decode-0", "router"}

        files = {(h.name, f.kind): f.path for h in build_plan(topo).hosts for f in h.secret_files}
        assert sorted(files) == [("n1", "deployment-secret"), ("n1", "instance-env"), ("n2", "deployment-secret"),
                                 ("n2", "instance-env"), ("n2", "router-client-key"), ("n2", "router-upstream-key")]
        for path in files.values():
            assert os.stat(path).st_mode & 0o777 == 0o600, path
        secret = ds.read_secret(files[("n1", "deployment-secret")])
        assert ds.read_secret(files[("n2", "deployment-secret")]) == secret  # one secret for the whole job
        instance_key = ds.derive_token(secret, ds.INSTANCE_API_KEY)
        assert open(files[("n1", "instance-env")]).read() == f"VLLM_API_KEY={instance_key}\n"
        assert open(files[("n2", "router-upstream-key")]).read() == f"{instance_key}\n"
        assert open(files[("n2", "router-client-key")]).read() == f"{client_key}\n"
        assert list((tmp_path / "job-tmp").iterdir()) == []  # its private copies are gone once the files are written
    finally:
        slurm_cluster.command("scancel", job, check=False)
        assert SlurmClient().wait_gone(job, 30)


def test_plan_slurm_script_without_the_client_key_fails_at_once_in_one_line(deploy, slurm_cluster, tmp_path, capsys):
    from kvpush.deploy.plan.plan import build_plan

    topo, _, job = _submit_script(deploy, slurm_cluster, tmp_path, capsys, "nokey", {})
    try:
        assert SlurmClient().wait_gone(job, 30), _script_job_output(tmp_path, job)
        lines = _script_job_output(tmp_path, job).splitlines()
        assert lines == ["kvpush: router.api_key_env: KVPUSH_TEST_CLIENT_KEY is unset or empty in the job's environment; "
                         "export it before `sbatch` (the job takes the submitter's environment)"]
        assert not any(os.path.exists(f.path) for h in build_plan(topo).hosts for f in h.secret_files)
        assert list((tmp_path / "job-tmp").iterdir()) == []
    finally:
        slurm_cluster.command("scancel", job, check=False)
        SlurmClient().wait_gone(job, 30)


def test_doctor_runs_its_checks_as_one_job_step_per_node_in_a_job_it_cancels_after(deploy, slurm_cluster, tmp_path, capsys):
    import yaml

    topo = deploy(name="checked")
    path = tmp_path / "checked.yaml"
    path.write_text(yaml.safe_dump(topo.model_dump(mode="json", exclude_defaults=True)))
    code, out, err = run_cli(["doctor", str(path), "--json", "--only", "python,packages,memlock,open-files,ports-free,reachability,transfer", "--transfer"], capsys)
    report = json.loads(out)
    assert report["hosts"] == ["n1", "n2"], err
    rows = {(r["subject"], r["check"]): r["status"] for r in report["results"]}
    assert ("n1", "probe") not in rows and ("n2", "probe") not in rows, report["results"]
    assert rows[("n1", "ports-free")] == rows[("n2", "ports-free")] == "ok"
    assert any(check == "reachability" and status == "ok" for (_, check), status in rows.items()), rows
    assert rows[("n1 -> n2", "transfer")] == "ok", report["results"]  # a real NIXL WRITE between the two nodes' steps
    assert slurm_cluster.command("squeue", "-h").stdout.strip() == ""  # the job for the checks is gone


def test_up_inside_an_sbatch_script_deploys_into_that_job(deploy, slurm_cluster, tmp_path, capsys):
    import sys
    from pathlib import Path

    import yaml

    topo = deploy(name="batch")
    path = tmp_path / "batch.yaml"
    path.write_text(yaml.safe_dump(topo.model_dump(mode="json", exclude_defaults=True)))
    kvpush = Path(sys.executable).parent / "kvpush"
    # The job lasts as long as its script: the script keeps running after `up` (sbatch passes the
    # environment on, SLURM_CONF and KVPUSH_STATE_DIR included).
    script = f"#!/bin/bash\n{kvpush} up {path} --no-provision --skip-doctor || exit 1\nexec sleep 600\n"
    job = subprocess.run(["sbatch", "--parsable", "-N2", f"--output={tmp_path / 'batch.out'}"], input=script, text=True,
                         capture_output=True, check=True).stdout.strip()
    try:
        def batch_output():
            return (tmp_path / "batch.out").read_text(errors="replace") if (tmp_path / "batch.out").exists() else "(no output yet)"

        wait_for("`kvpush up` in the batch script to record 3 processes and say ready",
                 lambda: load_state("batch") and len(load_state("batch").processes) == 3 and "ready" in batch_output(), 60,
                 lambda: f"job {job}: {batch_output()}")
        state = load_state("batch")
        assert state.slurm_submitted_job is None and {h.slurm["job_id"] for h in state.hosts.values()} == {job}
        code, out, err = run_cli(["status", "-d", "batch", "--json"], capsys)
        assert code == 0 and json.loads(out)["healthy"], out + err
        stopped = down("batch", OPTIONS)
        assert stopped.complete and sorted(stopped.stopped) == ["decode-0", "prefill-0", "router"] and stopped.notes == []
        assert _steps(slurm_cluster) == {} and SlurmClient().job(job).running  # the job is its script's
    finally:
        slurm_cluster.command("scancel", job, check=False)
        SlurmClient().wait_gone(job, 30)


def test_a_failed_up_cancels_the_job_it_submitted(deploy, slurm_cluster):
    from kvpush.common.errors import KvpushError

    topo = deploy(name="fails", instance_env={"prefill-0": {"STANDIN_EXIT": "1"}})
    events = RecordingEvents()
    with pytest.raises(KvpushError, match="process prefill-0 on host n1 exited before it became ready"):
        up(topo, OPTIONS, events)
    assert "exiting at once as STANDIN_EXIT=1 asks" in events.tails["prefill-0"]  # its log, read through a step
    assert any(n.startswith("cancelled Slurm job ") for n in events.notes), events.notes
    assert slurm_cluster.command("squeue", "-h").stdout.strip() == "" and load_state("fails") is None


def test_logs_follow_tails_each_step_through_a_step_on_its_node_and_stops_cleanly(deploy, slurm_cluster):
    import threading

    from kvpush.deploy.lifecycle.observe import stream_logs

    up(deploy(name="follow"), OPTIONS)
    state = load_state("follow")
    seen: dict[str, list[str]] = {}
    stop = threading.Event()

    def emit(name, line):
        seen.setdefault(name, []).append(line)
        if set(seen) == {"prefill-0", "decode-0", "router"}:
            stop.set()

    follower = threading.Thread(target=stream_logs, args=(state, None, 3, True, SshOptions(), emit, stop))
    follower.start()
    follower.join(60)
    assert not follower.is_alive() and set(seen) == {"prefill-0", "decode-0", "router"}, seen
    wait_for("the tails' steps to end with the follower", lambda: set(_steps(slurm_cluster)) == {"prefill-0", "decode-0", "router"},
             15, lambda: f"steps: {_steps(slurm_cluster)}")
    assert set(_steps(slurm_cluster)) == {"prefill-0", "decode-0", "router"}  # the tails' steps ended with them
