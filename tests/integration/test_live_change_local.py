"""`kvpush up` adds and removes a decode instance under load: the real router (under its
supervisor, on a LocalRunner host) takes the new instance list on SIGHUP without restarting, and no
request fails. The instances are FakeVllm servers (tests/fake_upstream.py) whose answers take
~0.5 s, so the instance that leaves still carries requests when `up` removes it."""
from __future__ import annotations

import json
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import yaml

from kvpush.common.vllm_metrics import samples
from kvpush.deploy.lifecycle.lifecycle import LifecycleOptions, down, up
from kvpush.deploy.runners import SshOptions
from kvpush.deploy.lifecycle.state import load_state
from kvpush.deploy.topology.topology import parse_topology

from lifecycle_helpers import RecordingEvents, kill_leftovers, processes_under

PORTS = iter(range(18600, 18620))  # no other test uses these
FAKE_VLLM = """
import asyncio, signal, sys
argv = sys.argv[1:]
if argv[:2] != ["-m", "vllm.entrypoints.openai.api_server"]:
    import os
    os.execv(sys.executable, [sys.executable] + argv)
from fake_upstream import Behavior, FakeVllm
async def main():
    fake = FakeVllm(model="tiny", behavior=Behavior(token_delay_s=0.06))
    await fake.start(argv[argv.index("--host") + 1], int(argv[argv.index("--port") + 1]))
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    await fake.stop()
asyncio.run(main())
"""


def instance(name: str) -> dict:
    return {"name": name, "host": "local", "http_port": next(PORTS), "side_channel_port": next(PORTS)}


class Load:
    """Completions sent back to back by `clients` threads until stopped; each outcome kept."""

    def __init__(self, url: str, clients: int = 3):
        self.url, self.stop = url, threading.Event()
        self.outcomes: list[tuple[float, int | str]] = []
        self.threads = [threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(clients)]

    def _client(self, index: int) -> None:
        n = 0
        while not self.stop.is_set():
            body = json.dumps({"model": "tiny", "prompt": f"client {index} request {n}", "max_tokens": 8}).encode()
            request = urllib.request.Request(self.url, body, {"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(request, timeout=30) as r:
                    outcome: int | str = r.status if json.loads(r.read())["choices"][0]["text"] else "empty"
            except urllib.error.HTTPError as exc:
                outcome = f"{exc.code} {exc.read()[:200]!r}"
            except OSError as exc:
                outcome = repr(exc)
            self.outcomes.append((time.monotonic(), outcome))
            n += 1

    def __enter__(self) -> "Load":
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=60)

    def failed(self) -> list:
        return [o for _, o in self.outcomes if o != 200]


def per_instance(router_port: int, metric: str) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{router_port}/metrics", timeout=10) as r:
        return {labels["instance"]: value for name, labels, value in samples(r.read().decode()) if name == metric}


def in_rotation(router_port: int) -> dict[str, float]:
    return per_instance(router_port, "kvpush_router_instance_in_rotation")


def wait_for_rotation(router_port: int, names: set[str], timeout_s: float = 30) -> dict[str, float]:
    deadline = time.monotonic() + timeout_s
    while True:
        rotation = in_rotation(router_port)
        if {n for n, v in rotation.items() if v == 1} == names or time.monotonic() > deadline:
            return rotation
        time.sleep(0.2)


def test_up_adds_then_removes_a_decode_under_load_without_a_failed_request_or_a_router_restart(tmp_path, state_dir):
    marker = str(tmp_path)
    (tmp_path / "fake_vllm.py").write_text(FAKE_VLLM)
    python = tmp_path / "python"
    tests_dir = Path(__file__).resolve().parents[1]  # where fake_upstream lives
    python.write_text(f"#!/bin/sh\nPYTHONPATH={tests_dir} exec {sys.executable} {tmp_path / 'fake_vllm.py'} \"$@\"\n")
    python.chmod(0o755)
    router_port = next(PORTS)
    doc = {
        "name": "live", "model": {"path": "/nonexistent", "served_name": "tiny"}, "connector": {"type": "nixl-pull"},
        "hosts": {"local": {"address": "127.0.0.1", "python": str(python), "workdir": str(tmp_path / "work")}},
        "prefill": [instance("prefill-0")], "decode": [instance("decode-0")],
        "router": {"host": "local", "port": router_port},
    }
    decode_1 = instance("decode-1")
    grown = {**doc, "decode": [*doc["decode"], decode_1]}
    opts = LifecycleOptions(ssh=SshOptions(known_hosts=str(tmp_path / "none")), provision=False, doctor=False,
                            prove=False, ready_timeout_s=60, drain_timeout_s=30)
    url = f"http://127.0.0.1:{router_port}/v1/completions"
    try:
        assert up(parse_topology(yaml.safe_dump(doc)), opts).changes.start
        assert wait_for_rotation(router_port, {"prefill-0", "decode-0"}) == {"prefill-0": 1, "decode-0": 1}
        router = load_state("live").processes["router"]
        with Load(url) as load:
            time.sleep(2)
            events = RecordingEvents()
            changes = up(parse_topology(yaml.safe_dump(grown)), opts, events).changes
            assert changes.start == ["decode-1"] and changes.reload == ["router"] and not changes.restart
            assert wait_for_rotation(router_port, {"prefill-0", "decode-0", "decode-1"})["decode-1"] == 1
            added_at = time.monotonic()
            carried = 0.0  # legs on decode-1 at once, at its most
            while time.monotonic() < added_at + 3:
                carried = max(carried, per_instance(router_port, "kvpush_router_inflight").get("decode-1", 0.0))
                time.sleep(0.1)
            assert carried > 0
            changes = up(parse_topology(yaml.safe_dump(doc)), opts, events).changes
            assert changes.stop == ["decode-1"] and changes.reload == ["router"] and not changes.restart
            removed_at = time.monotonic()
            time.sleep(2)
        assert load.failed() == []
        assert len([t for t, _ in load.outcomes if added_at < t < removed_at]) >= 6  # served while both decodes were
        assert any("decode-1 out of rotation" in n for n in events.notes), events.notes
        assert not any("did not confirm" in n or "after waiting" in n for n in events.notes), events.notes
        after = load_state("live").processes["router"]
        assert (after.pid, after.start_time) == (router.pid, router.start_time)  # the router never restarted
        assert "decode-1" not in in_rotation(router_port) or in_rotation(router_port)["decode-1"] == 0
        assert up(parse_topology(yaml.safe_dump(doc)), opts).changes.nothing_to_do  # the reload was recorded
    finally:
        down("live", opts)
        assert kill_leftovers(marker) == []
    assert processes_under(marker) == []
