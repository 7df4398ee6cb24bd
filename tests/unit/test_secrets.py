"""kvpush.deploy.lifecycle.secrets: the secret kept on this machine, the router's client key, the files `up`
writes on the hosts (here: this machine through LocalRunner) and what a changed file restarts."""
from __future__ import annotations

import stat

import pytest

from kvpush.common import deployment_secret as ds
from kvpush.common.errors import KvpushError, UsageError
from kvpush.deploy.lifecycle.changes import Changes
from kvpush.deploy.plan.plan import build_plan
from kvpush.deploy.runners.local import LocalRunner
from kvpush.deploy.lifecycle.secrets import (AccessKeys, SecretDelivery, client_api_key, ensure_local_secret, kept_secret,
                                   local_secret_path, observed_keys, restart_users_of, write_private_file)
from kvpush.deploy.topology.topology import parse_topology


def _topology(tmp_path, router: str = "", connector: str = "kvpush"):
    return parse_topology(f"""
name: t
model: {{path: /m}}
connector: {{type: {connector}}}
hosts:
  a: {{address: 10.0.0.1, workdir: {tmp_path}/a}}
  b: {{address: 10.0.0.2, workdir: {tmp_path}/b}}
  c: {{address: 10.0.0.3, workdir: {tmp_path}/c}}
prefill: [{{host: a}}]
decode: [{{host: b}}]
router: {{host: c{router}}}
""")


class RecordingRunner(LocalRunner):
    """This machine, remembering each command and what it was given on stdin."""

    def __init__(self):
        super().__init__("rec")
        self.commands: list[tuple[str, bytes | None]] = []

    def run(self, command, timeout=None, stdin=None):
        self.commands.append((command, stdin))
        return super().run(command, timeout, stdin)


def test_the_kept_secret_is_made_once_0600_and_replaced_only_on_rotation(state_dir):
    secret, made = ensure_local_secret("t")
    path = local_secret_path("t")
    assert made and stat.S_IMODE(path.stat().st_mode) == 0o600 and path.parent == state_dir
    assert ensure_local_secret("t") == (secret, False) and kept_secret("t") == secret
    rotated, made = ensure_local_secret("t", rotate=True)
    assert made and rotated != secret and kept_secret("t") == rotated
    assert kept_secret("other") is None


def test_a_corrupt_kept_secret_is_one_line_naming_the_way_out(state_dir):
    state_dir.mkdir()
    local_secret_path("t").write_text("garbage")
    local_secret_path("t").chmod(0o600)
    with pytest.raises(KvpushError, match=r"t\.secret: not a kvpush deployment secret .*kvpush up --rotate-secret"):
        ensure_local_secret("t")
    assert ensure_local_secret("t", rotate=True)[1]


def test_the_client_key_comes_from_this_machines_environment_or_file(tmp_path, monkeypatch):
    assert client_api_key(_topology(tmp_path)) is None
    topo = _topology(tmp_path, ", api_key_env: T_KEY")
    monkeypatch.delenv("T_KEY", raising=False)
    with pytest.raises(UsageError, match="router.api_key_env: T_KEY is unset or empty on this machine"):
        client_api_key(topo)
    monkeypatch.setenv("T_KEY", "abc")
    assert client_api_key(topo) == "abc"
    monkeypatch.setenv("T_KEY", "a b\r\nX-Evil: 1")
    with pytest.raises(UsageError, match="printable ASCII without spaces"):
        client_api_key(topo)
    key_file = tmp_path / "key"
    key_file.write_text("from-file\n")
    key_file.chmod(0o600)
    assert client_api_key(_topology(tmp_path, f", api_key_file: {key_file}")) == "from-file"
    with pytest.raises(UsageError, match=f"router.api_key_file: {tmp_path}/nope: no such key file"):
        client_api_key(_topology(tmp_path, f", api_key_file: {tmp_path}/nope"))


def test_each_role_gets_its_own_key():
    keys = AccessKeys.of(bytes(32), "client")
    assert keys.headers("router") == {"Authorization": "Bearer client"}
    assert keys.headers("decode") == {"Authorization": f"Bearer {ds.derive_token(bytes(32), ds.INSTANCE_API_KEY)}"}
    assert AccessKeys().headers("router") == {} and AccessKeys().headers("prefill") == {}


