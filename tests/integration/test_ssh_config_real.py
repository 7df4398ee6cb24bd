"""The SSH runner reads ~/.ssh/config as OpenSSH does, against real sshd hosts on loopback:
Include (a glob relative to ~/.ssh, nested), a host reachable only through a ProxyCommand, a
ProxyJump chain whose hops each use their own config, IdentityFile with tokens, and known hosts."""
from __future__ import annotations

import os
import pwd
import shutil
import tempfile
from pathlib import Path

import paramiko
import psutil
import pytest

from kvpush.deploy.runners import HostError, SshOptions, SshRunner
from kvpush.deploy.topology.host_address import HostAddress

pytestmark = pytest.mark.skipif(shutil.which("ssh") is None, reason="needs OpenSSH's client")


def _runner(name: str, config: Path, **options) -> SshRunner:
    return SshRunner(name, HostAddress(address="203.0.113.1", ssh_host=name), SshOptions(config_file=str(config), **options))


def _host_block(cluster, i: int, alias: str, **extra: str) -> str:
    host = cluster.hosts[i]
    lines = {"HostName": host.address, "Port": str(host.port), "User": "root", "IdentityFile": str(cluster.client_key),
             "IdentitiesOnly": "yes", "UserKnownHostsFile": str(cluster.known_hosts), **extra}
    return f"Host {alias}\n" + "".join(f"  {k} {v}\n" for k, v in lines.items())


def _peers() -> set[tuple[str, int]]:
    """Where this test process's own TCP connections go."""
    return {(c.raddr.ip, c.raddr.port) for c in psutil.Process().net_connections(kind="tcp") if c.raddr}


def test_include_of_a_glob_relative_to_dot_ssh_with_a_nested_include(sshd_cluster, tmp_path):
    ssh_dir = Path(pwd.getpwuid(os.getuid()).pw_dir) / ".ssh"  # OpenSSH resolves a relative Include here
    made_ssh_dir = not ssh_dir.exists()
    ssh_dir.mkdir(mode=0o700, exist_ok=True)
    included = Path(tempfile.mkdtemp(prefix="kvpush-test-include-", dir=ssh_dir))
    try:
        port = sshd_cluster.hosts[0].port
        # h0's Port comes from a second, nested Include inside its Host block
        (included / "10-h0.conf").write_text(_host_block(sshd_cluster, 0, "incl-h0").replace(
            f"  Port {port}\n", f"  Include {tmp_path}/nested/*.conf\n"))
        (tmp_path / "nested").mkdir()
        (tmp_path / "nested" / "port.conf").write_text(f"Port {port}\n")
        (included / "20-h1.conf").write_text(_host_block(sshd_cluster, 1, "incl-h1"))
        config = tmp_path / "config"
        config.write_text(f"Include {included.name}/*.conf\n")
        for alias, i in (("incl-h0", 0), ("incl-h1", 1)):
            runner = _runner(alias, config)
            try:
                assert runner.run("echo $SSH_CONNECTION").stdout.split()[2] == sshd_cluster.hosts[i].address
            finally:
                runner.close()
    finally:
        shutil.rmtree(included)
        if made_ssh_dir:
            try:
                ssh_dir.rmdir()
            except OSError:
                pass  # something else was put there meanwhile: not this test's to remove


def test_a_host_reachable_only_through_its_proxy_command(sshd_cluster, tmp_path):
    """The host's name does not resolve here; its ProxyCommand (`ssh -W` through h0, run through the
    user's shell with %h %p %r expanded) is the only way to it."""
    jump, behind = sshd_cluster.hosts[0], sshd_cluster.hosts[1]
    marker = tmp_path / "proxy-ran"
    known = tmp_path / "known_hosts"
    known.write_text(behind.known_hosts_line().replace(f"[{behind.address}]", "[gpu-behind.invalid]"))
    inner = (f"ssh -F /dev/null -i {sshd_cluster.client_key} -o UserKnownHostsFile={sshd_cluster.known_hosts} "
             f"-o StrictHostKeyChecking=yes -o BatchMode=yes -p {jump.port} -W {behind.address}:%p root@{jump.address}")
    config = tmp_path / "config"
    config.write_text(f"""
Host behind
  HostName gpu-behind.invalid
  Port {behind.port}
  User root
  IdentityFile {sshd_cluster.client_key}
  UserKnownHostsFile {known}
  ProxyCommand sh -c 'echo "%h %p %r %n" > {marker} && {inner}'
Host broken
  HostName gpu-behind.invalid
  ProxyCommand sh -c 'echo no route to gpu-behind >&2; exit 3'
""")
    runner = _runner("behind", config)
    try:
        assert runner.run("hostname -I >/dev/null; echo through").stdout == "through\n"
        assert marker.read_text() == f"gpu-behind.invalid {behind.port} root behind\n"
        assert (behind.address, behind.port) not in _peers()  # this process never dialled it
        assert runner.read_file(str(marker)) == marker.read_bytes()  # sftp rides the same proxy
    finally:
        runner.close()
    with pytest.raises(HostError) as caught:
        _runner("broken", config, connect_timeout_s=5).connect()
    message = str(caught.value)
    assert "host broken" in message and "ProxyCommand exited 3 saying: no route to gpu-behind" in message and "\n" not in message


