"""Killed and stopped processes across real sshd hosts (stand-in servers): the supervisor leaves no
orphans, `status` says what died and what is left, `up` clears leftovers and revives only the dead,
a restart policy revives without `up`."""
from __future__ import annotations

import json
import os
import signal
import socket
import time

import pytest

from kvpush.deploy.lifecycle.lifecycle import up
from kvpush.deploy.lifecycle.observe import deployment_status, require_state
from kvpush.deploy.lifecycle.state import load_state
from lifecycle_helpers import RecordingEvents, options, run_cli, standin_deployments

# The stand-in prefill starts a child on its side-channel port that outlives it, like vLLM's engine core.
ENGINE_CORE = {"prefill-0": {"STANDIN_ENGINE_CORE": "1"}}


@pytest.fixture
def deploy(sshd_cluster, tmp_path, state_dir):
    with standin_deployments(sshd_cluster, tmp_path) as make:
        yield make


def _rows(cluster, name="t"):
    return {r.name: r for r in deployment_status(require_state(name), options(cluster).ssh)}


def _until(what, predicate, timeout_s=20.0):
    end = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < end, f"not within {timeout_s} s: {what}"
        time.sleep(0.1)


def _listening(address: str, port: int) -> bool:
    try:
        socket.create_connection((address, port), timeout=1).close()
        return True
    except ConnectionRefusedError:
        return False


def _wait_for_the_engine_core(cluster, topo) -> None:
    """up() waits for prefill-0's server, not for the child it starts: the stand-in "engine core"
    binds the side channel on its own time."""
    address, port = cluster.hosts[0].address, topo.prefill[0].side_channel_port
    _until("the engine core listens on prefill-0's side channel", lambda: _listening(address, port))


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(p) for p in f.read().split()]


def _pids(cluster) -> dict[str, tuple[int, int]]:
    """Per process: (supervisor pid, the supervised process's pid)."""
    return {r.name: (r.supervisor_pid, r.pid) for r in _rows(cluster).values()}


def test_sigkill_of_an_instance_leaves_nothing_and_up_revives_only_it(deploy, sshd_cluster, capsys):
    topo = deploy(instance_env=ENGINE_CORE)
    up(topo, options(sshd_cluster))
    prefill = topo.prefill[0]
    address = sshd_cluster.hosts[0].address
    before = _pids(sshd_cluster)
    main_pid = before["prefill-0"][1]
    _wait_for_the_engine_core(sshd_cluster, topo)

    os.kill(main_pid, signal.SIGKILL)
    # Shown dead as soon as its supervisor starts cleaning up, before the engine core is stopped and that is recorded.
    row = _until("prefill-0 dead and cleaned up by its supervisor",
                 lambda: (r := _rows(sshd_cluster)["prefill-0"]).process in ("dead", "zombie") and not r.leftovers
                 and "its supervisor stopped pid" in r.error and r)
    assert row.last_exit == "killed by SIGKILL", row
    assert f"pid {main_pid}: killed by SIGKILL" in row.error and "nothing of it is left" in row.error
    assert not _listening(address, prefill.side_channel_port) and not _listening(address, prefill.http_port)

    code, out, err = run_cli(["status", "-d", "t", "--known-hosts", str(sshd_cluster.known_hosts)], capsys)
    assert code == 1 and "prefill-0" in out and ("dead" in out or "zombie" in out)
    assert "prefill-0: died at" in err and "killed by SIGKILL" in err

    result = up(topo, options(sshd_cluster))
    assert result.changes.revive == ["prefill-0"] and sorted(result.changes.keep) == ["decode-0", "router"]
    after = _pids(sshd_cluster)
    assert after["decode-0"] == before["decode-0"] and after["router"] == before["router"]
    assert after["prefill-0"] != before["prefill-0"] and _rows(sshd_cluster)["prefill-0"].restarts == 1


