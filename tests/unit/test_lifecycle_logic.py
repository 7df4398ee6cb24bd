"""Pure logic behind up/down/status: change detection, state file, shell snippets, metrics, fan-out."""
from __future__ import annotations

import json
import threading
import time

import pytest

from kvpush.deploy.lifecycle.changes import diff_deployment, is_running, launch_digest, reload_digest
from kvpush.common.errors import KvpushError
from kvpush.deploy.plan.plan import build_plan
from kvpush.deploy.runners import HostError, ProcessInfo, fan_out, values_or_raise
from kvpush.deploy.runners.base import (detached_start_command, parse_proc_table, signal_groups_command)
from kvpush.deploy.runners.local import LocalRunner
from kvpush.deploy.lifecycle.state import DeploymentState, ProcessRecord, load_state, locked, save_state, state_path
from kvpush.deploy.topology.topology import parse_topology
from kvpush.common.vllm_metrics import external_kv_tokens, vllm_load
from kvpush.templates import DEFAULT_TEMPLATE, template_text

TOPOLOGY = """
name: t
model: {path: /m, served_name: tiny}
connector: {type: nixl-pull}
hosts: {a: {address: 10.0.0.1}, b: {address: 10.0.0.2}}
prefill: [{host: a}]
decode: [{host: b}]
router: {host: a}
"""


def _plan(text=TOPOLOGY):
    return build_plan(parse_topology(text))


def _state_from(plan, **overrides) -> DeploymentState:
    state = DeploymentState(plan.deployment)
    for host in plan.hosts:
        for proc in host.processes:
            state.processes[proc.name] = ProcessRecord(
                name=proc.name, role=proc.role, host=host.name, pid=100, pgid=100, start_time=1000.0,
                http_port=proc.http_port, health_url=proc.health_url, log_path=proc.log_path,
                digest=launch_digest(host, proc), started_at=0.0, reload_digest=reload_digest(host, proc))
    state.processes.update(overrides)
    return state


def test_fresh_deployment_starts_everything():
    changes = diff_deployment(_plan(), None, {})
    assert sorted(changes.start) == ["decode-0", "prefill-0", "router"] and not changes.nothing_to_do


def test_unchanged_running_deployment_has_nothing_to_do():
    plan = _plan()
    changes = diff_deployment(plan, _state_from(plan), {n: True for n in ["prefill-0", "decode-0", "router"]})
    assert changes.nothing_to_do and len(changes.keep) == 3


def test_dead_process_is_revived_and_others_kept():
    plan = _plan()
    changes = diff_deployment(plan, _state_from(plan), {"prefill-0": True, "decode-0": False, "router": True})
    assert changes.revive == ["decode-0"] and sorted(changes.keep) == ["prefill-0", "router"]


def test_changed_instance_restarts_it_and_the_router_reloads_its_instance_list():
    plan = _plan()
    state = _state_from(plan)
    new_plan = _plan(TOPOLOGY.replace("decode: [{host: b}]", "decode: [{host: b, http_port: 8299}]"))
    changes = diff_deployment(new_plan, state, {n: True for n in state.processes})
    # decode's argv changed; the router's argv and router.json did not, its instance list did
    assert changes.restart == ["decode-0"] and changes.reload == ["router"] and changes.keep == ["prefill-0"]
    assert "reload (instance list changed): router" in changes.lines()


def test_an_added_or_removed_instance_is_a_reload_of_the_router_not_a_restart():
    plan = _plan()
    state = _state_from(plan)
    grown = _plan(TOPOLOGY.replace("decode: [{host: b}]", "decode: [{host: b}, {host: b, name: decode-1}]"))
    changes = diff_deployment(grown, state, {n: True for n in state.processes})
    assert changes.start == ["decode-1"] and changes.reload == ["router"] and not changes.restart
    state = _state_from(grown)
    changes = diff_deployment(plan, state, {n: True for n in state.processes})
    assert changes.stop == ["decode-1"] and changes.reload == ["router"] and not changes.restart


def test_a_changed_router_setting_restarts_the_router():
    plan = _plan()
    state = _state_from(plan)
    changes = diff_deployment(_plan(TOPOLOGY.replace("router: {host: a}", "router: {host: a, policy: least-loaded}")),
                              state, {n: True for n in state.processes})
    assert changes.restart == ["router"] and not changes.reload


