"""`kvpush doctor` for real: loopback sshd hosts, real tools, real NIXL, real sockets.

No GPU and no EFA here: on the CPU topology every check that applies must pass; on a P5en-like
topology the GPU/EFA/LIBFABRIC checks must fail with their remedies.
"""
from __future__ import annotations

import json
import os
import shutil
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from kvpush.deploy.doctor import DoctorOptions, Status, run_doctor
from kvpush.deploy.doctor.check_accelerators import bf16_is_emulated
from kvpush.deploy.doctor.facts_probe import cpu_flags
from kvpush.deploy.plan.plan import build_plan
from kvpush.deploy.runners import SshOptions, SshRunner
from kvpush.deploy.topology.topology import parse_topology

SSHD_FIRST = os.environ.get("KVPUSH_DOCTOR_SSHD_FIRST", "127.0.1.2")
PORT_BASE = int(os.environ.get("KVPUSH_DOCTOR_PORT_BASE", "16000"))
UCX_ENV = {"UCX_MODULES": "^ib", "UCX_MEM_EVENTS": "no", "NIXL_LOG_LEVEL": "WARN"}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from sshd_hosts import SshdCluster

    with SshdCluster(3, first_address=SSHD_FIRST, port=2222, root=tmp_path_factory.mktemp("sshd")) as c:
        yield c


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    from kvpush.deploy.lifecycle.tiny_model import make_tiny_model
    from kvpush.deploy.topology.topology import TinyModelSpec

    path = tmp_path_factory.mktemp("model") / "tiny"
    make_tiny_model(path, TinyModelSpec())
    return path


def host_entry(c, i: int, workdir: Path) -> dict:
    return {**c.host_yaml(c.hosts[i]), "python": sys.executable, "workdir": str(workdir / f"h{i}")}


def cpu_topology(c, workdir: Path, model: Path, port_base: int, **over) -> dict:
    hosts = {f"h{i}": host_entry(c, i, workdir) for i in range(3)}
    return {
        "name": "doctor-test", "platform": "cpu",
        "model": {"path": str(model), "served_name": "tiny", "max_model_len": 2048},
        "connector": {"type": "kvpush", "backend": "UCX"},
        "hosts": hosts,
        "prefill": [{"host": "h0", "http_port": port_base, "side_channel_port": port_base + 1, "kv_cache_gib": 1}],
        "decode": [{"host": "h1", "http_port": port_base + 2, "side_channel_port": port_base + 3, "kv_cache_gib": 1}],
        "router": {"host": "h2", "bind": c.hosts[2].address, "port": port_base + 4},
        "env": UCX_ENV, **over,
    }


def runners(topo, known_hosts: dict[str, str]):
    return {h.name: SshRunner(h.name, h, SshOptions(known_hosts=known_hosts[h.name]))
            for h in build_plan(topo).hosts}


def doctor(doc: dict, known_hosts: dict[str, str], **options):
    topo = parse_topology(yaml.safe_dump(doc), "<doctor test>")
    rs = runners(topo, known_hosts)
    try:
        return run_doctor(topo, rs, DoctorOptions(**options))
    finally:
        for r in rs.values():
            r.close()


def by_key(report) -> dict[tuple[str, str], object]:
    return {(r.check, r.subject): r for r in report.results}


def same_known_hosts(c) -> dict[str, str]:
    return {f"h{i}": str(c.known_hosts) for i in range(3)}


def test_cpu_topology_passes_everywhere_and_moves_real_bytes(cluster, tiny_model, tmp_path):
    report = doctor(cpu_topology(cluster, tmp_path, tiny_model, PORT_BASE), same_known_hosts(cluster), transfer=True)
    results = by_key(report)
    failures = [f"{r.check} {r.subject}: {r.summary}" for r in report.failures()]
    assert not failures, failures
    assert not report.failed
    for check in ("python", "packages", "model-present", "nixl-backend", "ucx-on-efa", "ports-free", "disk", "memory"):
        assert results[(check, "h0")].status is Status.OK, results[(check, "h0")]
    # bf16 model: a warning exactly where this machine's CPU lacks bf16 instructions (the hosts are loopback aliases)
    accelerators = results[("accelerators", "h0")]
    assert accelerators.status is (Status.WARN if bf16_is_emulated(cpu_flags()) else Status.OK), accelerators
    assert results[("efa", "h1")].status is Status.SKIP and "LIBFABRIC" in results[("efa", "h1")].summary
    for pair in ("h1 -> h0", "h2 -> h0", "h2 -> h1"):
        assert results[("reachability", pair)].status is Status.OK
    assert ("reachability", "h0 -> h1") not in results  # kvpush's decode dials prefill and listens on none
    for check in ("versions-match", "model-match", "model-fit", "clock-skew"):
        assert results[(check, "(topology)")].status is Status.OK, results[(check, "(topology)")]
    transfer = results[("transfer", "h0 -> h1")]
    assert transfer.status is Status.OK and "byte-exact" in transfer.summary and transfer.data["gbps"] > 0


