"""up / status / down / logs across real sshd hosts, with light stand-in processes for speed."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import yaml

from kvpush.common.errors import KvpushError
from kvpush.deploy.lifecycle.lifecycle import StartFailure, down, up
from kvpush.deploy.lifecycle.observe import deployment_status, require_state
from kvpush.deploy.lifecycle.state import load_state
from lifecycle_helpers import STANDIN_PORTS, RecordingEvents, options, processes_under, run_cli, standin_deployments, wait_for


@pytest.fixture
def deploy(sshd_cluster, tmp_path, state_dir):
    with standin_deployments(sshd_cluster, tmp_path) as make:
        yield make


def test_up_status_down_across_three_hosts(deploy, sshd_cluster, tmp_path, capsys):
    topo = deploy()
    result = up(topo, options(sshd_cluster))
    assert sorted(result.ready_s) == ["decode-0", "prefill-0", "router"]
    assert result.proof.external_kv_tokens > 0 and result.proof.answer == " stand-in answer"
    state = load_state("t")
    assert {r.host for r in state.processes.values()} == {"h0", "h1", "h2"}
    assert all(r.pid == r.pgid for r in state.processes.values())  # each in its own process group

    code, out, _ = run_cli(["status", "--deployment", "t", "--json", "--known-hosts", str(sshd_cluster.known_hosts)], capsys)
    doc = json.loads(out)
    assert code == 0 and doc["healthy"] and [p["health"] for p in doc["processes"]] == ["ok", "ok", "ok"], doc
    assert doc["processes"][0]["kv_usage"] == 0.25
    assert [(type(p["running"]), type(p["waiting"])) for p in doc["processes"][:2]] == [(int, int)] * 2  # counts, not 0.0

    code, out, _ = run_cli(["logs", "router", "--deployment", "t", "-n", "5", "--known-hosts", str(sshd_cluster.known_hosts)], capsys)
    assert code == 0 and "router" in out and "POST /v1/completions" in out

    again = up(topo, options(sshd_cluster), events := RecordingEvents())
    assert again.changes.nothing_to_do and any("nothing to do" in n for n in events.notes)
    assert load_state("t").processes == state.processes

    stopped = down("t", options(sshd_cluster))
    assert sorted(stopped.stopped) == ["decode-0", "prefill-0", "router"] and stopped.complete
    assert processes_under(str(tmp_path / "standin-python")) == [] and load_state("t") is None
    assert down("t", options(sshd_cluster)).stopped == []  # idempotent


def test_changed_topology_restarts_only_the_affected_process(deploy, sshd_cluster):
    ports = next(STANDIN_PORTS)
    up(deploy(port_base=ports), options(sshd_cluster))
    before = load_state("t").processes
    changed = deploy(port_base=ports, instance_env={"prefill-0": {"NEW_SETTING": "1"}})
    result = up(changed, options(sshd_cluster))
    assert result.changes.restart == ["prefill-0"] and sorted(result.changes.keep) == ["decode-0", "router"]
    after = load_state("t").processes
    assert after["prefill-0"].pid != before["prefill-0"].pid and after["prefill-0"].restarts == 1
    assert after["decode-0"].pid == before["decode-0"].pid and after["router"].pid == before["router"].pid


def test_killed_process_shows_in_status_and_up_restarts_it(deploy, sshd_cluster, capsys):
    topo = deploy()
    up(topo, options(sshd_cluster))
    victim = load_state("t").processes["decode-0"]
    os.killpg(victim.pgid, signal.SIGKILL)

    def rows():
        return {r.name: r for r in deployment_status(require_state("t"), options(sshd_cluster).ssh)}

    # A SIGKILLed process still counts as alive until the kernel has run its exit, which a loaded machine delays.
    seen = wait_for("decode-0 dead", lambda: (now := rows())["decode-0"].process in ("dead", "zombie") and now, 20,
                    detail=lambda: f"status rows: {rows()}")
    assert not seen["decode-0"].healthy
    assert seen["prefill-0"].healthy
    code, out, _ = run_cli(["status", "-d", "t", "--json", "--known-hosts", str(sshd_cluster.known_hosts)], capsys)
    assert code == 1 and json.loads(out)["healthy"] is False
    result = up(topo, options(sshd_cluster))
    assert result.changes.revive == ["decode-0"] and result.proof is not None
    assert load_state("t").processes["decode-0"].restarts == 1


def test_unreachable_host_at_up_starts_nothing(deploy, sshd_cluster, tmp_path):
    topo = deploy()
    sshd_cluster.stop(sshd_cluster.hosts[1])
    with pytest.raises(KvpushError, match=r"host h1 \(root@127\.0\.0\.\d+:\d+\): connection refused") as exc:
        up(topo, options(sshd_cluster))
    assert "nothing was started" in str(exc.value)
    assert processes_under(str(tmp_path / "standin-python")) == []


def test_process_failing_to_start_prints_its_log_and_stops_the_rest(deploy, sshd_cluster, tmp_path):
    topo = deploy(instance_env={"decode-0": {"STANDIN_EXIT": "1"}})
    events = RecordingEvents()
    with pytest.raises(StartFailure, match="process decode-0 on host h1 exited before it became ready"):
        up(topo, options(sshd_cluster), events)
    assert "exiting at once" in events.tails["decode-0"]
    time.sleep(0.2)
    assert processes_under(str(tmp_path / "standin-python")) == []
    assert load_state("t").processes == {}


def test_down_with_a_host_gone_reports_it_and_finishes_later(deploy, sshd_cluster):
    up(deploy(), options(sshd_cluster))
    gone = sshd_cluster.hosts[1]
    sshd_cluster.stop(gone)
    result = down("t", options(sshd_cluster))
    assert sorted(result.stopped) == ["prefill-0", "router"] and list(result.unreachable) == ["h1"]
    assert "connection refused" in result.unreachable["h1"]
    assert list(load_state("t").processes) == ["decode-0"]  # kept for the next down
    sshd_cluster.restart(gone)
    assert down("t", options(sshd_cluster)).stopped == ["decode-0"]
    assert load_state("t") is None


def test_cli_up_and_down_exit_codes(deploy, sshd_cluster, tmp_path, capsys):
    import yaml

    topo = deploy()
    path = tmp_path / "kvpush.yaml"
    path.write_text(yaml.safe_dump(topo.model_dump(mode="json", exclude_none=True)))
    kh = ["--known-hosts", str(sshd_cluster.known_hosts)]
    code, out, err = run_cli(["up", str(path), "--no-provision", "--timeout", "30", *kh], capsys)
    assert code == 1 and "doctor:" in err and "--skip-doctor" in err  # stand-in hosts have no vLLM
    assert load_state(topo.name) is None or not load_state(topo.name).processes
    code, out, err = run_cli(["up", str(path), "--no-provision", "--skip-doctor", "--timeout", "30", *kh], capsys)
    assert code == 0, err
    assert "ready; slowest process" in out and "decode received" in out
    code, out, _ = run_cli(["up", str(path), "--no-provision", "--skip-doctor", *kh], capsys)
    assert code == 0 and "unchanged, nothing to do" in out
    code, out, _ = run_cli(["down", str(path), *kh], capsys)
    assert code == 0 and "stopped" in out
    code, _, err = run_cli(["status", str(path), *kh], capsys)
    assert code == 1 and "not running" in err


def test_logs_follow_prefixes_new_lines_by_process(deploy, sshd_cluster):
    import threading

    from kvpush.deploy.lifecycle.observe import stream_logs

    topo = deploy()
    up(topo, options(sshd_cluster))
    state = require_state("t")
    seen: list[tuple[str, str]] = []
    stop = threading.Event()

    def emit(name, line):
        seen.append((name, line))

    follower = threading.Thread(target=stream_logs, args=(state, "decode", 0, True, options(sshd_cluster).ssh, emit, stop))
    follower.start()
    try:
        from kvpush.deploy.lifecycle.lifecycle import prove_kv_transfer  # each proof is one request: decode logs a POST
        from kvpush.deploy.lifecycle.hosts import connected
        from kvpush.deploy.plan.plan import build_plan

        # `tail -n 0 -F` starts only after the follower's own SSH connect and misses lines written
        # before it: send a request again each second until one shows up.
        deadline = time.monotonic() + 30
        last_request = float("-inf")
        with connected(state.hosts, options(sshd_cluster).ssh) as (runners, _):
            while not any("POST /v1/completions" in line for _, line in seen):
                assert time.monotonic() < deadline, seen
                if time.monotonic() - last_request >= 1:
                    prove_kv_transfer(runners, build_plan(topo))
                    last_request = time.monotonic()
                time.sleep(0.05)
    finally:
        stop.set()
        follower.join(5)
    assert not follower.is_alive()
    assert {name for name, _ in seen} == {"decode-0"}


def test_proof_waits_while_the_router_has_no_instance_in_rotation(deploy, sshd_cluster):
    topo = deploy(extra={"env": {"STANDIN_ROUTER_OUT_OF_ROTATION": "2"}})
    result = up(topo, options(sshd_cluster))
    assert result.proof is not None and result.proof.external_kv_tokens > 0
    router_log = open(load_state("t").processes["router"].log_path).read()
    assert router_log.count('"GET /metrics HTTP/1.0" 200') >= 3  # two pages with the instances out, then ready
    assert router_log.count('"POST /v1/completions HTTP/1.0" 200') == 1  # the one request, sent once ready


def test_doctor_on_the_running_deployment_passes_its_own_ports_and_names_a_foreign_holder(deploy, sshd_cluster, tmp_path, capsys):
    topo = deploy()
    up(topo, options(sshd_cluster))
    path = tmp_path / "kvpush.yaml"
    path.write_text(yaml.safe_dump(topo.model_dump(mode="json", exclude_none=True)))
    doctor = ["doctor", str(path), "--only", "ports-free", "--json", "--known-hosts", str(sshd_cluster.known_hosts)]
    code, out, err = run_cli(doctor, capsys)
    rows = {r["subject"]: r for r in json.loads(out)["results"]}
    assert code == 0 and {s: r["status"] for s, r in rows.items()} == {"h0": "ok", "h1": "ok", "h2": "ok"}, out + err
    prefill, decode = topo.prefill[0], topo.decode[0]
    assert f"1 in use by this deployment: {prefill.http_port} (prefill-0)" in rows["h0"]["summary"]
    assert f"1 in use by this deployment: {decode.http_port} (decode-0)" in rows["h1"]["summary"]
    assert f"1 in use by this deployment: {topo.router.port} (router)" in rows["h2"]["summary"]

    # Something else listens on prefill-0's side-channel port (its stand-in leaves that port alone).
    address = sshd_cluster.hosts[0].address
    foreign = subprocess.Popen([sys.executable, "-c", f"import socket, time; s = socket.create_server(('{address}', "
                                f"{prefill.side_channel_port})); print('listening', flush=True); time.sleep(120)"],
                               stdout=subprocess.PIPE, text=True)
    try:
        assert foreign.stdout.readline().strip() == "listening"
        code, out, err = run_cli(doctor, capsys)
        rows = {r["subject"]: r for r in json.loads(out)["results"]}
        assert code == 1 and rows["h0"]["status"] == "fail" and rows["h1"]["status"] == "ok", out
        assert rows["h0"]["summary"] == (f"port {prefill.side_channel_port} on host h0 (prefill-0 side channel) is taken by "
                                         f"pid {foreign.pid} (python): Address already in use")
    finally:
        foreign.kill()
        foreign.wait()