def test_killing_a_supervisor_takes_its_whole_tree_down(deploy, sshd_cluster):
    topo = deploy(instance_env=ENGINE_CORE)
    up(topo, options(sshd_cluster))
    _wait_for_the_engine_core(sshd_cluster, topo)
    supervisor = load_state("t").processes["prefill-0"].pid
    tree = [supervisor, *_children(supervisor)]  # its watcher and the server
    tree += [c for pid in tree[1:] for c in _children(pid)]  # the server's "engine core"
    assert len(tree) == 4
    os.kill(supervisor, signal.SIGKILL)
    _until("every process of prefill-0 gone", lambda: not [p for p in tree if _alive(p)], 10)
    assert not _listening(sshd_cluster.hosts[0].address, topo.prefill[0].side_channel_port)
    assert _rows(sshd_cluster)["prefill-0"].process in ("dead", "zombie")  # zombie until init reaps it


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_leftovers_of_a_dead_process_are_shown_and_up_stops_them_first(deploy, sshd_cluster, capsys):
    """The supervisor and its watcher lost together (as under a process manager's cgroup kill gone wrong):
    the server and its engine core live on, holding both ports."""
    topo = deploy(instance_env=ENGINE_CORE)
    up(topo, options(sshd_cluster))
    _wait_for_the_engine_core(sshd_cluster, topo)
    supervisor = load_state("t").processes["prefill-0"].pid
    status = json.loads(open(load_state("t").processes["prefill-0"].status_path).read())
    os.kill(status["watcher_pid"], signal.SIGSTOP)  # so it cannot act on the supervisor's death
    os.kill(supervisor, signal.SIGKILL)
    os.kill(status["watcher_pid"], signal.SIGKILL)
    row = _until("prefill-0 dead with leftovers", lambda: (r := _rows(sshd_cluster)["prefill-0"]).process in ("dead", "zombie") and r)
    prefill = topo.prefill[0]
    held = {tuple(x["ports"]) for x in row.leftovers}
    assert held == {(prefill.http_port,), (prefill.side_channel_port,)}, row.leftovers
    assert "left behind: pid" in row.error and "`kvpush up` stops them" in row.error

    code, out, _ = run_cli(["status", "-d", "t", "--json", "--known-hosts", str(sshd_cluster.known_hosts)], capsys)
    document = json.loads(out)
    assert code == 1 and [p["name"] for p in document["processes"] if p["leftovers"]] == ["prefill-0"]

    events = RecordingEvents()
    result = up(topo, options(sshd_cluster), events)
    assert result.changes.revive == ["prefill-0"]
    assert sorted(len(what) for what in result.cleared.values()) == [2]
    assert any(n.startswith("stopping what prefill-0 left behind: pid") for n in events.notes)
    assert _rows(sshd_cluster)["prefill-0"].healthy


def test_restart_policy_brings_a_crashed_instance_back_without_up(deploy, sshd_cluster):
    topo = deploy(instance_extra={"decode-0": {"restart": {"policy": "on-failure", "max_restarts": 2, "window_s": 60}}})
    up(topo, options(sshd_cluster))
    supervisor, first = _pids(sshd_cluster)["decode-0"]
    os.kill(first, signal.SIGKILL)
    row = _until("decode-0 restarted and healthy",
                 lambda: (r := _rows(sshd_cluster)["decode-0"]).healthy and r.pid != first and r)
    assert row.supervisor_pid == supervisor and row.restarts == 1 and row.last_exit == "killed by SIGKILL"
    assert up(topo, options(sshd_cluster)).changes.nothing_to_do

    second = row.pid
    os.kill(second, signal.SIGKILL)  # the second restart is allowed
    _until("decode-0 restarted again", lambda: (r := _rows(sshd_cluster)["decode-0"]).healthy and r.pid != second)
    os.kill(_rows(sshd_cluster)["decode-0"].pid, signal.SIGKILL)  # the third failure within 60 s is not restarted
    # Shown dead as soon as its supervisor starts cleaning up, before it records that it gave up.
    row = _until("decode-0 given up",
                 lambda: (r := _rows(sshd_cluster)["decode-0"]).process == "dead" and "gave up after 2 restart(s)" in r.error and r)
    assert row.restarts == 2

    result = up(topo, options(sshd_cluster))
    assert result.changes.revive == ["decode-0"] and _rows(sshd_cluster)["decode-0"].restarts == 3


def test_a_stopped_instance_is_hung_until_it_continues_and_down_still_stops_it(deploy, sshd_cluster, capsys):
    topo = deploy()
    up(topo, options(sshd_cluster))
    pid = _rows(sshd_cluster)["prefill-0"].pid
    os.kill(pid, signal.SIGSTOP)
    try:
        row = _rows(sshd_cluster)["prefill-0"]
        assert row.process == "hung" and row.health == "no answer" and not row.healthy
        assert f"pid {pid} (" in row.error and f"kill -CONT {pid}" in row.error
        code, out, err = run_cli(["status", "-d", "t", "--known-hosts", str(sshd_cluster.known_hosts)], capsys)
        assert code == 1 and "hung" in out and "prefill-0: hung" in err
        assert up(topo, options(sshd_cluster)).changes.nothing_to_do  # hung is not dead: `up` keeps it
    finally:
        os.kill(pid, signal.SIGCONT)
    assert _rows(sshd_cluster)["prefill-0"].healthy

    os.kill(pid, signal.SIGSTOP)
    code, out, _ = run_cli(["down", "-d", "t", "--timeout", "5", "--known-hosts", str(sshd_cluster.known_hosts)], capsys)
    assert code == 0 and "stopped" in out and not _alive(pid)
