"""Real vLLM 1P1D on CPU as Slurm job steps: the slurm-cpu template on a real two-node local cluster.

One deployment, brought up with `kvpush up` (which submits the job), is shared by the tests that
leave it as they found it (answers through the router with KV moved by transfer, streaming, status
and logs per step) or repair it and prove it works again (a killed prefill step relaunched alone;
if it fails before that proof, the deployment is stopped and the next test starts a fresh one). The
test that ends it (`scancel` of the job from outside) takes it for itself (`own_deployment`,
tests/deployment_slot.py). Then one more `up` inside an allocation the test makes with salloc. Heavy: run under `flock /tmp/kvpush-heavy.lock`.
"""
from __future__ import annotations

import json
import socket
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest
import yaml

from kvpush.cli.main import run as cli_run
from kvpush.common.vllm_metrics import external_kv_tokens
from kvpush.deploy.plan.plan import build_plan
from kvpush.deploy.runners.slurm_cli import SlurmClient
from kvpush.deploy.lifecycle.state import load_state
from kvpush.deploy.lifecycle.tiny_model import make_tiny_model
from kvpush.deploy.topology.topology import TinyModelSpec, load_topology
from kvpush.templates import template_text
from deployment_slot import DeploymentSlot
from e2e_instances import KV_CACHE_GIB
from lifecycle_helpers import kill_leftovers, processes_under, run_cli
from random_prompts import full_length_prompts, random_prompts

NAME = "slurm-cpu"
PORTS = {"prefill": (26210, 26220), "decode": (26230, 26240), "router": 26250}
PROMPTS = random_prompts(16, 700, seed=26)[8:]  # 255 to 700 tokens, held out: no other request used them
MAX_TOKENS = 12



def _topology_file(tmp: Path, model: Path) -> Path:
    """The shipped slurm-cpu template with this test's model, directories and ports."""
    doc = yaml.safe_load(template_text(NAME))
    for name in ("n1", "n2"):
        doc["hosts"][name].update({"python": sys.executable, "workdir": str(tmp / name)})
    doc["model"].update({"path": str(model), "enforce_eager": True})
    for role in ("prefill", "decode"):
        doc[role][0]["kv_cache_gib"] = KV_CACHE_GIB
    (doc["prefill"][0]["http_port"], doc["prefill"][0]["side_channel_port"]) = PORTS["prefill"]
    (doc["decode"][0]["http_port"], doc["decode"][0]["side_channel_port"]) = PORTS["decode"]
    doc["router"]["port"] = PORTS["router"]
    path = tmp / "slurm-cpu.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def _post(url: str, prompt, stream: bool = False) -> str:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "stream": stream}
    request = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=180) as response:
        raw = response.read().decode()
    if not stream:
        return json.loads(raw)["choices"][0]["text"]
    events = [e[len("data: "):] for e in raw.split("\n\n") if e.startswith("data: ")]
    assert events[-1] == "[DONE]" and len(events) > 2, raw[-300:]
    return "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])