def test_observing_never_fails_for_a_missing_key(tmp_path, state_dir, monkeypatch):
    monkeypatch.delenv("T_KEY", raising=False)
    assert observed_keys("t", _topology(tmp_path, ", api_key_env: T_KEY")) == AccessKeys()
    secret, _ = ensure_local_secret("t")
    assert observed_keys("t", None) == AccessKeys.of(secret, None)


def test_a_private_file_is_0600_and_its_content_travels_on_stdin_only(tmp_path):
    runner = RecordingRunner()
    target = tmp_path / "new" / "dir" / "s.key"
    write_private_file(runner, str(target), b"very-secret-value\n")
    assert target.read_bytes() == b"very-secret-value\n" and stat.S_IMODE(target.stat().st_mode) == 0o600
    (command, stdin), = runner.commands
    assert "very-secret-value" not in command and stdin == b"very-secret-value\n"
    write_private_file(runner, str(target), b"second\n")
    assert target.read_bytes() == b"second\n" and [p.name for p in target.parent.iterdir()] == ["s.key"]


def test_the_plan_names_secret_files_per_host_and_up_writes_what_it_names(tmp_path):
    plan = build_plan(_topology(tmp_path, ", api_key_env: T_KEY"))
    kinds = {h.name: {f.kind: f.used_by for f in h.secret_files} for h in plan.hosts}
    assert kinds == {
        "a": {"deployment-secret": ["prefill-0"], "instance-env": ["prefill-0"]},
        "b": {"deployment-secret": ["decode-0"], "instance-env": ["decode-0"]},
        "c": {"deployment-secret": [], "router-upstream-key": ["router"], "router-params-key": ["router"], "router-client-key": ["router"]},
    }
    secret = ds.new_secret()
    keys = AccessKeys.of(secret, "client-key")
    delivery = SecretDelivery(plan, secret, keys)
    runners = {h: LocalRunner(h) for h in "abc"}
    stale = delivery.stale(runners)
    assert {h: len(files) for h, files in stale.items()} == {"a": 2, "b": 2, "c": 4}  # nothing written yet
    delivery.write(runners, stale)
    assert delivery.stale(runners) == {"a": [], "b": [], "c": []}
    assert ds.read_secret(tmp_path / "a" / "t" / "deployment.secret") == secret
    assert (tmp_path / "b" / "t" / "instance-api-key.env").read_text() == f"VLLM_API_KEY={keys.instance}\n"
    assert ds.read_key_file(tmp_path / "c" / "t" / "router-upstream.key") == keys.instance
    assert ds.read_key_file(tmp_path / "c" / "t" / "router-client.key") == "client-key"
    assert {stat.S_IMODE(p.stat().st_mode) for p in tmp_path.glob("*/t/*")} == {0o600}

    rotated = SecretDelivery(plan, ds.new_secret(), AccessKeys.of(ds.new_secret(), "client-key"))
    changes = Changes(keep=["prefill-0", "decode-0", "router"])
    assert sorted(restart_users_of(rotated.stale(runners), changes)) == ["decode-0", "prefill-0", "router"]
    assert changes.keep == [] and sorted(changes.restart) == ["decode-0", "prefill-0", "router"]

    new_client = SecretDelivery(plan, secret, AccessKeys.of(secret, "another-client-key"))
    changes = Changes(keep=["prefill-0", "decode-0", "router"], start=["x"])
    assert restart_users_of(new_client.stale(runners), changes) == ["router"]
    assert changes.keep == ["prefill-0", "decode-0"] and changes.start == ["x"]


def test_vllms_own_connectors_do_not_restart_for_a_secret_they_never_read(tmp_path):
    plan = build_plan(_topology(tmp_path, connector="nixl-pull"))
    assert {h.name: [f.used_by for f in h.secret_files if f.kind == "deployment-secret"] for h in plan.hosts} == \
        {"a": [[]], "b": [[]], "c": [[]]}


# -- the topology's secrets ------------------------------------------------------------------------


