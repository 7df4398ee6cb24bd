"""The deployment secret and the keys made from it, over real sshd hosts with stand-in servers.

The stand-ins check keys as vLLM and the router do (tests/standin_server.py), and every "host" runs
on this machine, so one scan of /proc sees every process of every host.
"""
from __future__ import annotations

import json
import stat
import threading
import time
from pathlib import Path

import pytest

from kvpush.common import deployment_secret as ds
from kvpush.deploy.lifecycle.hosts import connected
from kvpush.deploy.lifecycle.lifecycle import down, up
from kvpush.deploy.lifecycle.secrets import local_secret_path
from kvpush.deploy.lifecycle.state import load_state
from sshd_hosts import topology_for, write_standin_python

from lifecycle_helpers import kill_leftovers, options, processes_under, run_cli

PORT_BASE = 20000  # 20000-20019, 20020-20039 and 20040-20059
CLIENT_KEY = "client-key-for-the-test-0123456789"
KEY_VARIABLE = "KVPUSH_TEST_ROUTER_KEY"


class ArgvScanner:
    """Reads every process's argv (/proc/*/cmdline) in a loop, remembering any that holds a needle.

    The secret is made by `up` while the scan runs: it is read from the state directory as soon as
    it exists, and the keys made from it are added then."""

    def __init__(self, deployment: str, fixed: list[str]):
        self.deployment, self.needles, self.hits = deployment, list(fixed), []
        self.scans = 0
        self.secret_known = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _add_secret_needles(self) -> None:
        path = local_secret_path(self.deployment)
        if self.secret_known or not path.exists():
            return
        secret = ds.read_secret(path)
        self.needles += [secret.hex(), ds.derive_token(secret, ds.INSTANCE_API_KEY), ds.derive_token(secret, ds.SIDE_CHANNEL)]
        self.secret_known = True

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._add_secret_needles()
            for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
                try:
                    text = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
                except OSError:
                    continue
                if any(n in text for n in self.needles):
                    self.hits.append(text[:300])
            self.scans += 1

    def __enter__(self) -> "ArgvScanner":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(10)


@pytest.fixture
def keyed(sshd_cluster, tmp_path, state_dir, monkeypatch):
    """A 3-host stand-in deployment whose router takes a key from this machine's environment."""
    monkeypatch.setenv(KEY_VARIABLE, CLIENT_KEY)
    python = str(write_standin_python(tmp_path / "standin-python"))
    topo = topology_for(sshd_cluster, "sec", python, tmp_path, prefill=[0], decode=[1], router=2, port_base=PORT_BASE,
                        connector="kvpush", extra={"router": {"api_key_env": KEY_VARIABLE}})
    yield topo
    down(topo.name, options(sshd_cluster))
    left = kill_leftovers(python)
    assert not left, f"processes left behind: {[p.pid for p in left]}"


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)