def _external_kv(url: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
        return external_kv_tokens(response.read().decode())


def _listening(address: str, port: int) -> bool:
    try:
        socket.create_connection((address, port), timeout=1).close()
        return True
    except OSError:
        return False


def _steps(cluster) -> set[str]:
    out = cluster.command("squeue", "-h", "-s", "-o", "%i|%j").stdout
    return {ln.split("|")[1] for ln in out.split() if not ln.split("|")[0].endswith("batch")}


def _described(proc: psutil.Process) -> str:
    try:
        return f"{proc.pid} {proc.status()} {' '.join(proc.cmdline())[:160]}"
    except psutil.Error:
        return f"{proc.pid} (exited while listed)"


def _nothing_left(cluster, model: Path, workdir: Path) -> None:
    """No step, no vLLM or router process, no port of the deployment still open."""
    assert _steps(cluster) == set()
    left = [_described(p) for p in processes_under(str(model)) + processes_under(str(workdir))]
    kill_leftovers(str(model))
    kill_leftovers(str(workdir))
    assert left == [], f"processes left: {left}"
    ports = [("127.0.0.51", PORTS["prefill"][0]), ("127.0.0.51", PORTS["prefill"][1]), ("127.0.0.52", PORTS["decode"][0]),
             ("127.0.0.52", PORTS["decode"][1]), ("127.0.0.52", PORTS["router"])]
    assert [p for p in ports if _listening(*p)] == []


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("model") / "tiny"
    make_tiny_model(path, TinyModelSpec(seed=0))
    return path


def _up(model: Path, tmp: Path) -> Path:
    """`kvpush up` of the slurm-cpu template (kvpush submits the job); its topology file."""
    path = _topology_file(tmp, model)
    try:
        cli_run(["up", str(path), "--timeout", "400"])
    except SystemExit as exc:
        if exc.code:
            _down(path)
            pytest.fail(f"kvpush up failed ({exc.code}); see the output above")
    return path


def _down(path: Path) -> None:
    try:
        cli_run(["down", str(path)])  # a no-op once the job is gone
    except SystemExit:
        pass


@pytest.fixture(scope="module")
def slot(slurm_cluster, model, tmp_path_factory):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KVPUSH_STATE_DIR", str(tmp_path_factory.mktemp("state")))
        def stop(path: Path) -> None:
            _down(path)
            _nothing_left(slurm_cluster, model, path.parent)

        slot = DeploymentSlot("the slurm-cpu deployment", lambda: _up(model, tmp_path_factory.mktemp("deployment")), stop)
        try:
            yield slot
        finally:
            slot.close()


@pytest.fixture
def deployment(slot) -> Path:
    """The topology file of the shared deployment."""
    return slot.shared()


@pytest.fixture
def own_deployment(slot):
    """A deployment for this test alone (it breaks it); stopped, and checked gone, after it."""
    path = slot.take()
    try:
        yield path
    finally:
        slot.stop(path)


def test_held_out_prompts_are_answered_through_the_router_with_kv_moved_and_streamed(deployment, reference_server):
    router, decode = f"http://127.0.0.52:{PORTS['router']}", f"http://127.0.0.52:{PORTS['decode'][0]}"
    before = _external_kv(decode)
    answers = [_post(router, p) for p in PROMPTS]
    moved = _external_kv(decode) - before
    # vLLM may recompute the last prompt token on decode; everything else must have come by transfer.
    assert moved >= sum(len(p) for p in PROMPTS) - len(PROMPTS), f"decode received {moved} prompt tokens by KV transfer"
    assert all(answers), answers
    streamed = [_post(router, p, stream=True) for p in PROMPTS[:3]]
    assert streamed == answers[:3]

    reference = reference_server.url_for(build_plan(load_topology(deployment)).process("decode-0"))
    assert answers == [_post(reference, p) for p in PROMPTS]


def test_status_shows_each_step_and_logs_tail_them(deployment, slurm_cluster, capsys):
    code, out, err = run_cli(["status", str(deployment), "--json"], capsys)
    document = json.loads(out)
    assert code == 0 and document["healthy"], out + err
    rows = {p["name"]: (p["host"], p["process"], p["health"]) for p in document["processes"]}
    assert rows == {"prefill-0": ("n1", "running", "ok"), "decode-0": ("n2", "running", "ok"), "router": ("n2", "running", "ok")}
    state = load_state(NAME)
    steps = slurm_cluster.command("squeue", "-h", "-s", "-j", state.slurm_submitted_job, "-o", "%i|%j").stdout.split()
    assert {f"{state.slurm_submitted_job}.{r.pid}|{r.name}" for r in state.processes.values()} <= set(steps)

    code, out, err = run_cli(["logs", "--file", str(deployment), "-n", "40"], capsys)
    assert code == 0, err
    by_process = {}
    for line in out.splitlines():
        name, _, text = line.partition(" | ")
        by_process.setdefault(name.strip(), []).append(text)
    assert set(by_process) == {"prefill-0", "decode-0", "router"}
    assert any("Application startup complete" in ln or "/health" in ln for ln in by_process["decode-0"])


def test_a_killed_prefill_step_is_reported_and_up_relaunches_only_it(slot, model, capsys):
    deployment = slot.shared()
    try:
        _kill_prefill_step_and_relaunch_it(deployment, model, capsys)
    except BaseException:
        slot.discard()  # in an unknown state: the next test starts a fresh one
        raise


def _kill_prefill_step_and_relaunch_it(deployment: Path, model: Path, capsys) -> None:
    state = load_state(NAME)
    prefill = next(p for p in processes_under(str(model)) if Path(p.cmdline()[0]).name.startswith("python")
                   and "kv_producer" in " ".join(p.cmdline()))  # the server itself, not its step's shell or srun
    prefill.kill()
    psutil.wait_procs([prefill], timeout=10)
    deadline = time.monotonic() + 30
    while True:
        code, out, _ = run_cli(["status", str(deployment), "--json"], capsys)
        rows = {p["name"]: p["process"] for p in json.loads(out)["processes"]}
        if rows["prefill-0"] == "dead" or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert code == 1 and rows == {"prefill-0": "dead", "decode-0": "running", "router": "running"}
    # The server's engine core and every other process it started ended with it: its ports are free.
    assert [p for p in PORTS["prefill"] if _listening("127.0.0.51", p)] == []

    code, out, err = run_cli(["up", str(deployment), "--timeout", "400"], capsys)
    assert code == 0, err
    assert "start again (not running): prefill-0" in err and "keep (unchanged, running): decode-0, router" in err
    after = load_state(NAME)
    assert after.processes["prefill-0"].restarts == 1 and after.processes["prefill-0"].pid != state.processes["prefill-0"].pid
    assert {n: after.processes[n].pid for n in ("decode-0", "router")} == {n: state.processes[n].pid for n in ("decode-0", "router")}
    router, decode = f"http://127.0.0.52:{PORTS['router']}", f"http://127.0.0.52:{PORTS['decode'][0]}"
    before = _external_kv(decode)
    assert _post(router, full_length_prompts(1, 400, seed=2601)[0])
    assert _external_kv(decode) > before


def test_scancel_from_outside_status_says_so_in_one_line_and_down_is_a_no_op(own_deployment, slurm_cluster, model, capsys):
    deployment = own_deployment
    job = load_state(NAME).slurm_submitted_job
    slurm_cluster.command("scancel", job)
    assert SlurmClient().wait_gone(job, 60)
    code, out, err = run_cli(["status", str(deployment)], capsys)
    lines = [ln for ln in (out + err).splitlines() if ln.strip()]
    assert code == 1 and len(lines) == 1 and f"Slurm job {job} has ended (CANCELLED)" in lines[0], lines
    code, out, err = run_cli(["down", str(deployment)], capsys)
    assert code == 0 and "has ended" in out and "stopped" not in out, out + err
    assert load_state(NAME) is None
    _nothing_left(slurm_cluster, model, deployment.parent)


def test_up_inside_an_allocation_made_with_salloc(slurm_cluster, model, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KVPUSH_STATE_DIR", str(tmp_path / "state"))
    allocated = slurm_cluster.command("salloc", "--no-shell", "-N2", "-J", "users-allocation", timeout=60)
    job = next(w for w in allocated.stderr.split() if w.isdigit())
    try:
        monkeypatch.setenv("SLURM_JOB_ID", job)
        path = _topology_file(tmp_path, model)
        code, out, err = run_cli(["up", str(path), "--timeout", "400", "--skip-doctor"], capsys)
        assert code == 0, err
        assert f"deploying into job {job} (SLURM_JOB_ID)" in err and "proof: router answered" in out
        assert _steps(slurm_cluster) == {"prefill-0", "decode-0", "router"}
        decode = f"http://127.0.0.52:{PORTS['decode'][0]}"
        before = _external_kv(decode)
        code, out, err = run_cli(["request", "--file", str(path), "--json", "a prompt held out from every other test " * 20], capsys)
        assert code == 0 and json.loads(out)["completion_tokens"] > 0, err
        assert _external_kv(decode) > before
        code, out, err = run_cli(["down", str(path)], capsys)
        assert code == 0 and "stopped" in out and "cancelled" not in out, out + err
        _nothing_left(slurm_cluster, model, tmp_path)
        assert SlurmClient().job(job).running  # the allocation stays its owner's
    finally:
        slurm_cluster.command("scancel", job, check=False)
        SlurmClient().wait_gone(job, 30)


def test_bench_runs_unchanged_on_slurm(slurm_cluster, model, tmp_path, monkeypatch, capsys):
    """One mode, one rate, four prompts: the bench deploys, measures, keeps the logs and cancels its job."""
    monkeypatch.setenv("KVPUSH_STATE_DIR", str(tmp_path / "state"))
    path = _topology_file(tmp_path, model)
    out = tmp_path / "bench"
    code, stdout, err = run_cli(["bench", str(path), "--modes", "kvpush", "--baseline", "kvpush", "--rates", "1",
                              "--num-prompts", "4", "--input-len", "256", "--output-len", "8", "--out", str(out),
                              "--timeout", "400"], capsys)
    assert code == 0, stdout + err
    result = json.loads((out / "bench.json").read_text())
    assert "Slurm: submitted job" in err
    assert {p.name for p in (out / "logs").iterdir()} >= {"kvpush-prefill-0.log", "kvpush-decode-0.log", "kvpush-router.log"}
    (run,) = result["runs"]
    assert run["error"] is None and [(p["client"]["completed"], p["client"]["failed"]) for p in run["points"]] == [(4, 0)]
    assert set(run["idle_cores"]) == {"prefill-0", "decode-0"}  # sampled from the steps' processes on their nodes
    assert slurm_cluster.command("squeue", "-h").stdout.strip() == ""
    _nothing_left(slurm_cluster, model, tmp_path)
