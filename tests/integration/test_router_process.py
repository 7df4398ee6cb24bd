"""`python -m kvpush.router --config FILE` as its own process, as `kvpush up` starts it."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import pytest

from kvpush.router.config import RouterConfig, Upstream
from router_process_harness import fake_instances, start_fake, wait_http
from router_process_harness import config_file as shared_config_file

PORTS = {"decode": 18500, "prefill": 18501, "router": 18502, "decode-1": 18503}


@pytest.fixture
def fakes():
    with fake_instances(PORTS):
        yield


def config_file(tmp_path: Path, **overrides) -> Path:
    return shared_config_file(tmp_path, PORTS, **overrides)


def test_router_process_serves_and_stops_cleanly_on_sigterm(fakes, tmp_path):
    env = {**os.environ, "ROUTER_TEST_KEY": "k1"}
    proc = subprocess.Popen([sys.executable, "-m", "kvpush.router", "--config", str(config_file(tmp_path, api_key_env="ROUTER_TEST_KEY"))],
                            env=env, stderr=subprocess.PIPE)
    try:
        assert wait_http(f"http://127.0.0.1:{PORTS['router']}/health", proc) == 200
        req = urllib.request.Request(f"http://127.0.0.1:{PORTS['router']}/v1/completions",
                                     data=json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 2}).encode(),
                                     headers={"Content-Type": "application/json", "Authorization": "Bearer k1"})
        with urllib.request.urlopen(req, timeout=10) as r:
            assert json.loads(r.read())["choices"][0]["text"] == " t0 t1"
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0


def test_router_process_reports_config_errors_in_one_line(tmp_path):
    missing = subprocess.run([sys.executable, "-m", "kvpush.router", "--config", str(tmp_path / "nope.json")],
                             capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and "nope.json" in missing.stderr and len(missing.stderr.strip().splitlines()) == 1
    path = config_file(tmp_path, api_key_env="ROUTER_TEST_UNSET_KEY")
    env = {k: v for k, v in os.environ.items() if k != "ROUTER_TEST_UNSET_KEY"}
    unset = subprocess.run([sys.executable, "-m", "kvpush.router", "--config", str(path)], env=env,
                           capture_output=True, text=True, timeout=60)
    assert unset.returncode == 2 and "ROUTER_TEST_UNSET_KEY" in unset.stderr
    shared_key = tmp_path / "router.key"
    shared_key.write_text("k3\n")
    shared_key.chmod(0o644)
    readable = subprocess.run([sys.executable, "-m", "kvpush.router", "--config", str(config_file(tmp_path, api_key_file=str(shared_key)))],
                              capture_output=True, text=True, timeout=60)
    assert readable.returncode == 2 and "chmod 600" in readable.stderr and len(readable.stderr.strip().splitlines()) == 1
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"protocol": "carrier-pigeon", "served_model_name": "x", "decode": []}))
    invalid = subprocess.run([sys.executable, "-m", "kvpush.router", "--config", str(bad)], capture_output=True, text=True, timeout=60)
    assert invalid.returncode == 2 and "protocol" in invalid.stderr


def test_router_workers_take_the_api_key_from_an_owner_only_file(fakes, tmp_path):
    key = tmp_path / "router.key"
    key.write_text("k2\n")
    key.chmod(0o600)
    proc = subprocess.Popen([sys.executable, "-m", "kvpush.router", "--config",
                             str(config_file(tmp_path, workers=2, api_key_file=str(key)))], stderr=subprocess.PIPE)
    try:
        assert wait_http(f"http://127.0.0.1:{PORTS['router']}/health", proc) == 200
        body = json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 2}).encode()
        for i in range(6):  # new connections: both workers answer
            for given, status in ((None, 401), ("Bearer k2", 200)):
                headers = {"Content-Type": "application/json", **({"Authorization": given} if given else {})}
                req = urllib.request.Request(f"http://127.0.0.1:{PORTS['router']}/v1/completions", data=body, headers=headers)
                try:
                    with urllib.request.urlopen(req, timeout=10) as r:
                        assert (r.status, json.loads(r.read())["choices"][0]["text"]) == (status, " t0 t1")
                except urllib.error.HTTPError as exc:
                    assert exc.code == status
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0


def test_cli_router_command_rejects_conflicting_sources(tmp_path):
    result = subprocess.run([sys.executable, "-m", "kvpush.cli.main", "router", str(tmp_path / "t.yaml"),
                             "--config", str(tmp_path / "r.json")], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "not both" in result.stderr
    result = subprocess.run([sys.executable, "-m", "kvpush.cli.main", "router", "--config", str(tmp_path / "r.json")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "r.json" in result.stderr


def children_of(pid: int) -> list[int]:
    return [child.pid for child in psutil.Process(pid).children()]


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def start_workers(tmp_path: Path, workers: int = 2, **popen_options) -> tuple[subprocess.Popen, list[int]]:
    proc = subprocess.Popen([sys.executable, "-m", "kvpush.router", "--config", str(config_file(tmp_path, workers=workers))],
                            stderr=subprocess.PIPE, text=True, **popen_options)
    try:
        assert wait_http(f"http://127.0.0.1:{PORTS['router']}/health", proc) == 200
        deadline = time.monotonic() + 20
        while len(children_of(proc.pid)) < workers and time.monotonic() < deadline:
            time.sleep(0.1)
        pids = children_of(proc.pid)
        assert len(pids) == workers
        # /health answered from one worker; the kernel also hands connections to workers still
        # importing, where they wait in the backlog. A worker reports itself up on /metrics once it
        # has built its app, just before it serves.
        assert eventually(lambda: serving_worker_pids() == sorted(pids), 30), (serving_worker_pids(), pids)
    except BaseException:  # no router left behind holding the port for the next test
        proc.terminate()
        proc.wait(timeout=30)
        raise
    return proc, pids


def completion(prompt: str) -> dict:
    req = urllib.request.Request(f"http://127.0.0.1:{PORTS['router']}/v1/completions",
                                 data=json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 2}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:  # a new connection each time: the kernel picks the worker
        return json.loads(r.read())


def metric_lines(name: str) -> list[str]:
    with urllib.request.urlopen(f"http://127.0.0.1:{PORTS['router']}/metrics", timeout=10) as r:
        return [line for line in r.read().decode().splitlines() if line.startswith(name)]


def serving_worker_pids() -> list[int]:
    """The router workers that report themselves up on /metrics (any worker reports them all)."""
    try:
        up = metric_lines("kvpush_router_worker_up")
    except (urllib.error.URLError, ConnectionError, TimeoutError):  # routed to a worker still starting
        return []
    return sorted(int(line.split('pid="')[1].split('"')[0]) for line in up)


def test_router_workers_share_the_port_and_report_metrics_of_all(fakes, tmp_path):
    proc, pids = start_workers(tmp_path)
    try:
        for i in range(20):
            assert completion(f"p{i}")["choices"][0]["text"] == " t0 t1"
        for _ in range(4):  # whichever worker answers the scrape reports both
            assert serving_worker_pids() == sorted(pids)
            ok = [line for line in metric_lines("kvpush_router_requests_total") if 'outcome="success"' in line]
            assert sum(float(line.split()[-1]) for line in ok) == 20
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    assert not any(alive(pid) for pid in pids)
    assert not list(tmp_path.glob(".router-workers-*"))  # the shared files went with them


@pytest.mark.parametrize("sig, how", [(signal.SIGKILL, "killed by SIGKILL"), (signal.SIGTERM, "exit code 0")])
def test_a_worker_that_ends_alone_stops_the_router_with_a_clear_error(fakes, tmp_path, sig, how):
    proc, pids = start_workers(tmp_path)
    try:
        os.kill(pids[1], sig)
        assert proc.wait(timeout=30) == 1
        err = proc.stderr.read()
        assert f"router worker 1 (pid {pids[1]}) ended on its own: {how}" in err
        assert err.strip().splitlines()[-1].startswith("error: ")
        assert not alive(pids[0])
        with pytest.raises(urllib.error.URLError):  # nothing listens any more
            urllib.request.urlopen(f"http://127.0.0.1:{PORTS['router']}/health", timeout=2)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_router_workers_stop_when_their_supervisor_is_killed_outright(fakes, tmp_path):
    proc, pids = start_workers(tmp_path)
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 20
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(pid) for pid in pids)


def test_router_workers_refuse_a_port_another_router_listens_on(fakes, tmp_path):
    import socket

    squatter = socket.socket()
    squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)  # as a router left from an earlier run
    squatter.bind(("127.0.0.1", PORTS["router"]))
    squatter.listen()
    try:
        result = subprocess.run([sys.executable, "-m", "kvpush.router", "--config", str(config_file(tmp_path, workers=2))],
                                capture_output=True, text=True, timeout=60)
    finally:
        squatter.close()
    assert result.returncode == 1
    assert "cannot listen" in result.stderr and "Address already in use" in result.stderr


def test_router_workers_stop_cleanly_when_their_process_group_is_signalled(fakes, tmp_path):
    """`kvpush down` signals the router's whole group: supervisor and workers see SIGTERM together."""
    proc, pids = start_workers(tmp_path, start_new_session=True)
    os.killpg(proc.pid, signal.SIGTERM)
    assert proc.wait(timeout=30) == 0, proc.stderr.read()
    assert not any(alive(pid) for pid in pids)