def test_gpu_efa_topology_fails_the_gpu_and_fabric_checks_with_remedies(cluster, tiny_model, tmp_path):
    doc = cpu_topology(cluster, tmp_path, tiny_model, PORT_BASE + 100, platform="cuda",
                       connector={"type": "kvpush", "backend": "LIBFABRIC"}, env={**UCX_ENV, "FI_PROVIDER": "efa"})
    for role in ("prefill", "decode"):
        doc[role][0].pop("kv_cache_gib")
        doc[role][0]["devices"] = [0]
    results = by_key(doctor(doc, same_known_hosts(cluster)))
    efa = results[("efa", "h0")]
    assert efa.status is Status.FAIL and "fi_info -p efa" in efa.remedy and "connector.backend: UCX" in efa.remedy
    assert any(ev.command == "fi_info -p efa" for ev in efa.evidence)
    nixl = results[("nixl-backend", "h0")]
    assert nixl.status is Status.FAIL and "LIBFABRIC plugin is listed but does not load" in nixl.summary
    assert results[("accelerators", "h1")].status is Status.FAIL and "nvidia-smi" in results[("accelerators", "h1")].summary
    assert results[("memlock", "h0")].status is Status.FAIL and "memlock unlimited" in results[("memlock", "h0")].remedy
    assert results[("ucx-on-efa", "h0")].status is Status.SKIP
    assert results[("ports-free", "h0")].status is Status.OK  # the rest still runs


def test_port_collision_fails_naming_port_and_host(cluster, tiny_model, tmp_path):
    port = PORT_BASE + 200
    with socket.socket() as squatter:
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        squatter.bind((cluster.hosts[0].address, port))
        squatter.listen(8)
        report = doctor(cpu_topology(cluster, tmp_path, tiny_model, port), same_known_hosts(cluster),
                        only=frozenset({"ports-free", "reachability"}), reach_window_s=2.0)
    results = by_key(report)
    taken = results[("ports-free", "h0")]
    assert taken.status is Status.FAIL and f"port {port} on host h0 (prefill-0 HTTP)" in taken.summary
    assert "Address already in use" in taken.summary and f"{cluster.hosts[0].address}:{port}" in taken.remedy
    assert results[("ports-free", "h1")].status is Status.OK
    assert results[("reachability", "h1 -> h0")].status is Status.OK  # the side channel on h0 is still ours
    assert report.failed


NEEDS_NETNS = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None,
                                 reason="network namespaces need root and iproute2")


@pytest.fixture
def namespaced_host(tmp_path):
    """One sshd host in its own network namespace, reachable from here over a veth pair; its own
    loopback addresses are not this machine's, so 127.0.1.x ports are unreachable from it."""
    from sshd_hosts import SSHD, SshdCluster

    tag = f"kvpd{os.getpid() % 100000}"
    subnet = 200 + os.getpid() % 50
    address = f"10.213.{subnet}.2"

    class NamespacedCluster(SshdCluster):
        def _spawn(self, host):
            log = open(host.directory / "sshd.log", "ab")
            host.process = subprocess.Popen(["ip", "netns", "exec", tag, SSHD, "-D", "-e", "-f", str(host.config)],
                                            stdout=log, stderr=log, stdin=subprocess.DEVNULL)
            log.close()

    def ip(*args: str, ns: bool = False) -> None:
        subprocess.run((["ip", "netns", "exec", tag] if ns else []) + ["ip", *args], check=True, capture_output=True)

    subprocess.run(["ip", "netns", "add", tag], check=True)
    try:
        ip("link", "add", f"{tag}h", "type", "veth", "peer", "name", f"{tag}n")
        ip("link", "set", f"{tag}n", "netns", tag)
        ip("addr", "add", f"10.213.{subnet}.1/30", "dev", f"{tag}h")
        ip("link", "set", f"{tag}h", "up")
        ip("addr", "add", f"{address}/30", "dev", f"{tag}n", ns=True)
        ip("link", "set", f"{tag}n", "up", ns=True)
        ip("link", "set", "lo", "up", ns=True)
        (tmp_path / "ns-sshd").mkdir()
        with NamespacedCluster(1, first_address=address, port=2222, root=tmp_path / "ns-sshd") as c:
            yield c
    finally:
        subprocess.run(["ip", "netns", "del", tag], capture_output=True)  # also removes the veth pair