def test_env_only_change_restarts_only_that_instance():
    plan = _plan()
    state = _state_from(plan)
    new_plan = _plan(TOPOLOGY.replace("prefill: [{host: a}]", "prefill: [{host: a, env: {X: '1'}}]"))
    changes = diff_deployment(new_plan, state, {n: True for n in state.processes})
    assert changes.restart == ["prefill-0"] and sorted(changes.keep) == ["decode-0", "router"]


def test_process_removed_from_plan_is_stopped():
    plan = _plan()
    extra = ProcessRecord("decode-9", "decode", "b", 5, 5, None, 1, "u", "l", "d", 0.0)
    changes = diff_deployment(plan, _state_from(plan, **{"decode-9": extra}), {})
    assert changes.stop == ["decode-9"]


def test_reused_pid_is_not_running():
    record = ProcessRecord("p", "prefill", "a", 7, 7, 1000.0, 1, "u", "l", "d", 0.0)
    assert is_running(record, ProcessInfo(7, "alive", 1000.4, 7))
    assert not is_running(record, ProcessInfo(7, "alive", 2000.0, 7))
    assert not is_running(record, ProcessInfo(7, "zombie", 1000.0, 7))
    assert not is_running(record, ProcessInfo(7, "dead"))


def test_state_round_trip_and_location(tmp_path, monkeypatch):
    monkeypatch.setenv("KVPUSH_STATE_DIR", str(tmp_path))
    plan = _plan()
    state = _state_from(plan)
    save_state(state)
    assert state_path("t") == tmp_path / "t.json"
    loaded = load_state("t")
    assert loaded.processes["router"] == state.processes["router"]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temp file left behind


def test_a_state_whose_hosts_record_is_local_still_loads(tmp_path, monkeypatch):
    monkeypatch.setenv("KVPUSH_STATE_DIR", str(tmp_path))
    (tmp_path / "t.json").write_text(json.dumps({"deployment": "t", "hosts": {"local": {
        "address": "127.0.0.1", "ssh_port": 22, "user": None, "key": None, "is_local": True, "workdir": "/w", "slurm": None}}}))
    host = load_state("t").hosts["local"]
    assert host.is_local and host.workdir == "/w"


@pytest.mark.parametrize("content", [
    b"{not json", b"[]", b"null", b'"text"', b"\xff\xfe", b'{"processes": []}', b'{"hosts": {"h": 3}}',
    b'{"deployment": "t", "processes": {"a": {"name": "a"}}}',
    b'{"deployment": "t", "processes": {"a": {"name": "a", "role": "decode", "host": "h", "pid": "12", "pgid": 12, '
    b'"start_time": null, "http_port": 1, "health_url": "", "log_path": "", "digest": "", "started_at": 0}}}',
], ids=["garbage", "list", "null", "string", "not-utf8", "processes-list", "host-number", "short-record", "pid-text"])
def test_corrupt_state_is_one_line_naming_the_file_and_the_way_out(tmp_path, monkeypatch, content):
    monkeypatch.setenv("KVPUSH_STATE_DIR", str(tmp_path))
    (tmp_path / "t.json").write_bytes(content)
    with pytest.raises(KvpushError) as exc:
        load_state("t")
    message = str(exc.value)
    assert message.startswith(f"{tmp_path / 't.json'}: not a kvpush deployment state (") and "\n" not in message
    assert f"mv {tmp_path / 't.json'} {tmp_path / 't.json'}.bad" in message and "rerun `kvpush up`" in message


def test_lock_excludes_a_second_command(tmp_path, monkeypatch):
    monkeypatch.setenv("KVPUSH_STATE_DIR", str(tmp_path))
    held, release = threading.Event(), threading.Event()

    def holder():
        with locked("t"):
            held.set()
            release.wait(5)

    t = threading.Thread(target=holder)
    t.start()
    held.wait(5)
    try:
        with pytest.raises(KvpushError, match="another kvpush command"):
            with locked("t", wait_s=0.2):
                pass
    finally:
        release.set()
        t.join()
    with locked("t", wait_s=1):
        pass