def test_secret_lands_0600_on_every_host_and_in_no_argv_and_keys_guard_router_and_instances(keyed, sshd_cluster, tmp_path, capsys):
    topo = keyed
    with ArgvScanner(topo.name, [CLIENT_KEY]) as scanner:
        result = up(topo, options(sshd_cluster))
        assert result.proof is not None and result.proof.external_kv_tokens > 0  # the proof carried the router's key
        # While it runs: the stand-ins hold the keys, the launch commands are gone.
        deadline = time.monotonic() + 1.0
        scans = scanner.scans
        while scanner.scans < scans + 3 or time.monotonic() < deadline:
            time.sleep(0.05)
    assert scanner.secret_known and scanner.scans > 10 and scanner.hits == [], scanner.hits

    secret = ds.read_secret(local_secret_path(topo.name))
    assert _mode(local_secret_path(topo.name)) == 0o600
    instance_key = ds.derive_token(secret, ds.INSTANCE_API_KEY)
    for host in ("h0", "h1", "h2"):
        secret_file = tmp_path / host / "sec" / "deployment.secret"
        assert _mode(secret_file) == 0o600 and ds.read_secret(secret_file) == secret
    for host in ("h0", "h1"):
        env_file = tmp_path / host / "sec" / "instance-api-key.env"
        assert _mode(env_file) == 0o600 and env_file.read_text() == f"VLLM_API_KEY={instance_key}\n"
    router_dir = tmp_path / "h2" / "sec"
    assert ds.read_key_file(router_dir / "router-upstream.key") == instance_key
    assert ds.read_key_file(router_dir / "router-client.key") == CLIENT_KEY
    assert {_mode(router_dir / n) for n in ("router-upstream.key", "router-client.key")} == {0o600}
    assert not (tmp_path / "h2" / "sec" / "instance-api-key.env").exists()  # the router's host runs no vLLM

    state = load_state(topo.name)
    router, decode = state.processes["router"], state.processes["decode-0"]
    body = json.dumps({"model": "tiny", "prompt": "a b c", "max_tokens": 2}).encode()
    router_url = router.base_url + "/v1/completions"
    decode_url = decode.base_url + "/v1/completions"
    with connected(state.hosts, options(sshd_cluster).ssh) as (runners, _):
        assert runners["h2"].http("POST", router_url, body).status == 401
        assert runners["h2"].http("POST", router_url, body, headers={"Authorization": "Bearer wrong"}).status == 401
        assert runners["h2"].http("POST", router_url, body, headers={"Authorization": f"Bearer {CLIENT_KEY}"}).status == 200
        assert runners["h1"].http("POST", decode_url, body).status == 401  # only the router and kvpush reach vLLM
        assert runners["h1"].http("POST", decode_url, body, headers={"Authorization": f"Bearer {CLIENT_KEY}"}).status == 401
        assert runners["h1"].http("POST", decode_url, body, headers={"Authorization": f"Bearer {instance_key}"}).status == 200

    topology_file = tmp_path / "sec.yaml"
    topology_file.write_text(json.dumps(topo.model_dump(mode="json", exclude_none=True)))
    for args in (["plan", str(topology_file)], ["plan", str(topology_file), "--json"]):
        code, out, _ = run_cli(args, capsys)
        assert code == 0 and "deployment.secret" in out
        assert not [n for n in (secret.hex(), instance_key, CLIENT_KEY) if n in out]
    code, out, err = run_cli(["status", str(topology_file), "--json", "--known-hosts", str(sshd_cluster.known_hosts)], capsys)
    assert code == 0 and json.loads(out)["healthy"], err
    for log in tmp_path.glob("h*/sec/logs/*.log"):
        text = log.read_text(errors="replace")
        assert secret.hex() not in text and instance_key not in text and CLIENT_KEY not in text, log


def test_rotating_the_secret_restarts_every_process_and_a_new_client_key_only_the_router(keyed, sshd_cluster, tmp_path,
                                                                                          capsys, monkeypatch):
    topo = keyed
    up(topo, options(sshd_cluster))
    first_secret = ds.read_secret(local_secret_path(topo.name))
    pids = {n: r.pid for n, r in load_state(topo.name).processes.items()}

    topology_file = tmp_path / "sec.yaml"
    topology_file.write_text(json.dumps(topo.model_dump(mode="json", exclude_none=True)))
    code, out, err = run_cli(["up", str(topology_file), "--rotate-secret", "--no-provision", "--skip-doctor", "--timeout", "60",
                           "--known-hosts", str(sshd_cluster.known_hosts)], capsys)
    assert code == 0 and "decode received" in out, err
    second_secret = ds.read_secret(local_secret_path(topo.name))
    assert second_secret != first_secret and "deployment secret: made a new one" in err
    for host in ("h0", "h1", "h2"):
        assert ds.read_secret(tmp_path / host / "sec" / "deployment.secret") == second_secret
    rotated = {n: r.pid for n, r in load_state(topo.name).processes.items()}
    assert all(rotated[n] != pids[n] for n in pids), (pids, rotated)

    unchanged = up(topo, options(sshd_cluster))
    assert unchanged.changes.nothing_to_do  # the same secret and keys: nothing restarts

    monkeypatch.setenv(KEY_VARIABLE, CLIENT_KEY + "-new")
    result = up(topo, options(sshd_cluster))
    assert result.changes.restart == ["router"] and sorted(result.changes.keep) == ["decode-0", "prefill-0"]
    assert ds.read_key_file(tmp_path / "h2" / "sec" / "router-client.key") == CLIENT_KEY + "-new"
    assert ds.read_secret(local_secret_path(topo.name)) == second_secret