@NEEDS_NETNS
def test_unreachable_port_fails_naming_both_hosts_and_the_port(cluster, namespaced_host, tiny_model, tmp_path):
    port = PORT_BASE + 300
    doc = cpu_topology(cluster, tmp_path, tiny_model, port)
    doc["hosts"]["far"] = {**namespaced_host.host_yaml(namespaced_host.hosts[0]), "python": sys.executable,
                           "workdir": str(tmp_path / "far")}
    doc["decode"][0]["host"] = "far"
    known = {**same_known_hosts(cluster), "far": str(namespaced_host.known_hosts)}
    started = time.monotonic()
    report = doctor(doc, known, only=frozenset({"ports-free", "reachability"}), reach_window_s=2.0)
    assert time.monotonic() - started < 15
    results = by_key(report)
    blocked = results[("reachability", "far -> h0")]
    assert blocked.status is Status.FAIL
    assert f"far cannot reach h0 port {port + 1} (prefill-0 side channel" in blocked.summary
    assert "Connection refused" in blocked.summary and f"TCP {port + 1} from far" in blocked.remedy
    assert results[("reachability", "h2 -> far")].status is Status.OK  # the other direction routes over the veth


def test_missing_interpreter_fails_python_and_packages_but_the_probe_still_reports(cluster, tiny_model, tmp_path):
    doc = cpu_topology(cluster, tmp_path, tiny_model, PORT_BASE + 500)
    doc["hosts"]["h1"]["python"] = "/nonexistent/venv/bin/python"
    results = by_key(doctor(doc, same_known_hosts(cluster), only=frozenset({"python", "packages", "disk"})))
    python = results[("python", "h1")]
    assert python.status is Status.FAIL and "/nonexistent/venv/bin/python not found" in python.summary
    assert "hosts.h1.python" in python.remedy
    assert results[("packages", "h1")].status is Status.FAIL  # system python3 has no vLLM
    assert results[("disk", "h1")].status is Status.OK and results[("python", "h0")].status is Status.OK


def test_cli_exit_codes_json_and_only(cluster, tiny_model, tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    doc = cpu_topology(cluster, tmp_path, tiny_model, PORT_BASE + 400)
    path = tmp_path / "topo.yaml"
    path.write_text(yaml.safe_dump(doc))
    env = {**os.environ, "HOME": str(home), "COLUMNS": "250"}
    kvpush = [sys.executable, "-m", "kvpush.cli.main"]
    ok = subprocess.run(kvpush + ["doctor", str(path), "--json", "--accept-new-host-keys", "--skip", "nixl-backend"],
                        capture_output=True, text=True, env=env, timeout=120)
    assert ok.returncode == 0, ok.stderr + ok.stdout
    data = json.loads(ok.stdout)
    assert data["ok"] and data["counts"]["fail"] == 0 and not any(r["check"] == "nixl-backend" for r in data["results"])
    with socket.socket() as squatter:
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # our own listener's TIME_WAIT
        squatter.bind((cluster.hosts[1].address, PORT_BASE + 402))
        squatter.listen(1)
        bad = subprocess.run(kvpush + ["doctor", str(path), "--only", "ports-free"], capture_output=True, text=True, env=env, timeout=120)
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert f"port {PORT_BASE + 402} on host h1 (decode-0 HTTP)" in bad.stdout
    usage = subprocess.run(kvpush + ["doctor", str(path), "--only", "nope"], capture_output=True, text=True, env=env, timeout=60)
    assert usage.returncode == 2 and "unknown check nope" in usage.stderr


def _steady(text: str) -> str:
    """The text with the readings that change between two reads (free memory) masked."""
    return re.sub(r"^(MemAvailable:\s+)\d+ kB$", r"\1N kB", text, flags=re.MULTILINE)


def test_in_process_builtins_print_what_the_real_tools_print():
    """The probe answers trivial commands itself; their text must equal the real tool's here."""
    from kvpush.deploy.doctor import facts_probe

    for command in facts_probe.BUILTINS:
        if command.startswith("date"):
            continue
        real = subprocess.run(["/bin/sh", "-c", command], capture_output=True, text=True)
        mine = facts_probe.run_builtin(command)
        stderr = real.stderr.replace("/bin/sh: 1: ", "")
        assert (mine["rc"], _steady(mine["stdout"]), mine["stderr"]) == (real.returncode, _steady(real.stdout), stderr), command
    assert abs(float(facts_probe.run_builtin("date +%s.%N")["stdout"]) - time.time()) < 1


def test_a_hanging_tool_is_killed_inside_the_probe_and_the_probe_still_reports():
    from kvpush.deploy.doctor.probes import python_command

    request = {"host": "x", "nonce": "n", "command_timeout_s": 0.5,
               "commands": {"stuck": "sleep 30; echo never", "quick": "echo fine"}}
    started = time.monotonic()
    out = subprocess.run(["bash", "-c", python_command(sys.executable, "facts_probe.py", [json.dumps(request)], no_site=True)],
                         capture_output=True, text=True, timeout=20)
    assert time.monotonic() - started < 5
    sections = json.loads(out.stdout)["sections"]
    assert sections["stuck"]["timed_out"] and sections["stuck"]["rc"] is None and "never" not in sections["stuck"]["stdout"]
    assert sections["quick"]["stdout"] == "fine\n" and not sections["quick"]["timed_out"]