def test_detached_start_backgrounds_one_simple_command():
    text = detached_start_command(["/py", "-m", "x", "a b"], {"K": "v w"}, "/w", "/w/logs/p.log")
    assert text.endswith("env 'K=v w' nohup setsid /py -m x 'a b' >/w/logs/p.log 2>&1 </dev/null & echo $!")
    assert "&& nohup" not in text  # `a && b &` would background a subshell and $! would be wrong


def test_detached_start_sources_an_env_file_so_its_values_stay_off_every_argv(tmp_path):
    env_file = tmp_path / "secret.env"
    env_file.write_text("SECRET_VALUE=s3cr3t-value\n")
    env_file.chmod(0o600)
    text = detached_start_command(["/py"], {"K": "v"}, "/w", "/w/p.log", str(env_file))
    assert f"set -a; . {env_file} || exit 1; set +a; " in text and "s3cr3t" not in text
    runner = LocalRunner()
    out = tmp_path / "out"
    started = runner.start_detached(["sh", "-c", f"echo \"$SECRET_VALUE $K\" > {out}"], {"K": "v"}, str(tmp_path),
                                    str(tmp_path / "p.log"), env_file=str(env_file))
    deadline = time.monotonic() + 10  # a guard against a hang, not a time bound
    while not (out.exists() and out.read_text()):
        assert time.monotonic() < deadline, f"pid {started.pid} wrote nothing"
        time.sleep(0.02)
    assert out.read_text() == "s3cr3t-value v\n"
    with pytest.raises(HostError, match="starting"):  # a missing env file starts nothing
        runner.start_detached(["true"], {}, str(tmp_path), str(tmp_path / "q.log"), env_file=str(tmp_path / "missing.env"))


def test_proc_table_parsing_handles_odd_command_names():
    text = ("btime 1000\n100\n"
            "42 42 (my (odd) prog) S 1 42 42 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 250 0 0\n"
            "43 43 (z) Z 1 40 40 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 300 0 0\n")
    infos = parse_proc_table([42, 43, 44], text)
    assert infos[42] == ProcessInfo(42, "alive", 1002.5, 42, command="my (odd) prog")
    assert infos[43].state == "zombie" and infos[43].pgid == 40
    assert infos[44].state == "dead"


def test_signal_command_targets_groups_and_skips_init():
    assert signal_groups_command([5, 1, 0], "TERM") == "kill -s TERM -- -5 2>/dev/null; true"
    assert signal_groups_command([], "KILL") == "true"


def test_home_expansion_only_for_leading_tilde():
    runner = LocalRunner()
    assert runner.expand("~/x") == runner.home + "/x"
    assert runner.expand("a~/x") == "a~/x" and runner.expand("~") == runner.home


def test_fan_out_reports_every_host_and_names_the_failed_one():
    def work(host):
        if host == "b":
            raise HostError("host b: unreachable")
        if host == "c":
            raise ValueError("boom")
        return host.upper()

    results = fan_out(["a", "b", "c"], work)
    assert list(results) == ["a", "b", "c"]
    assert results["a"].value == "A" and results["b"].error == "host b: unreachable"
    assert results["c"].error == "host c: ValueError: boom"
    with pytest.raises(KvpushError) as exc:
        values_or_raise(results)
    assert "host b: unreachable" in str(exc.value) and "host c" in str(exc.value)


METRICS = """# HELP vllm:num_requests_running x
vllm:num_requests_running{engine="0",model_name="tiny"} 2.0
vllm:num_requests_waiting{engine="0",model_name="tiny"} 1.0
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.5
vllm:prompt_tokens_by_source_total{engine="0",model_name="tiny",source="external_kv_transfer"} 384.0
vllm:prompt_tokens_by_source_total{engine="0",model_name="tiny",source="local_compute"} 7.0
"""


def test_vllm_metrics():
    load = vllm_load(METRICS)
    assert (load.running, load.waiting, load.kv_usage) == (2.0, 1.0, 0.5)
    assert external_kv_tokens(METRICS) == 384.0
    assert external_kv_tokens("") == 0.0