def test_an_unset_router_key_variable_is_bad_input_before_anything_starts(keyed, sshd_cluster, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv(KEY_VARIABLE)
    topology_file = tmp_path / "sec.yaml"
    topology_file.write_text(json.dumps(keyed.model_dump(mode="json", exclude_none=True)))
    code, _, err = run_cli(["up", str(topology_file), "--no-provision", "--skip-doctor", "--known-hosts", str(sshd_cluster.known_hosts)],
                        capsys)
    assert code == 2 and f"router.api_key_env: {KEY_VARIABLE} is unset or empty on this machine" in err
    assert processes_under(str(tmp_path / "standin-python")) == [] and not local_secret_path(keyed.name).exists()


HF_VARIABLE = "KVPUSH_TEST_HF_SOURCE"
HF_VALUE = "hf-secret-from-the-env-7c1d"
DB_VALUE = "db 'secret' from a $(file) 9e2b"


def _environ_of(pid: int) -> dict[str, str]:
    entries = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(e.decode(errors="replace").split("=", 1) for e in entries if b"=" in e)


def _standin_instances(python: str) -> dict[str, dict[str, str]]:
    """The environment of each running stand-in vLLM process, by its --port."""
    found = {}
    for proc in processes_under(python):
        argv = proc.cmdline()
        if "vllm.entrypoints.openai.api_server" in argv:
            found[argv[argv.index("--port") + 1]] = _environ_of(proc.pid)
    return found


def test_the_topologys_secrets_reach_each_instance_and_no_output_argv_log_or_state(sshd_cluster, tmp_path, state_dir,
                                                                                   capsys, monkeypatch):
    monkeypatch.setenv(HF_VARIABLE, HF_VALUE)
    db_file = tmp_path / "db.secret"
    db_file.write_text(DB_VALUE + "\n")
    db_file.chmod(0o600)
    python = str(write_standin_python(tmp_path / "standin-python"))
    topo = topology_for(sshd_cluster, "usersec", python, tmp_path, prefill=[0], decode=[1], router=2, port_base=PORT_BASE + 40,
                        connector="kvpush", extra={"secrets": {"HF_TOKEN": {"env": HF_VARIABLE}, "DB_PASSWORD": {"file": str(db_file)}}})
    topology_file = tmp_path / "usersec.yaml"
    topology_file.write_text(json.dumps(topo.model_dump(mode="json", exclude_none=True)))
    known = ["--known-hosts", str(sshd_cluster.known_hosts)]
    outputs = []
    try:
        with ArgvScanner(topo.name, [HF_VALUE, DB_VALUE]) as scanner:
            code, out, err = run_cli(["up", str(topology_file), "--no-provision", "--skip-doctor", "--timeout", "60", *known], capsys)
            assert code == 0 and "decode received" in out, err
            outputs.append(out + err)
        assert scanner.scans > 10 and scanner.hits == [], scanner.hits

        # Each instance's process has both values in its environment; the router's has neither.
        state = load_state(topo.name)
        seen = _standin_instances(python)
        ports = {name: str(state.processes[name].http_port) for name in ("prefill-0", "decode-0")}
        for port in ports.values():
            assert seen[port]["HF_TOKEN"] == HF_VALUE and seen[port]["DB_PASSWORD"] == DB_VALUE
        router_pid = state.processes["router"].pid
        assert "HF_TOKEN" not in _environ_of(router_pid) and "DB_PASSWORD" not in _environ_of(router_pid)
        env_file = tmp_path / "h0" / "usersec" / "instance-api-key.env"
        assert _mode(env_file) == 0o600

        for args in (["plan", str(topology_file)], ["plan", str(topology_file), "--json"],
                     ["status", str(topology_file), *known], ["status", str(topology_file), "--json", *known],
                     ["logs", "-d", topo.name, "-n", "200", *known], ["ls"]):
            code, out, err = run_cli(args, capsys)
            assert code == 0, (args, err)
            outputs.append(out + err)
        assert "HF_TOKEN" in outputs[1] and "DB_PASSWORD" in outputs[1]  # plan names them

        # A new value is delivered and restarts the instances (the router reads none).
        monkeypatch.setenv(HF_VARIABLE, HF_VALUE + "-rotated")
        code, out, err = run_cli(["up", str(topology_file), "--no-provision", "--skip-doctor", "--timeout", "60", *known], capsys)
        assert code == 0, err
        outputs.append(out + err)
        rotated = load_state(topo.name)
        assert rotated.processes["router"].pid == router_pid
        assert all(rotated.processes[n].pid != state.processes[n].pid for n in ports)
        assert {e["HF_TOKEN"] for e in _standin_instances(python).values()} == {HF_VALUE + "-rotated"}

        # A secret that cannot be read is one line naming it, and nothing else.
        db_file.chmod(0o644)
        code, out, err = run_cli(["up", str(topology_file), "--no-provision", "--skip-doctor", *known], capsys)
        assert code == 2 and err.strip().splitlines()[-1].startswith("error: secrets.DB_PASSWORD: ") and "chmod 600" in err
        outputs.append(out + err)
    finally:
        code, out, err = run_cli(["down", "-d", topo.name, *known], capsys)
        outputs.append(out + err)
        left = kill_leftovers(python)
    assert code == 0 and not left
    texts = outputs + [p.read_text(errors="replace") for p in tmp_path.glob("h*/usersec/logs/*.log*")]
    texts += [p.read_text(errors="replace") for p in state_dir.rglob("*") if p.is_file()]
    assert len(texts) > 12
    leaked = [t[:200] for t in texts if HF_VALUE in t or DB_VALUE in t or "secret' from a" in t]
    assert leaked == []
    assert not env_file.exists()  # down removes it with the other secret files


def test_down_removes_the_secret_files_from_every_host_and_keeps_this_machine_s_secret_unless_asked(keyed, sshd_cluster,
                                                                                                    tmp_path, capsys):
    topo = keyed
    up(topo, options(sshd_cluster))
    secret = ds.read_secret(local_secret_path(topo.name))
    on_hosts = sorted(tmp_path.glob("h*/sec/*.secret")) + sorted(tmp_path.glob("h*/sec/*.key")) + sorted(tmp_path.glob("h*/sec/*.env"))
    assert len(on_hosts) == 8, on_hosts  # the secret on 3 hosts, 2 instance env files, the router's 3 keys (upstream, client, params)

    known = ["--known-hosts", str(sshd_cluster.known_hosts)]
    code, out, err = run_cli(["down", "-d", topo.name, *known], capsys)
    assert code == 0, err
    assert "sec: stopped" in out and "sec: removed its secret files on h0, h1, h2" in out
    assert [p for p in on_hosts if p.exists()] == [] and (tmp_path / "h0" / "sec" / "logs").is_dir()  # only the secrets go
    assert ds.read_secret(local_secret_path(topo.name)) == secret  # kept: the next `up` gives the same keys

    up(topo, options(sshd_cluster))
    assert ds.read_secret(tmp_path / "h1" / "sec" / "deployment.secret") == secret
    code, out, err = run_cli(["down", "-d", topo.name, "--forget-secret", *known], capsys)
    assert code == 0 and "deleted the deployment secret kept on this machine" in out, err
    assert not local_secret_path(topo.name).exists() and not list(tmp_path.glob("h*/sec/deployment.secret"))