def _sources(**kinds):
    from kvpush.deploy.topology.topology_schema import SecretSource

    return {name: SecretSource(**{how: where}) for name, (how, where) in kinds.items()}


def test_the_topologys_secrets_are_read_here_from_the_environment_or_a_private_file(tmp_path, monkeypatch):
    from kvpush.deploy.lifecycle.secrets import read_user_secrets

    monkeypatch.setenv("HF_HERE", "hf value")
    value_file = tmp_path / "db"
    value_file.write_text("line one\nline two\r\n")
    value_file.chmod(0o600)
    assert read_user_secrets(_sources(HF_TOKEN=("env", "HF_HERE"), DB=("file", str(value_file)))) == \
        {"HF_TOKEN": "hf value", "DB": "line one\nline two"}  # one trailing newline dropped, nothing else


@pytest.mark.parametrize("setup,message", [
    ("unset", r"^secrets\.S: UNSET_HERE is unset or empty on this machine; export it here \(kvpush delivers it"),
    ("missing", r"^secrets\.S: .*/nofile: no such secret file; give the path of a file on this machine$"),
    ("open", r"^secrets\.S: .*/open: the secret file is readable by other users \(mode 0644\); run `chmod 600"),
    ("empty", r"^secrets\.S: .*/empty is empty; put the value in it$"),
])
def test_a_secret_that_cannot_be_read_is_one_line_naming_it_and_never_a_value(tmp_path, monkeypatch, setup, message):
    from kvpush.deploy.lifecycle.secrets import read_user_secrets

    monkeypatch.delenv("UNSET_HERE", raising=False)
    (tmp_path / "open").write_text("value-of-an-open-file")
    (tmp_path / "open").chmod(0o644)
    (tmp_path / "empty").write_text("\n")
    (tmp_path / "empty").chmod(0o600)
    source = {"unset": ("env", "UNSET_HERE"), "missing": ("file", str(tmp_path / "nofile")),
              "open": ("file", str(tmp_path / "open")), "empty": ("file", str(tmp_path / "empty"))}[setup]
    with pytest.raises(UsageError, match=message) as caught:
        read_user_secrets(_sources(S=source))
    assert "value-of-an-open-file" not in str(caught.value)


def test_the_instances_env_file_gives_a_shell_exactly_the_values(tmp_path):
    import subprocess

    from kvpush.deploy.lifecycle.secrets import instance_env_text

    values = {"A": "it's $(not run) `either` \\ \"quoted\"", "B": "two\nlines", "C": "x=y; echo injected"}
    env_file = tmp_path / "env"
    env_file.write_text(instance_env_text("k" * 64, values))
    printed = subprocess.run(["sh", "-c", f'set -a; . "{env_file}"; printf "%s\\0" "$VLLM_API_KEY" "$A" "$B" "$C"'],
                             env={"PATH": "/usr/bin:/bin"}, capture_output=True, text=True, check=True).stdout
    assert printed.split("\0")[:-1] == ["k" * 64, values["A"], values["B"], values["C"]]


def test_up_writes_the_secrets_into_each_instances_env_file_and_a_new_value_restarts_the_instances(tmp_path):
    topo = _topology(tmp_path).model_copy(update={"secrets": _sources(HF_TOKEN=("env", "X"))})
    plan = build_plan(topo)
    assert plan.process("prefill-0").env_file_names == ["VLLM_API_KEY", "HF_TOKEN"]
    secret = ds.new_secret()
    keys = AccessKeys.of(secret, None)
    runners = {h: LocalRunner(h) for h in "abc"}
    delivery = SecretDelivery(plan, secret, keys, {"HF_TOKEN": "first"})
    delivery.write(runners, delivery.stale(runners))
    assert (tmp_path / "a" / "t" / "instance-api-key.env").read_text() == f"VLLM_API_KEY={keys.instance}\nHF_TOKEN=first\n"
    assert not (tmp_path / "c" / "t" / "instance-api-key.env").exists()  # the router gets none
    changes = Changes(keep=["prefill-0", "decode-0", "router"])
    assert sorted(restart_users_of(SecretDelivery(plan, secret, keys, {"HF_TOKEN": "second"}).stale(runners), changes)) == \
        ["decode-0", "prefill-0"]
