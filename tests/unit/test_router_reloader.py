"""router/reload.py: the instance list read again off the event loop; a path that hangs neither
stops the router serving nor piles up reads."""
from __future__ import annotations

import logging
import os
import threading

import pytest
from router_harness import MODEL, deployment, eventually, upstream
from router_helpers import run

from kvpush.router import reload as reload_module
from kvpush.router.instances import InstanceList, load_instance_list, reload_progress

pytestmark = pytest.mark.unit

COMPLETION = {"model": MODEL, "prompt": "hello", "max_tokens": 2}


def write_list(path, dep, decodes: int = 1) -> str:
    listed = InstanceList(prefill=[upstream("p0", dep.prefill[0], 5600)],
                          decode=[upstream(f"d{i}", dep.decode[i], 5700 + i) for i in range(decodes)])
    path.write_text(listed.model_dump_json())
    return listed.digest()


class HangingReads:
    """load_instance_list, each call held until released; counts the calls."""

    def __init__(self):
        self.release = threading.Event()
        self.calls = 0

    def __call__(self, path):
        self.calls += 1
        self.release.wait(30)
        return load_instance_list(path)


def test_a_fifo_as_the_list_is_refused_at_once_and_the_list_in_use_stays(tmp_path, caplog):
    async def scenario():
        path = tmp_path / "instances.json"
        async with deployment("kvpush", instances_file=str(path)) as dep:
            before = dep.router.rotation.digest
            os.mkfifo(path)  # a reader opening it would wait for a writer that never comes
            with caplog.at_level(logging.ERROR, logger="kvpush.router"):
                await dep.router.reload()
            assert "is a FIFO, not a regular file" in caplog.text and "still serving the instance list it had" in caplog.text
            assert dep.router.rotation.digest == before and reload_progress(await dep.metrics()).took(before)
            assert (await dep.post("/v1/completions", COMPLETION))[0] == 200

    run(scenario())


def test_a_read_that_hangs_is_given_up_while_requests_are_served_and_not_started_again_until_it_returns(
        tmp_path, caplog, monkeypatch):
    async def scenario():
        path = tmp_path / "instances.json"
        async with deployment("kvpush", n_decode=2, instances_file=str(path)) as dep:
            write_list(path, dep)
            before = dep.router.rotation.digest
            hanging = HangingReads()
            monkeypatch.setattr(reload_module, "load_instance_list", hanging)
            dep.router.reloader._read_timeout_s = 0.5
            with caplog.at_level(logging.ERROR, logger="kvpush.router"):
                task = dep.router.reload()
                served = 0
                while not task.done():  # the event loop serves while the read hangs
                    assert (await dep.post("/v1/completions", COMPLETION))[0] == 200
                    served += 1
                assert served and "not read within 0.5 s" in caplog.text
                await dep.router.reload()  # its thread still hangs: no second one
                assert hanging.calls == 1 and "has not returned; not reading it again" in caplog.text
            assert dep.router.rotation.digest == before
            digest = write_list(path, dep, decodes=2)
            hanging.release.set()
            await eventually(lambda: not dep.router.reloader.reading)
            await dep.router.reload()  # the hung read's late result was dropped; this one is taken
            assert hanging.calls == 2 and dep.router.rotation.digest == digest

    run(scenario())


def test_reloads_asked_for_during_a_read_are_one_more_read_after_it(tmp_path, monkeypatch):
    async def scenario():
        path = tmp_path / "instances.json"
        async with deployment("kvpush", n_decode=2, instances_file=str(path)) as dep:
            write_list(path, dep)
            hanging = HangingReads()
            monkeypatch.setattr(reload_module, "load_instance_list", hanging)
            first = dep.router.reload()
            await eventually(lambda: hanging.calls == 1)
            digest = write_list(path, dep, decodes=2)  # written while the first read is out
            assert dep.router.reload() is first and dep.router.reload() is first
            hanging.release.set()
            await first
            assert hanging.calls == 2 and dep.router.rotation.digest == digest

    run(scenario())
