"""The router as its own process (`python -m kvpush.router --config FILE`, as `kvpush up` starts it)
in front of fake vLLM instances that are processes too, for the integration tests."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from kvpush.router.config import RouterConfig, Upstream

FAKE = """
import asyncio, signal, sys
from fake_upstream import FakeVllm
async def main():
    fake = FakeVllm(model="tiny")
    await fake.start("127.0.0.1", int(sys.argv[1]))
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    await fake.stop()
asyncio.run(main())
"""


def wait_http(url: str, proc: subprocess.Popen, timeout_s: float = 20) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else proc.returncode
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                return r.status
        except urllib.error.HTTPError as exc:
            return exc.code
        except (urllib.error.URLError, ConnectionError, TimeoutError):  # a worker still starting: not answering yet
            time.sleep(0.1)
    raise AssertionError(f"{url} never answered")


def start_fake(port: int) -> subprocess.Popen:
    """A fake vLLM process on 127.0.0.1:port; SIGTERM stops it."""
    # the fake lives beside this module, which a `python -c` child does not have on its path
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")]))}
    return subprocess.Popen([sys.executable, "-c", FAKE, str(port)], env=env)


@contextlib.contextmanager
def fake_instances(ports: dict[str, int], roles: tuple[str, ...] = ("decode", "prefill")):
    """A fake vLLM process on ports[role] for each role, stopped after."""
    procs = [start_fake(ports[role]) for role in roles]
    try:
        for role, proc in zip(roles, procs):
            wait_http(f"http://127.0.0.1:{ports[role]}/health", proc)
        yield
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            proc.wait(timeout=10)


def upstream(role: str, ports: dict[str, int]) -> Upstream:
    return Upstream(name=f"{role}-0", url=f"http://127.0.0.1:{ports[role]}", engine_id=f"t.{role}-0",
                    side_channel_host="127.0.0.1", side_channel_port=ports[role] + 100)


def config_file(tmp_path: Path, ports: dict[str, int], **overrides) -> Path:
    """router.json with one prefill and one decode on the fakes' ports (unless overrides say otherwise)."""
    fields = {"prefill": [upstream("prefill", ports)], "decode": [upstream("decode", ports)], **overrides}
    config = RouterConfig(protocol="kvpush", served_model_name="tiny", port=ports["router"], **fields)
    path = tmp_path / "router.json"
    path.write_text(config.model_dump_json(indent=2))
    return path


def completion(port: int, prompt: str = "hi", headers: dict | None = None, timeout_s: float = 10) -> dict:
    """One completion on a new connection."""
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions",
                                 data=json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 2}).encode(),
                                 headers={"Content-Type": "application/json", **(headers or {})})
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        return json.loads(r.read())
