"""Hostile clients against the router process (`python -m kvpush.router`, on uvloop, as `kvpush up`
runs it) in front of fake vLLM processes: each attack is refused or cut within its bound and counted
on /metrics, and real requests sent all through it are answered in full."""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import resource
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from kvpush.common.vllm_metrics import metric_sum
from kvpush.router.connections import SWEEP_S
from kvpush.router.instances import InstanceList
from router_process_harness import completion, config_file, fake_instances, upstream, wait_http

PORTS = {"decode": 18700, "prefill": 18701, "router": 18702}
ROUTER = PORTS["router"]
REFUSED = "kvpush_router_refused_connections_total"
KEY = "attack-test-key"
PARTIAL_HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n"
BODY = json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 2}).encode()
SLACK_S = 3.0  # what a loaded 2-core machine may add to a bound


def head(length: int = len(BODY), extra: bytes = b"") -> bytes:
    return PARTIAL_HEAD + b"Authorization: Bearer %s\r\nContent-Length: %d\r\n%s\r\n" % (KEY.encode(), length, extra)


@pytest.fixture
def fakes():
    with fake_instances(PORTS):
        yield


@contextlib.contextmanager
def router(tmp_path: Path, open_files: int | None = None, **overrides):
    """The router process with a client key; its log is tmp_path/router.log."""
    path = config_file(tmp_path, PORTS, api_key_env="ATTACK_TEST_KEY", public_paths=["/health", "/metrics"], **overrides)
    log = open(tmp_path / "router.log", "w")

    def limit_files() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (open_files, open_files))

    proc = subprocess.Popen([sys.executable, "-m", "kvpush.router", "--config", str(path)], stderr=log,
                            env={**os.environ, "ATTACK_TEST_KEY": KEY}, preexec_fn=limit_files if open_files else None)
    try:
        assert wait_http(f"http://127.0.0.1:{ROUTER}/health", proc) == 200
        yield proc
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=30)
        log.close()
    assert code == 0, (tmp_path / "router.log").read_text()[-3000:]


def metrics() -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{ROUTER}/metrics", timeout=10) as r:
        return r.read().decode()


def refused(reason: str, page: str | None = None) -> float:
    return metric_sum(page or metrics(), REFUSED, reason=reason) or 0.0


class Traffic:
    """Real requests, each on a new connection, one after another for as long as the block lasts."""

    def __init__(self):
        self.results: list[tuple[object, float]] = []  # (True or what went wrong, seconds)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "Traffic":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                text = completion(ROUTER, headers={"Authorization": f"Bearer {KEY}"})["choices"][0]["text"]
                outcome: object = text == " t0 t1" or text
            except Exception as exc:  # what a real client would see: recorded, asserted below
                outcome = repr(exc)
            self.results.append((outcome, time.monotonic() - started))
            self._stop.wait(0.05)

    def assert_unharmed(self, minimum: int = 5) -> None:
        failed = [r for r in self.results if r[0] is not True]
        assert len(self.results) >= minimum and not failed, (len(self.results), failed[:5])
        assert max(seconds for _, seconds in self.results) < SLACK_S, sorted(s for _, s in self.results)[-5:]


async def connect() -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", ROUTER)


async def closed_after(reader: asyncio.StreamReader, since: float) -> float:
    """Seconds from `since` until the router closed the connection (whatever it sent is skipped)."""
    try:
        while await reader.read(65536):
            pass
    except ConnectionResetError:
        pass
    return time.monotonic() - since


