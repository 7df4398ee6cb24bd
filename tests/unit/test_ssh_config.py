"""~/.ssh/config fills in what the topology leaves out: HostName, Port, User, IdentityFile, ProxyJump."""
from __future__ import annotations

import getpass

import paramiko
import pytest

from kvpush.deploy.host_address import HostAddress
from kvpush.deploy.runners.base import HostError
from kvpush.deploy.runners.ssh_config import read_config, resolve


@pytest.fixture
def keys(tmp_path):
    for name in ("jump_key", "gpu_key"):
        (tmp_path / name).write_text("a private key\n")
    return tmp_path


def _config(text: str) -> paramiko.SSHConfig:
    return paramiko.SSHConfig.from_text(text)


def test_the_topology_wins_and_the_config_fills_the_rest(keys):
    config = _config(f"""
Host gpu7
  HostName 10.0.0.7
  Port 2200
  User ops
  IdentityFile {keys}/gpu_key
""")
    target = resolve(HostAddress(address="10.0.0.7", ssh_host="gpu7"), config)
    assert (target.hostname, target.port, target.user, target.key_files, target.agent) == (
        "10.0.0.7", 2200, "ops", (f"{keys}/gpu_key",), True)
    given = resolve(HostAddress(address="10.0.0.7", ssh_host="gpu7", ssh_port=22, user="root", key="/k"), config)
    assert (given.port, given.user, given.key_files, given.agent) == (22, "root", ("/k",), False)


def test_without_a_config_entry_the_address_port_22_and_this_user():
    target = resolve(HostAddress(address="10.0.0.9"), _config(""))
    assert (target.hostname, target.port, target.user, target.key_files, target.jumps) == (
        "10.0.0.9", 22, getpass.getuser(), (), ())


def test_identities_only_and_missing_identity_files(keys):
    config = _config(f"""
Host a
  IdentityFile {keys}/gpu_key
  IdentitiesOnly yes
Host b
  IdentityFile {keys}/no_such_key
""")
    a = resolve(HostAddress(address="10.0.0.1", ssh_host="a"), config)
    assert a.key_files == (f"{keys}/gpu_key",) and not a.agent
    b = resolve(HostAddress(address="10.0.0.2", ssh_host="b"), config)
    assert b.key_files == () and b.agent  # as ssh does: a missing IdentityFile is passed over


def test_proxy_jump_hops_are_looked_up_in_the_config_in_order(keys):
    config = _config(f"""
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
    target = resolve(HostAddress(address="10.0.0.5"), config)
    hops = [(j.name, j.hostname, j.port, j.user) for j in target.jumps]
    assert hops == [("bastion", "192.0.2.10", 22, "jumper"), ("inner", "10.1.0.1", 2022, "admin")]
    assert target.jumps[0].key_files == (f"{keys}/jump_key",)
    assert "via jumper@192.0.2.10:22, admin@10.1.0.1:2022" in target.describe()
    # As with ssh, only the first hop's own ProxyJump applies (inner's is not followed above).
    chained = _config("Host 10.9.9.9\n  ProxyJump inner\nHost inner\n  ProxyJump outer\n")
    assert [j.name for j in resolve(HostAddress(address="10.9.9.9"), chained).jumps] == ["outer", "inner"]


def test_a_jump_loop_and_proxy_command_are_one_line_errors():
    with pytest.raises(HostError, match="ProxyJump for .* goes more than 8 hops deep"):
        resolve(HostAddress(address="a"), _config("Host a\n  ProxyJump b\nHost b\n  ProxyJump a\n"))
    with pytest.raises(HostError, match="ProxyCommand for a is not supported by kvpush; reach the host with ProxyJump"):
        resolve(HostAddress(address="a"), _config("Host a\n  ProxyCommand nc %h %p\n"))
    assert resolve(HostAddress(address="a"), _config("Host a\n  ProxyJump none\n")).jumps == ()


def test_reading_the_config(tmp_path):
    assert read_config(str(tmp_path / "missing")).lookup("x") == {"hostname": "x"}
    (tmp_path / "config").write_text("Host x\n  Port notanumber\n")
    with pytest.raises(HostError, match="Port for x is 'notanumber', not a number"):
        resolve(HostAddress(address="x"), read_config(str(tmp_path / "config")), str(tmp_path / "config"))