def instance_list(tmp_path: Path, decodes: list[str]) -> str:
    """Write the instance list (prefill-0 and the named decodes) beside the config; its digest."""
    from kvpush.router.instances import InstanceList

    def up(name: str, port: int) -> Upstream:
        return Upstream(name=name, url=f"http://127.0.0.1:{port}", engine_id=f"t.{name}", side_channel_host="127.0.0.1",
                        side_channel_port=port + 100)

    ports = {"decode-0": PORTS["decode"], "decode-1": PORTS["decode-1"]}
    listed = InstanceList(prefill=[up("prefill-0", PORTS["prefill"])], decode=[up(n, ports[n]) for n in decodes])
    (tmp_path / "instances.json").write_text(listed.model_dump_json())
    return listed.digest()


@pytest.mark.parametrize("workers", [1, 2])
def test_sighup_to_the_routers_group_makes_every_worker_take_the_new_instance_list(fakes, tmp_path, workers):
    """As `kvpush up` changes the instances: the list file rewritten, SIGHUP to the router's process
    group; no process of the router restarts."""
    extra = start_fake(PORTS["decode-1"])
    first = instance_list(tmp_path, ["decode-0"])
    config = RouterConfig(protocol="kvpush", served_model_name="tiny", port=PORTS["router"], workers=workers,
                          instances_file="instances.json", probe_interval_s=0.1)
    (tmp_path / "router.json").write_text(config.to_file_json())
    proc = subprocess.Popen([sys.executable, "-m", "kvpush.router", "--config", str(tmp_path / "router.json")],
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        wait_http(f"http://127.0.0.1:{PORTS['decode-1']}/health", extra)
        assert wait_http(f"http://127.0.0.1:{PORTS['router']}/health", proc) == 200
        deadline = time.monotonic() + 20
        while len(children_of(proc.pid)) < (workers if workers > 1 else 0) and time.monotonic() < deadline:
            time.sleep(0.1)
        pids = sorted([proc.pid, *children_of(proc.pid)])
        assert eventually(lambda: all_serve(first, workers))  # each worker reports once it serves
        for decodes in (["decode-0", "decode-1"], ["decode-1"]):
            digest = instance_list(tmp_path, decodes)
            os.killpg(proc.pid, signal.SIGHUP)
            assert eventually(lambda: all_serve(digest, workers))
            assert eventually(lambda: all(in_rotation(n) == 1 for n in decodes))
            for i in range(6):
                assert completion(f"p{i}")["choices"][0]["text"] == " t0 t1"
        assert in_rotation("decode-0") == 0
        assert sorted([proc.pid, *children_of(proc.pid)]) == pids  # nothing restarted
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=30)
        extra.send_signal(signal.SIGTERM)
        extra.wait(timeout=10)
    assert code == 0, proc.stderr.read()
    assert "instance list" in proc.stderr.read()


def eventually(condition, timeout_s: float = 20) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.1)
    return condition()


def all_serve(digest: str, workers: int) -> bool:
    from kvpush.common.vllm_metrics import samples

    with urllib.request.urlopen(f"http://127.0.0.1:{PORTS['router']}/metrics", timeout=10) as r:
        serving = [labels["digest"] for metric, labels, value in samples(r.read().decode())
                   if metric == "kvpush_router_instance_list" and value == 1]
    return serving == [digest] * workers


def in_rotation(name: str) -> float:
    lines = [line for line in metric_lines("kvpush_router_instance_in_rotation") if f'instance="{name}"' in line]
    return min(float(line.split()[-1]) for line in lines) if lines else -1
