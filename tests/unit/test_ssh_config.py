"""The SSH config as OpenSSH reads it (`ssh -G`): HostName, Port, User, IdentityFile, Include,
ProxyJump, ProxyCommand and known hosts settings fill in what the topology leaves out."""
from __future__ import annotations

import getpass
import os
import shutil

import pytest

from kvpush.deploy.topology.host_address import HostAddress
from kvpush.deploy.runners.base import HostError
from kvpush.deploy.runners.options import SshOptions
from kvpush.deploy.runners.ssh_config import resolve

pytestmark = pytest.mark.skipif(shutil.which("ssh") is None, reason="needs OpenSSH's client (ssh -G)")


@pytest.fixture
def keys(tmp_path):
    for name in ("jump_key", "gpu_key", "id_gpu7_ops"):
        (tmp_path / name).write_text("a private key\n")
    return tmp_path


def _options(tmp_path, text: str, **extra) -> SshOptions:
    path = tmp_path / "ssh_config"
    path.write_text(text)
    return SshOptions(config_file=str(path), **extra)


def test_the_topology_wins_and_the_config_fills_the_rest(keys, tmp_path):
    options = _options(tmp_path, f"""
Host gpu7
  HostName 10.0.0.7
  Port 2200
  User ops
  IdentityFile {keys}/gpu_key
""")
    target = resolve(HostAddress(address="10.0.0.7", ssh_host="gpu7"), options)
    assert (target.hostname, target.port, target.user, target.key_files, target.agent) == (
        "10.0.0.7", 2200, "ops", (f"{keys}/gpu_key",), True)
    given = resolve(HostAddress(address="10.0.0.7", ssh_host="gpu7", ssh_port=22, user="root", key="/k"), options)
    assert (given.port, given.user, given.key_files, given.agent) == (22, "root", ("/k",), False)


def test_without_a_config_entry_the_address_port_22_and_this_user(tmp_path):
    target = resolve(HostAddress(address="10.0.0.9"), _options(tmp_path, ""))
    assert (target.hostname, target.port, target.user, target.jumps, target.proxy_command) == (
        "10.0.0.9", 22, getpass.getuser(), (), None)
    assert target.known_hosts_name == "10.0.0.9"


def test_identity_files_take_tokens_and_tilde_and_missing_ones_are_passed_over(keys, tmp_path):
    options = _options(tmp_path, f"""
Host gpu7
  User ops
  IdentityFile {keys}/id_%n_%r
  IdentityFile {keys}/no_such_key
  IdentitiesOnly yes
Host b
  IdentityFile ~/no-such-key-kvpush-test
""")
    a = resolve(HostAddress(address="10.0.0.1", ssh_host="gpu7"), options)
    assert a.key_files == (f"{keys}/id_gpu7_ops",) and not a.agent
    b = resolve(HostAddress(address="10.0.0.2", ssh_host="b"), options)
    assert b.key_files == () and b.agent  # as ssh does: a missing IdentityFile is passed over


def test_include_follows_globs_and_nested_includes(keys, tmp_path):
    (tmp_path / "conf.d").mkdir()
    (tmp_path / "conf.d" / "10-gpu.conf").write_text(f"Host gpu*\n  User ops\n  Include {tmp_path}/nested/*.conf\n")
    (tmp_path / "conf.d" / "20-other.conf").write_text("Host other\n  Port 2300\n")
    (tmp_path / "nested").mkdir()
    (tmp_path / "nested" / "port.conf").write_text("Port 2201\n")
    options = _options(tmp_path, f"Include {tmp_path}/conf.d/*.conf\nHost *\n  HostName 10.9.%h\n")
    gpu = resolve(HostAddress(address="x", ssh_host="gpu1"), options)
    assert (gpu.hostname, gpu.port, gpu.user) == ("10.9.gpu1", 2201, "ops")
    assert resolve(HostAddress(address="x", ssh_host="other"), options).port == 2300