def test_source_digest_follows_content_not_caches(tmp_path):
    from kvpush.deploy.lifecycle.host_probe import PACKAGES, digest_of

    dirs = {p: str(tmp_path / p) for p in PACKAGES}
    for d in dirs.values():
        (tmp_path / d).mkdir(parents=True)
        (tmp_path / d / "a.py").write_text("x = 1\n")
    first = digest_of(dirs)
    (tmp_path / dirs[PACKAGES[0]] / "__pycache__").mkdir()
    (tmp_path / dirs[PACKAGES[0]] / "__pycache__" / "a.cpython-311.pyc").write_bytes(b"junk")
    (tmp_path / dirs[PACKAGES[0]] / "notes.txt").write_text("not packaged")
    assert digest_of(dirs) == first
    (tmp_path / dirs[PACKAGES[-1]] / "a.py").write_text("x = 2\n")
    assert digest_of(dirs) != first
    assert digest_of({}) is None


class _ProofRunner:
    """Router and decode /metrics in one: answers the first `fallbacks` proof requests without moving KV,
    as a router does while every prefill instance is out of its rotation."""

    def __init__(self, fallbacks: int):
        self.fallbacks = fallbacks
        self.external = 0
        self.prompts: list[str] = []
        self.authorization: dict[str, set] = {"router metrics": set(), "metrics": set(), "completions": set()}

    def http(self, method, url, body=None, timeout=5.0, headers=None):
        from kvpush.deploy.runners.base import HttpResponse

        kind = ("router metrics" if url.endswith(":8000/metrics") else "metrics") if url.endswith("/metrics") else "completions"
        self.authorization[kind].add((headers or {}).get("Authorization"))
        if url.endswith("/metrics"):
            return HttpResponse(200, f'vllm:prompt_tokens_by_source_total{{source="external_kv_transfer"}} {self.external}.0\n'.encode())
        self.prompts.append(__import__("json").loads(body)["prompt"])
        if len(self.prompts) > self.fallbacks:
            self.external += 200
        return HttpResponse(200, b'{"choices": [{"text": " ok"}]}')


def test_proof_asks_again_when_the_router_let_decode_compute_the_prompt(monkeypatch):
    import kvpush.deploy.lifecycle.proof as proof

    monkeypatch.setattr(proof.time, "sleep", lambda s: None)
    plan = build_plan(parse_topology(template_text(DEFAULT_TEMPLATE)))
    runner = _ProofRunner(fallbacks=2)
    result = proof.prove_kv_transfer({"local": runner}, plan)
    assert result.external_kv_tokens == 200 and len(runner.prompts) == 3
    assert len(set(runner.prompts)) == 3  # a fresh prompt each time: decode's prefix cache cannot hide the transfer

    monkeypatch.setattr(proof, "ROUTER_ROTATION_WAIT_S", 0.0)
    with pytest.raises(KvpushError, match="no decode instance received prompt tokens by KV transfer"):
        proof.prove_kv_transfer({"local": _ProofRunner(fallbacks=10**6)}, plan)


def test_proof_sends_the_routers_key_to_the_router_and_the_instances_key_to_decode(monkeypatch):
    import kvpush.deploy.lifecycle.lifecycle as lifecycle
    from kvpush.deploy.lifecycle.secrets import AccessKeys

    plan = build_plan(parse_topology(template_text(DEFAULT_TEMPLATE)))
    runner = _ProofRunner(fallbacks=0)
    lifecycle.prove_kv_transfer({"local": runner}, plan, keys=AccessKeys(client="client-key", instance="instance-key"))
    assert runner.authorization == {"router metrics": {"Bearer client-key"}, "metrics": {"Bearer instance-key"},
                                    "completions": {"Bearer client-key"}}


def test_doctor_gate_names_doctor_once(monkeypatch):
    from kvpush.deploy import doctor
    from kvpush.deploy.lifecycle import lifecycle
    from kvpush.deploy.doctor import DoctorReport, Status
    from kvpush.deploy.doctor.result import CheckResult

    failed = CheckResult("python", "local", Status.FAIL, "/nope/python: not found", remedy="fix 'python:'")
    monkeypatch.setattr(doctor, "fast_checks", lambda topo, runners, running: DoctorReport([failed], 0.1, ["local"]))
    with pytest.raises(KvpushError) as info:
        lifecycle._doctor_gate(parse_topology(template_text(DEFAULT_TEMPLATE)), {}, frozenset(), lifecycle.Events())
    assert str(info.value).startswith("doctor: python on local: /nope/python: not found; fix 'python:'; nothing was started")