async def answer(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    status_line = await reader.readline()
    headers = {}
    while (line := await reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode().partition(":")
        headers[name.strip().lower()] = value.strip()
    return int(status_line.split()[1]), headers, await reader.readexactly(int(headers.get("content-length", "0")))


def test_slow_heads_and_silent_connections_are_cut_at_the_head_deadline_while_real_requests_pass(fakes, tmp_path):
    header_timeout_s = 2.0
    with router(tmp_path, header_timeout_s=header_timeout_s), Traffic() as traffic:
        async def attack() -> list[float]:
            started = time.monotonic()
            slow = [await connect() for _ in range(300)]
            silent = [await connect() for _ in range(50)]
            for _, writer in slow:
                writer.write(PARTIAL_HEAD)

            async def trickle() -> None:  # a header line every 0.5 s: bytes keep coming, the head never ends
                while True:
                    await asyncio.sleep(0.5)
                    for reader, writer in slow:
                        if not reader.at_eof() and not writer.is_closing():
                            writer.write(b"X-Slow: 1\r\n")

            trickling = asyncio.create_task(trickle())
            try:
                return await asyncio.wait_for(asyncio.gather(*(closed_after(r, started) for r, _ in slow + silent)), 60)
            finally:
                trickling.cancel()
                for _, writer in slow + silent:
                    writer.close()

        closed_at = asyncio.run(attack())
        page = metrics()
    assert max(closed_at) < header_timeout_s + SWEEP_S + SLACK_S, sorted(closed_at)[-5:]
    assert (refused("header_timeout", page), refused("silent", page)) == (300, 50)
    traffic.assert_unharmed()


def test_1100_half_sent_requests_under_ulimit_n_1024_cannot_keep_real_clients_out(fakes, tmp_path):
    """Past the open-files limit libuv resets every new connection; the cap keeps the router below it."""
    with router(tmp_path, open_files=1024, header_timeout_s=5.0), Traffic() as traffic:
        async def attack() -> list[float]:
            started = time.monotonic()
            hoarders = []
            for _ in range(1100):
                reader, writer = await connect()
                writer.write(PARTIAL_HEAD)
                hoarders.append((reader, writer))
            await asyncio.sleep(2)  # holding all it can while real requests come
            try:
                return await asyncio.wait_for(asyncio.gather(*(closed_after(r, started) for r, _ in hoarders)), 60)
            finally:
                for _, writer in hoarders:
                    writer.close()

        closed_at = asyncio.run(attack())
        traffic.stop()
        time.sleep(SWEEP_S)
        page = metrics()
    log = (tmp_path / "router.log").read_text()
    assert "holds at most 320 client connections, not max_connections 4096" in log
    assert max(closed_at) < 5.0 + SWEEP_S + SLACK_S
    assert refused("evicted", page) + refused("header_timeout", page) >= 1100
    assert refused("connection_cap", page) == 0  # none had a request in progress: room was always made
    assert metric_sum(page, "kvpush_router_client_connections") == 1  # this scrape's
    traffic.assert_unharmed()


def test_with_every_connection_carrying_a_request_a_new_one_gets_503_with_retry_after(fakes, tmp_path):
    with router(tmp_path, max_connections=40, body_timeout_s=20.0):
        async def attack() -> tuple[int, dict[str, str], bytes, list[int]]:
            busy = [await connect() for _ in range(40)]
            for _, writer in busy:
                writer.write(head() + BODY[:5])  # a request in progress: its body still coming
            await asyncio.sleep(0.5)
            reader, writer = await connect()
            writer.write(head() + BODY)
            refusal = await answer(reader)
            writer.close()
            finished = []
            for reader, writer in busy:  # the requests in progress are served once their bodies come
                writer.write(BODY[5:])
                finished.append((await answer(reader))[0])
                writer.close()
            return (*refusal, finished)

        status, headers, body, finished = asyncio.run(attack())
        assert status == 503 and headers["retry-after"] == "1" and headers["connection"] == "close"
        assert json.loads(body)["error"]["message"].startswith("the router holds its limit of 40 client connections")
        assert finished == [200] * 40
        assert refused("connection_cap") == 1
        assert completion(ROUTER, headers={"Authorization": f"Bearer {KEY}"})["choices"][0]["text"] == " t0 t1"


def test_a_10_gb_declared_body_gets_413_at_once_and_a_slow_body_408_at_its_deadline(fakes, tmp_path):
    body_timeout_s = 2.0
    with router(tmp_path, body_timeout_s=body_timeout_s), Traffic() as traffic:
        async def attack() -> dict[str, tuple]:
            seen = {}
            for name, extra in (("413", b""), ("413 expect", b"Expect: 100-continue\r\n")):
                reader, writer = await connect()
                started = time.monotonic()
                writer.write(head(length=10 * 10**9, extra=extra))  # none of the 10 GB is sent
                status, headers, body = await answer(reader)
                seen[name] = (status, headers.get("connection"), time.monotonic() - started, body)
                await closed_after(reader, started)
                writer.close()
            reader, writer = await connect()
            started = time.monotonic()
            writer.write(head() + BODY[:5])
            status, headers, body = await answer(reader)
            seen["408"] = (status, headers.get("connection"), time.monotonic() - started, body)
            writer.close()
            return seen

        seen = asyncio.run(attack())
        page = metrics()
    for name in ("413", "413 expect"):
        status, connection, seconds, body = seen[name]
        assert (status, connection) == (413, "close") and seconds < SLACK_S, seen[name]
        assert b"is over the router's limit" in body
    status, connection, seconds, body = seen["408"]
    # the router's clock (libuv's, to the millisecond) starts once the head is in: a hair after the write
    assert (status, connection) == (408, "close") and body_timeout_s - 0.1 < seconds < body_timeout_s + SLACK_S, seen["408"]
    assert (refused("body_too_large", page), refused("body_timeout", page)) == (2, 1)
    traffic.assert_unharmed()


NON_FINITE = [(b'{"model": "tiny", "prompt": "hi", "max_tokens": 2, "temperature": NaN}', "temperature", "NaN"),
              (b'{"model": "tiny", "prompt": "hi", "max_tokens": 2, "top_p": Infinity}', "top_p", "Infinity"),
              (b'{"model": "tiny", "prompt": "hi", "max_tokens": 2, "logit_bias": {"7": -Infinity}}', "logit_bias.7",
               "-Infinity"),
              (b'{"model": "tiny", "prompt": "hi", "max_tokens": 2, "repetition_penalty": 1e999}', "repetition_penalty",
               "1e999")]


def test_numbers_that_are_not_finite_are_a_400_naming_the_field_and_never_forwarded(fakes, tmp_path):
    """Python's JSON reader (and so vLLM's) takes NaN, Infinity and 1e999; the router answers them
    itself, counted as client errors, while real requests pass."""
    with router(tmp_path), Traffic() as traffic:
        before = metric_sum(metrics(), "kvpush_router_requests_total", outcome="client_error") or 0.0
        for raw, field, token in NON_FINITE:
            headers = {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"}
            request = urllib.request.Request(f"http://127.0.0.1:{ROUTER}/v1/completions", data=raw, headers=headers)
            with pytest.raises(urllib.error.HTTPError) as refused_with:
                urllib.request.urlopen(request, timeout=10)
            error = json.loads(refused_with.value.read())["error"]
            assert refused_with.value.code == 400 and error["param"] == field, error
            assert error["message"] == f"`{field}` is not a finite number ({token}); the router takes finite numbers " \
                                       "only"
        time.sleep(0.3)  # a few real requests after the refusals too
        page = metrics()
    assert metric_sum(page, "kvpush_router_requests_total", outcome="client_error") == before + len(NON_FINITE)
    traffic.assert_unharmed(minimum=2)


def test_sighup_with_a_fifo_as_the_instance_list_never_stops_the_router_serving(fakes, tmp_path):
    listed = InstanceList(prefill=[upstream("prefill", PORTS)], decode=[upstream("decode", PORTS)])
    instances = tmp_path / "instances.json"
    instances.write_text(listed.model_dump_json())
    with router(tmp_path, instances_file=str(instances), prefill=[], decode=[]) as proc, Traffic() as traffic:
        time.sleep(0.5)
        instances.unlink()
        os.mkfifo(instances)  # no writer will ever come
        proc.send_signal(signal.SIGHUP)
        log = tmp_path / "router.log"
        deadline = time.monotonic() + 20
        while "is a FIFO, not a regular file" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert "still serving the instance list it had" in log.read_text()
        time.sleep(0.5)
        instances.unlink()
        instances.write_text(listed.model_dump_json())
        proc.send_signal(signal.SIGHUP)  # the reload after it is read as ever: nothing was left hanging
        while "read again: unchanged" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert "read again: unchanged" in log.read_text()
    traffic.assert_unharmed()
