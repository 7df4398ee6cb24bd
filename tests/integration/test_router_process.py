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

import pytest

from kvpush.router.config import RouterConfig, Upstream

FAKE = """
import asyncio, signal, sys
from kvpush.router.fake_upstream import FakeVllm
async def main():
    fake = FakeVllm(model="tiny")
    await fake.start("127.0.0.1", int(sys.argv[1]))
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    await fake.stop()
asyncio.run(main())
"""
PORTS = {"decode": 18500, "prefill": 18501, "router": 18502}


def wait_http(url: str, proc: subprocess.Popen, timeout_s: float = 20) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else proc.returncode
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                return r.status
        except urllib.error.HTTPError as exc:
            return exc.code
        except (urllib.error.URLError, ConnectionError):
            time.sleep(0.1)
    raise AssertionError(f"{url} never answered")


@pytest.fixture
def fakes():
    procs = [subprocess.Popen([sys.executable, "-c", FAKE, str(PORTS[role])]) for role in ("decode", "prefill")]
    try:
        for role, proc in zip(("decode", "prefill"), procs):
            wait_http(f"http://127.0.0.1:{PORTS[role]}/health", proc)
        yield
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            proc.wait(timeout=10)


def config_file(tmp_path: Path, **overrides) -> Path:
    def up(role: str) -> Upstream:
        return Upstream(name=f"{role}-0", url=f"http://127.0.0.1:{PORTS[role]}", engine_id=f"t.{role}-0",
                        side_channel_host="127.0.0.1", side_channel_port=PORTS[role] + 100)

    config = RouterConfig(protocol="kvpush", served_model_name="tiny", port=PORTS["router"],
                          prefill=[up("prefill")], decode=[up("decode")], **overrides)
    path = tmp_path / "router.json"
    path.write_text(config.model_dump_json(indent=2))
    return path


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
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"protocol": "carrier-pigeon", "served_model_name": "x", "decode": []}))
    invalid = subprocess.run([sys.executable, "-m", "kvpush.router", "--config", str(bad)], capture_output=True, text=True, timeout=60)
    assert invalid.returncode == 2 and "protocol" in invalid.stderr


def test_cli_router_command_rejects_conflicting_sources(tmp_path):
    result = subprocess.run([sys.executable, "-m", "kvpush.cli.main", "router", str(tmp_path / "t.yaml"),
                             "--config", str(tmp_path / "r.json")], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "not both" in result.stderr
    result = subprocess.run([sys.executable, "-m", "kvpush.cli.main", "router", "--config", str(tmp_path / "r.json")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "r.json" in result.stderr
