"""SshRunner and LocalRunner against real hosts: host keys, timeouts, files, detached processes."""
from __future__ import annotations

import time
from dataclasses import replace

import paramiko
import pytest

from kvpush.deploy.topology.host_address import HostAddress
from kvpush.deploy.runners import HostError, LocalRunner, SshOptions, SshRunner, fan_out


def _runner(cluster, i=0, **opts) -> SshRunner:
    host = cluster.hosts[i]
    opts.setdefault("known_hosts", str(cluster.known_hosts))
    return SshRunner(host.name, cluster.host_address(host), SshOptions(**opts))


def test_unknown_host_key_is_refused_with_the_fix_then_recorded_on_request(sshd_cluster, tmp_path):
    empty = tmp_path / "known_hosts"
    runner = _runner(sshd_cluster, known_hosts=str(empty))
    with pytest.raises(HostError, match=r"host h0 .*: host key unknown .*rerun with --accept-new-host-keys"):
        runner.connect()
    accepting = _runner(sshd_cluster, known_hosts=str(empty), accept_new_host_keys=True)
    assert accepting.run("echo hi").stdout == "hi\n"
    accepting.close()
    host = sshd_cluster.hosts[0]
    recorded = paramiko.HostKeys(str(empty)).lookup(f"[{host.address}]:{host.port}")  # hashed where HashKnownHosts says so
    assert recorded is not None and recorded["ssh-ed25519"].get_base64() == host.known_hosts_line().split()[2]
    assert _runner(sshd_cluster, known_hosts=str(empty)).run("true").ok  # now known


def test_changed_host_key_is_always_refused(sshd_cluster, tmp_path):
    host = sshd_cluster.hosts[2]
    sshd_cluster.rekey(host)
    try:
        for accept in (False, True):
            with pytest.raises(HostError, match=r"host h2 .*host key CHANGED.*ssh-keygen .* -R"):
                _runner(sshd_cluster, 2, accept_new_host_keys=accept).connect()
    finally:
        sshd_cluster.write_known_hosts()


def test_auth_failure_and_refused_and_unreachable(sshd_cluster, tmp_path):
    host = sshd_cluster.hosts[0]
    other_key = tmp_path / "other"
    import subprocess

    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other_key)], check=True)
    bad = SshRunner("h0", replace(sshd_cluster.host_address(host), key=str(other_key)),
                    SshOptions(known_hosts=str(sshd_cluster.known_hosts)))
    with pytest.raises(HostError, match="authentication failed"):
        bad.connect()
    with pytest.raises(HostError, match="connection refused"):
        SshRunner("x", HostAddress(address=host.address, ssh_port=1, user="root")).connect()
    import socket

    with socket.socket() as silent:  # accepts TCP (kernel backlog) but never speaks SSH
        silent.bind((host.address, 0))
        silent.listen(1)
        started = time.monotonic()
        with pytest.raises(HostError, match="SSH handshake failed"):
            SshRunner("y", HostAddress(address=host.address, ssh_port=silent.getsockname()[1], user="root"),
                      SshOptions(connect_timeout_s=0.5)).connect()
        assert time.monotonic() - started < 3


def test_command_timeout_is_bounded(sshd_cluster):
    runner = _runner(sshd_cluster)
    runner.connect()  # so that the clock below times the command, not a handshake a loaded sshd may drag out
    started = time.monotonic()
    with pytest.raises(HostError, match="timed out after 1 s"):
        runner.run("sleep 5", timeout=1)
    assert time.monotonic() - started < 4  # well short of the sleep; the rest is slack for opening the session under load
    assert runner.run("echo still-usable").stdout == "still-usable\n"  # the connection survives


def test_files_are_written_atomically_and_read_back(sshd_cluster, tmp_path):
    runner = _runner(sshd_cluster)
    target = tmp_path / "a" / "b" / "f.txt"
    runner.write_file(str(target), b"one")
    runner.write_file(str(target), b"two")
    assert runner.read_file(str(target)) == b"two" and runner.read_file(str(tmp_path / "none")) is None
    assert sorted(p.name for p in target.parent.iterdir()) == ["f.txt"]
    src = tmp_path / "src.bin"
    src.write_bytes(b"x" * 100_000)
    runner.upload(str(src), str(tmp_path / "up" / "dst.bin"))
    assert (tmp_path / "up" / "dst.bin").read_bytes() == src.read_bytes()


@pytest.mark.parametrize("kind", ["ssh", "local"])
def test_detached_process_survives_the_connection_and_stops_by_group(sshd_cluster, tmp_path, kind):
    runner = _runner(sshd_cluster) if kind == "ssh" else LocalRunner()
    argv = ["bash", "-c", "sleep 300 & sleep 300; echo $MARK"]
    started = runner.start_detached(argv, {"MARK": "~/x"}, str(tmp_path / "cwd"), str(tmp_path / "logs" / "p.log"))
    runner.close()  # the SSH session ends; the process must not
    runner = _runner(sshd_cluster) if kind == "ssh" else LocalRunner()
    info = runner.inspect([started.pid])[started.pid]
    assert info.state == "alive" and info.pgid == started.pid == started.pgid
    assert abs(info.start_time - started.start_time) < 1.5
    deadline = time.monotonic() + 10  # under load bash may not have forked both sleeps yet
    while len([m for m in runner.group_members([started.pgid])[started.pgid] if m.state == "alive"]) < 3:
        assert time.monotonic() < deadline, "expected bash and both sleeps in the process group"
        time.sleep(0.05)
    runner.signal_groups([started.pgid], "KILL")
    deadline = time.monotonic() + 5
    while any(m.state == "alive" for m in runner.group_members([started.pgid])[started.pgid]):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert runner.inspect([started.pid])[started.pid].state in ("dead", "zombie")


def test_fan_out_keeps_results_of_healthy_hosts(sshd_cluster):
    sshd_cluster.stop(sshd_cluster.hosts[1])
    try:
        # The stopped host refuses at once whatever the timeout; the healthy ones get the time a loaded sshd may need.
        runners = [_runner(sshd_cluster, i, connect_timeout_s=10) for i in range(3)]
        results = fan_out(runners, lambda r: r.run("echo ok").stdout.strip(), name=lambda r: r.name)
        assert results["h0"].value == "ok" and results["h2"].value == "ok"
        assert not results["h1"].ok and results["h1"].error.startswith("host h1 (") and "refused" in results["h1"].error
    finally:
        sshd_cluster.restart(sshd_cluster.hosts[1])