def test_proxy_jump_hops_are_looked_up_in_the_config_in_order(keys, tmp_path):
    options = _options(tmp_path, f"""
Host bastion
  HostName 192.0.2.10
  User jumper
  IdentityFile {keys}/jump_key
Host inner
  HostName 10.1.0.1
  ProxyJump outer.example
Host 10.0.0.*
  ProxyJump bastion,admin@inner:2022
""")
    target = resolve(HostAddress(address="10.0.0.5"), options)
    hops = [(j.name, j.hostname, j.port, j.user) for j in target.jumps]
    assert hops == [("bastion", "192.0.2.10", 22, "jumper"), ("inner", "10.1.0.1", 2022, "admin")]
    assert target.jumps[0].key_files == (f"{keys}/jump_key",)
    assert "via jumper@192.0.2.10:22, admin@10.1.0.1:2022" in target.describe()
    # As with ssh, only the first hop's own ProxyJump applies (inner's is not followed above).
    chained = _options(tmp_path, "Host 10.9.9.9\n  ProxyJump inner\nHost inner\n  ProxyJump outer\n")
    assert [j.name for j in resolve(HostAddress(address="10.9.9.9"), chained).jumps] == ["outer", "inner"]


def test_proxy_command_tokens_are_expanded_as_openssh_does(tmp_path):
    options = _options(tmp_path, "Host gpu\n  HostName 10.2.0.1\n  Port 2022\n  User ops\n"
                                 "  ProxyCommand connect --to %h:%p --as %r --alias %n %%\n")
    target = resolve(HostAddress(address="10.2.0.1", ssh_host="gpu"), options)
    assert target.proxy_command == "connect --to 10.2.0.1:2022 --as ops --alias gpu %"
    assert target.jumps == () and "via ProxyCommand" in target.describe()
    with pytest.raises(HostError, match=r"ProxyCommand for gpu uses the unknown token %z"):
        resolve(HostAddress(address="x", ssh_host="gpu"), _options(tmp_path, "Host gpu\n  ProxyCommand nc %z\n"))


def test_known_hosts_settings_come_from_the_config_unless_kvpush_is_given_a_file(tmp_path):
    options = _options(tmp_path, f"""
Host gpu
  UserKnownHostsFile {tmp_path}/kh_%h {tmp_path}/second
  StrictHostKeyChecking accept-new
  HashKnownHosts yes
  HostKeyAlias gpu-alias
""")
    target = resolve(HostAddress(address="gpu"), options)
    assert target.known_hosts == (f"{tmp_path}/kh_gpu", f"{tmp_path}/second")
    assert (target.strict_host_key_checking, target.hash_known_hosts, target.known_hosts_name) == (
        "accept-new", True, "gpu-alias")
    explicit = resolve(HostAddress(address="gpu"), SshOptions(config_file=options.config_file, known_hosts="/kh"))
    assert explicit.known_hosts == ("/kh",) and explicit.global_known_hosts == ()
    default = resolve(HostAddress(address="other", ssh_port=2222), options)
    assert default.strict_host_key_checking == "ask" and default.known_hosts_name == "[other]:2222"


def test_a_jump_loop_is_a_one_line_error(tmp_path):
    with pytest.raises(HostError, match="ProxyJump for .* goes more than 8 hops deep"):
        resolve(HostAddress(address="a"), _options(tmp_path, "Host a\n  ProxyJump b\nHost b\n  ProxyJump a\n"))
    assert resolve(HostAddress(address="a"), _options(tmp_path, "Host a\n  ProxyJump none\n")).jumps == ()


def test_a_config_ssh_refuses_is_one_line_naming_the_file_and_line(tmp_path):
    (tmp_path / "included.conf").write_text("Host x\n  Port 22\n  NoSuchKeyword yes\n")
    options = _options(tmp_path, f"Host *\n  User me\nInclude {tmp_path}/included.conf\n")
    with pytest.raises(HostError) as caught:
        resolve(HostAddress(address="x"), options)
    message = str(caught.value)
    assert message.startswith(f"{tmp_path}/included.conf: line 3: Bad configuration option: nosuchkeyword; fix or remove")
    assert "\n" not in message and "--ssh-config" not in message
    with pytest.raises(HostError, match=r"ssh_config: line 2: .*fix or remove that line"):
        resolve(HostAddress(address="x"), _options(tmp_path, "Host x\n  Port notanumber\n"))


def test_a_missing_config_file_given_to_kvpush_is_named(tmp_path):
    with pytest.raises(HostError, match=rf"{tmp_path}/missing"):
        resolve(HostAddress(address="x"), SshOptions(config_file=str(tmp_path / "missing")))
    assert os.path.exists(tmp_path)
