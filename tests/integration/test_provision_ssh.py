"""Provisioning over real SSH: a host whose Python lacks kvpush gets it from `up`; a second `up` installs nothing."""
from __future__ import annotations

import os
import subprocess
import sys
import sysconfig

import pytest

from kvpush.deploy.lifecycle.lifecycle import down, up
from kvpush.deploy.lifecycle.provision import probe
from kvpush.deploy.runners import HostError, SshOptions, SshRunner
from sshd_hosts import topology_for, write_standin_python

from lifecycle_helpers import kill_leftovers, options


@pytest.fixture
def bare_venv(tmp_path):
    """A venv that sees the dev venv's packages (vLLM, pydantic, aiohttp) but not kvpush.

    A .pth line only appends the directory to sys.path, so the dev venv's editable-install hook
    (another .pth inside it) does not run there: kvpush is missing until provisioning installs it.
    """
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    site = subprocess.run([str(venv / "bin/python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    with open(f"{site}/dev-venv.pth", "w") as f:
        f.write(sysconfig.get_paths()["purelib"] + "\n")
    return venv


def test_up_installs_kvpush_once_into_a_host_that_lacks_it(sshd_cluster, bare_venv, tmp_path, state_dir):
    python = write_standin_python(tmp_path / "standin-python", str(bare_venv / "bin/python"))
    topo = topology_for(sshd_cluster, "prov", str(python), tmp_path, prefill=[0], decode=[0], router=0, port_base=19900)
    host = sshd_cluster.hosts[0]
    runner = SshRunner("h0", sshd_cluster.host_address(host), SshOptions(known_hosts=str(sshd_cluster.known_hosts)))
    assert "kvpush.connector" in probe(runner, str(python)).missing
    try:
        first = up(topo, options(sshd_cluster, provision=True))
        assert [(p.host, p.action) for p in first.provisioned] == [("h0", "installed")]
        after = probe(runner, str(python))
        assert after.digest == first.provisioned[0].digest and not after.missing and not after.editable
        second = up(topo, options(sshd_cluster, provision=True))
        assert [(p.host, p.action) for p in second.provisioned] == [("h0", "up-to-date")]
        assert second.changes.nothing_to_do
    finally:
        down("prov", options(sshd_cluster))
        runner.close()
        assert kill_leftovers(str(python)) == []
    # The dev venv's own editable kvpush was not touched.
    import kvpush.deploy

    assert kvpush.deploy.__file__.startswith(str(sysconfig.get_paths()["purelib"])) is False


def test_missing_python_is_one_clear_line(sshd_cluster, tmp_path, state_dir):
    topo = topology_for(sshd_cluster, "nopy", str(tmp_path / "no-such-venv/bin/python"), tmp_path,
                        prefill=[0], decode=[0], router=0, port_base=19950)
    with pytest.raises(Exception, match=r"host h0: python '.*no-such-venv/bin/python' not found"):
        up(topo, options(sshd_cluster, provision=True))


def test_editable_checkout_on_a_host_is_never_overwritten(sshd_cluster, tmp_path):
    host = sshd_cluster.hosts[0]
    runner = SshRunner("h0", sshd_cluster.host_address(host), SshOptions(known_hosts=str(sshd_cluster.known_hosts)))
    from kvpush.deploy.plan.plan import build_plan
    from kvpush.deploy.lifecycle.provision import WheelSource, provision_host

    topo = topology_for(sshd_cluster, "ed", sys.executable, tmp_path, prefill=[0], decode=[0], router=0, port_base=19960)
    with pytest.raises(HostError, match="source checkout .*editable"):
        provision_host(runner, build_plan(topo).hosts[0], "0000000000000000", WheelSource("0000000000000000"))
    runner.close()


def test_python_without_vllm_stack_is_refused_before_installing_anything(sshd_cluster, tmp_path, state_dir):
    base_python = os.path.join(sys.base_prefix, "bin", "python3")  # the interpreter under the dev venv: no vLLM
    topo = topology_for(sshd_cluster, "novllm", base_python, tmp_path, prefill=[0], decode=[0], router=0, port_base=19970)
    with pytest.raises(Exception, match=r"host h0: .*python3.* cannot import .*vllm.*; run `kvpush provision FILE --with-vllm`"):
        up(topo, options(sshd_cluster, provision=True))
    assert not list(tmp_path.glob("h0/novllm/logs/*"))  # nothing was started


def test_provision_command_installs_then_reports_up_to_date(sshd_cluster, bare_venv, tmp_path, state_dir, capsys):
    import yaml

    from kvpush.cli.main import run as cli_run

    python = write_standin_python(tmp_path / "standin-python", str(bare_venv / "bin/python"))
    topo = topology_for(sshd_cluster, "provcli", str(python), tmp_path, prefill=[0], decode=[0], router=0, port_base=19980)
    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump(topo.model_dump(mode="json", exclude_none=True)))
    outputs = []
    for _ in range(2):
        with pytest.raises(SystemExit) as exc:
            cli_run(["provision", str(path), "--known-hosts", str(sshd_cluster.known_hosts)])
        assert exc.value.code in (0, None)
        outputs.append(capsys.readouterr().out)
    assert "host h0: installed" in outputs[0] and "host h0: up-to-date" in outputs[1]
    with pytest.raises(SystemExit) as exc:
        cli_run(["provision", str(path), "--with-vllm", "--known-hosts", str(sshd_cluster.known_hosts)])
    assert exc.value.code == 1 and "--with-vllm needs hosts.h0.venv" in capsys.readouterr().err


# -- runtime packages only: no sudo, no system package manager on the host --------------------------
ROOT_TOOLS = ("sudo", "su", "doas", "apt", "apt-get", "dpkg", "yum", "dnf")


@pytest.fixture(scope="module")
def watched_host(tmp_path_factory):
    """One real sshd host whose sessions find recording stand-ins for sudo and the system package
    managers first on PATH: whatever provisioning runs there, a call to one of them is on record."""
    from sshd_hosts import SshdCluster

    root = tmp_path_factory.mktemp("watched")
    shims, record = root / "shims", root / "root-tool-calls.log"
    shims.mkdir()
    for tool in ROOT_TOOLS:
        (shims / tool).write_text(f'#!/bin/sh\necho "{tool} $*" >> {record}\nexit 1\n')
        (shims / tool).chmod(0o755)

    class WatchedCluster(SshdCluster):
        def _config(self, host):
            # one SetEnv line: sshd takes the first of a keyword
            return super()._config(host).replace("SetEnv SHLVL=1", f"SetEnv SHLVL=1 PATH={shims}:/usr/local/bin:/usr/bin:/bin")

    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
    address = f"127.0.0.{8 + 10 * worker}"  # past this worker's module cluster (127.0.0.2-4, 12-14, ...)
    with WatchedCluster(1, first_address=address, port=2222, root=root / "sshd") as cluster:
        yield cluster, record


def _topology_file(cluster, tmp_path, venv, **top) -> str:
    import yaml

    topo = topology_for(cluster, "rt", str(venv / "bin/python"), tmp_path, prefill=[0], decode=[0], router=0, port_base=19990)
    doc = topo.model_dump(mode="json", exclude_none=True)
    host = doc["hosts"]["h0"]
    del host["python"]
    host["venv"] = str(venv)
    for role, devices in top.pop("devices", {}).items():
        doc[role][0]["devices"] = devices
    doc.update(top)
    path = tmp_path / "rt.yaml"
    path.write_text(yaml.safe_dump(doc))
    return str(path)


def test_provision_with_vllm_runs_no_sudo_and_no_package_manager(watched_host, bare_venv, tmp_path, state_dir):
    from cli_in_process import run_cli

    cluster, record = watched_host
    runner = SshRunner("h0", cluster.host_address(cluster.hosts[0]), SshOptions(known_hosts=str(cluster.known_hosts)))
    assert runner.run("sudo true; apt-get install x").exit_code != 0
    assert record.read_text().splitlines() == ["sudo true", "apt-get install x"]  # the stand-ins are in effect
    record.unlink()
    runner.close()

    path = _topology_file(cluster, tmp_path, bare_venv)
    result = run_cli("provision", path, "--with-vllm", "--known-hosts", str(cluster.known_hosts))
    assert result.returncode == 0, result.stderr
    # the venv sees the dev venv's pinned CPU stack: the installer finds it and installs nothing
    assert "host h0: installed" in result.stdout and "CPU vLLM stack up-to-date" in result.stdout, result.stdout
    assert not record.exists(), record.read_text()


def test_provision_with_vllm_refuses_a_cuda_topology_in_one_line(watched_host, bare_venv, tmp_path, state_dir):
    from cli_in_process import run_cli

    cluster, record = watched_host
    path = _topology_file(cluster, tmp_path, bare_venv, platform="cuda",
                          devices={"prefill": [0], "decode": [1]})
    result = run_cli("provision", path, "--with-vllm", "--known-hosts", str(cluster.known_hosts))
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 2 and len(errors) == 1, result.stderr
    assert "--with-vllm: platform cuda" in errors[0] and "without --with-vllm" in errors[0]
    assert not record.exists()
