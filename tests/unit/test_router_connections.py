"""router/connections.py: what a client connection may hold, against the in-process router (the
router process, on uvloop, is tests/integration/test_router_attacks.py's)."""
from __future__ import annotations

import asyncio
import json
import logging

import pytest
from router_harness import MODEL, deployment, eventually
from router_helpers import run, sample

from kvpush.router.connections import FILES_PER_CONNECTION, FILES_RESERVED, connection_cap

pytestmark = pytest.mark.unit

COMPLETION = json.dumps({"model": MODEL, "prompt": "hello", "max_tokens": 2}).encode()
REFUSED = "kvpush_router_refused_connections_total"
SHORT_HEAD = {"header_timeout_s": 0.3}


def head(path: str = "/v1/completions", length: int = len(COMPLETION), extra: bytes = b"") -> bytes:
    return (b"POST %s HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\nContent-Length: %d\r\n%s\r\n"
            % (path.encode(), length, extra))


async def connect(url: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = url.removeprefix("http://").split(":")
    return await asyncio.open_connection(host, int(port))


async def answer(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    """One HTTP answer (with a Content-Length) read off a raw connection."""
    status_line = await reader.readline()
    headers = {}
    while (line := await reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode().partition(":")
        headers[name.strip().lower()] = value.strip()
    body = await reader.readexactly(int(headers.get("content-length", "0")))
    return int(status_line.split()[1]), headers, body


async def closed(reader: asyncio.StreamReader) -> bool:
    """The router closed the connection (what it had still sent is skipped)."""
    try:
        while await reader.read(65536):
            pass
    except ConnectionResetError:
        pass
    return True


async def completion_ok(dep) -> bool:
    status, raw = await dep.post("/v1/completions", json.loads(COMPLETION))
    return status == 200 and json.loads(raw)["choices"][0]["text"] == " t0 t1"


def test_the_cap_is_what_the_open_files_limit_leaves_for_a_connection_and_its_two_legs():
    assert connection_cap(4096, 1024) == (1024 - FILES_RESERVED) // FILES_PER_CONNECTION == 320
    assert connection_cap(100, 1 << 20) == 100
    assert connection_cap(100, 10) == 1


@pytest.mark.parametrize("sent, reason", [(b"", "silent"), (b"POST /v1/completions HTTP/1.1\r\nHost: r\r\n", "header_timeout")])
def test_a_connection_without_a_whole_head_in_time_is_closed_and_counted(sent, reason):
    async def scenario():
        async with deployment("kvpush", **SHORT_HEAD) as dep:
            reader, writer = await connect(dep.url)
            writer.write(sent)
            assert await closed(reader)
            assert await completion_ok(dep)
            assert sample(await dep.metrics(), REFUSED, reason=reason) == 1
            writer.close()

    run(scenario())


def test_a_head_trickled_byte_by_byte_is_cut_at_its_deadline_not_kept_alive_by_each_byte():
    async def scenario():
        async with deployment("kvpush", **SHORT_HEAD) as dep:
            reader, writer = await connect(dep.url)
            sent = 0
            for byte in head():
                if reader.at_eof():
                    break
                writer.write(bytes([byte]))
                sent += 1
                await asyncio.sleep(0.05)
            assert await closed(reader) and sent < len(head())
            assert sample(await dep.metrics(), REFUSED, reason="header_timeout") == 1
            writer.close()

    run(scenario())


def test_a_kept_alive_connection_gets_the_head_deadline_again_from_its_next_heads_first_byte():
    async def scenario():
        async with deployment("kvpush", **SHORT_HEAD) as dep:
            reader, writer = await connect(dep.url)
            for _ in range(2):  # whole requests, each well within the deadline: served
                writer.write(head() + COMPLETION)
                status, _, _ = await answer(reader)
                assert status == 200
                await asyncio.sleep(0.4)  # idle longer than header_timeout_s: keep-alive's, not the head's
            writer.write(head()[:20])
            assert await closed(reader)
            assert sample(await dep.metrics(), REFUSED, reason="header_timeout") == 1
            writer.close()

    run(scenario())


def test_an_idle_kept_alive_connection_is_closed_after_keepalive_timeout_s_and_not_counted():
    async def scenario():
        async with deployment("kvpush", keepalive_timeout_s=0.3) as dep:
            reader, writer = await connect(dep.url)
            writer.write(head() + COMPLETION)
            assert (await answer(reader))[0] == 200
            assert await closed(reader)
            assert sample(await dep.metrics(), REFUSED) == 0
            writer.close()

    run(scenario())


def test_a_body_not_whole_within_body_timeout_s_gets_408_and_the_connection_closes():
    async def scenario():
        async with deployment("kvpush", body_timeout_s=0.3) as dep:
            reader, writer = await connect(dep.url)
            writer.write(head() + COMPLETION[:10])
            status, headers, body = await answer(reader)
            assert status == 408 and "body_timeout_s" in json.loads(body)["error"]["message"]
            assert headers["connection"] == "close"
            assert await closed(reader)
            assert sample(await dep.metrics(), REFUSED, reason="body_timeout") == 1
            assert await completion_ok(dep)
            writer.close()

    run(scenario())


@pytest.mark.parametrize("expect", [False, True])
def test_a_declared_length_over_the_limit_gets_413_before_any_body_and_only_with_the_key(expect):
    async def scenario():
        async with deployment("kvpush", api_key="s3cret", public_paths=["/health", "/metrics"]) as dep:
            extra = b"Expect: 100-continue\r\n" if expect else b""
            for key, status in ((b"", 401), (b"Authorization: Bearer s3cret\r\n", 413)):
                reader, writer = await connect(dep.url)
                writer.write(head(length=10 * 10**9, extra=key + extra))  # 10 GB declared, none of it sent
                got, headers, body = await answer(reader)
                assert got == status and headers["connection"] == "close", body
                assert await closed(reader)
                writer.close()
            assert b"over the router's limit" in body
            assert sample(await dep.metrics(), REFUSED, reason="body_too_large") == 1

    run(scenario())


def test_expect_100_continue_goes_on_for_a_request_the_router_takes():
    async def scenario():
        async with deployment("kvpush", api_key="s3cret") as dep:
            reader, writer = await connect(dep.url)
            writer.write(head(extra=b"Authorization: Bearer s3cret\r\nExpect: 100-continue\r\n"))
            assert await reader.readuntil(b"\r\n\r\n") == b"HTTP/1.1 100 Continue\r\n\r\n"
            writer.write(COMPLETION)
            status, _, body = await answer(reader)
            assert status == 200 and json.loads(body)["choices"][0]["text"] == " t0 t1"
            writer.close()

    run(scenario())


def test_past_the_cap_a_new_connection_takes_the_place_of_the_least_recently_active_idle_one():
    async def scenario():
        async with deployment("kvpush", max_connections=3) as dep:
            active_r, active_w = await connect(dep.url)
            hoarders = [await connect(dep.url) for _ in range(2)]
            for _, w in hoarders:
                w.write(b"POST /v1/completions HTTP/1.1\r\n")  # heads begun, never finished
            active_w.write(head() + COMPLETION)  # the oldest connection, but the most recently active
            assert (await answer(active_r))[0] == 200
            newcomers = []
            for hoarder, _ in hoarders:  # each new client pushes out one hoarder, oldest first
                newcomers.append(await connect(dep.url))
                newcomers[-1][1].write(head() + COMPLETION)
                assert (await answer(newcomers[-1][0]))[0] == 200
                assert await closed(hoarder)
            active_w.write(head() + COMPLETION)  # never pushed out: it was active after the hoarders
            assert (await answer(active_r))[0] == 200
            metrics = await dep.metrics()
            assert sample(metrics, REFUSED, reason="evicted") >= 2 and sample(metrics, REFUSED, reason="connection_cap") == 0
            for _, w in [*hoarders, *newcomers, (active_r, active_w)]:
                w.close()

    run(scenario())


def test_when_every_connection_has_a_request_in_progress_a_new_one_gets_503_with_retry_after():
    async def scenario():
        async with deployment("kvpush", max_connections=2, body_timeout_s=30) as dep:
            busy = [await connect(dep.url) for _ in range(2)]
            for _, w in busy:
                w.write(head() + COMPLETION[:5])  # a request in progress: its body still coming
            await asyncio.sleep(0.1)
            reader, writer = await connect(dep.url)
            writer.write(head() + COMPLETION)
            status, headers, body = await answer(reader)
            assert status == 503 and headers["retry-after"] == "1" and headers["connection"] == "close"
            assert "limit of 2 client connections" in json.loads(body)["error"]["message"]
            writer.close()
            for r, w in busy:  # the requests in progress were not harmed
                w.write(COMPLETION[5:])
                assert (await answer(r))[0] == 200
                w.close()
            await eventually(lambda: not dep.router.guard.connections)
            metrics = await dep.metrics()
            assert sample(metrics, REFUSED, reason="connection_cap") == 1

    run(scenario())


def test_the_open_connections_are_a_gauge_back_to_zero_once_clients_leave():
    async def scenario():
        async with deployment("kvpush") as dep:
            conns = [await connect(dep.url) for _ in range(5)]
            await eventually(lambda: len(dep.router.guard.connections) >= 5)
            for _, w in conns:
                w.close()
            await eventually(lambda: len(dep.router.guard.connections) <= 1)  # the session's own
            assert sample(await dep.metrics(), "kvpush_router_client_connections") == 1

    run(scenario())


def test_heads_that_are_not_http_get_400_are_counted_and_logged_once_without_a_traceback(caplog):
    async def scenario():
        async with deployment("kvpush") as dep:
            with caplog.at_level(logging.DEBUG, logger="aiohttp.server"):
                for bad in (b"GET /health HTTP/1.1\r\nX-A: " + b"a" * 9000 + b"\r\n\r\n",
                            b"GET /health HTTP/1.1\r\n" + b"".join(b"X-%d: 1\r\n" % i for i in range(200)) + b"\r\n") * 3:
                    reader, writer = await connect(dep.url)
                    writer.write(bad)
                    assert (await reader.read(12)) == b"HTTP/1.0 400"
                    writer.close()
            lines = [r for r in caplog.records if r.name == "aiohttp.server"]
            assert len(lines) == 1 and not lines[0].exc_info and lines[0].levelname == "WARNING"
            assert lines[0].getMessage().startswith("refused 1 request head(s) that are not valid HTTP (400)")
            assert sample(await dep.metrics(), REFUSED, reason="malformed_head") == 6
            assert await completion_ok(dep)

    run(scenario())