def test_a_proxy_jump_chain_each_hop_with_its_own_config(sshd_cluster, tmp_path):
    config = tmp_path / "config"
    # The target's own block names no key the hops would need; each hop has its own User/IdentityFile/Port.
    config.write_text(_host_block(sshd_cluster, 0, "jump-a") + _host_block(sshd_cluster, 1, "jump-b")
                      + _host_block(sshd_cluster, 2, "deep", ProxyJump="jump-a,jump-b"))
    runner = _runner("deep", config)
    try:
        assert runner.run("echo $SSH_CONNECTION").stdout.split()[2] == sshd_cluster.hosts[2].address
        first = sshd_cluster.hosts[0]
        peers = _peers()
        assert (first.address, first.port) in peers
        assert not {(h.address, h.port) for h in sshd_cluster.hosts[1:]} & peers  # reached only through the hops
        assert [j.name for j in runner._target.jumps] == ["jump-a", "jump-b"]
    finally:
        runner.close()


def test_identity_file_with_tokens(sshd_cluster, tmp_path):
    host = sshd_cluster.hosts[0]
    keys = tmp_path / "keys"
    keys.mkdir()
    shutil.copyfile(sshd_cluster.client_key, keys / f"root_{host.address}_key")
    (keys / f"root_{host.address}_key").chmod(0o600)
    config = tmp_path / "config"
    config.write_text(_host_block(sshd_cluster, 0, "tok").replace(str(sshd_cluster.client_key), f"{keys}/%r_%h_key"))
    runner = _runner("tok", config)
    try:
        assert runner.run("echo keyed").stdout == "keyed\n"
        assert runner._target.key_files == (str(keys / f"root_{host.address}_key"),)
    finally:
        runner.close()


def test_known_hosts_as_the_config_says_and_a_mismatch_refused_in_one_line(sshd_cluster, tmp_path):
    host = sshd_cluster.hosts[1]
    wrong = tmp_path / "wrong_known_hosts"
    other = paramiko.Ed25519Key.from_private_key_file(str(sshd_cluster.client_key))  # any key but the host's
    wrong.write_text(f"[{host.address}]:{host.port} {other.get_name()} {other.get_base64()}\n")
    fresh = tmp_path / "fresh_known_hosts"
    config = tmp_path / "config"
    config.write_text(
        _host_block(sshd_cluster, 1, "mismatch", UserKnownHostsFile=str(wrong), StrictHostKeyChecking="no")
        + _host_block(sshd_cluster, 1, "strict", UserKnownHostsFile=str(fresh), StrictHostKeyChecking="yes")
        + _host_block(sshd_cluster, 1, "tofu", UserKnownHostsFile=str(fresh), StrictHostKeyChecking="accept-new",
                      HashKnownHosts="yes"))
    with pytest.raises(HostError) as caught:  # even StrictHostKeyChecking no: kvpush never accepts a changed key
        _runner("mismatch", config).connect()
    message = str(caught.value)
    assert "\n" not in message and "host key CHANGED" in message and str(wrong) in message
    assert f"ssh-keygen -f {wrong} -R '[{host.address}]:{host.port}'" in message
    with pytest.raises(HostError, match=rf"host key unknown .*not in {fresh}.*--accept-new-host-keys"):
        _runner("strict", config).connect()
    recorder = _runner("tofu", config)
    assert recorder.run("true").ok
    recorder.close()
    line = fresh.read_text()
    assert line.startswith("|1|") and host.address not in line  # hashed, as HashKnownHosts asks
    assert paramiko.HostKeys(str(fresh)).lookup(f"[{host.address}]:{host.port}") is not None
    strict = _runner("strict", config)  # now known
    assert strict.run("true").ok
    strict.close()
