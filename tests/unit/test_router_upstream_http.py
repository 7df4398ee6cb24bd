"""The router's lean HTTP/1.1 client: answer parsing, keep-alive, timeouts, forwarding."""
from __future__ import annotations

import asyncio

import pytest
from aiohttp import web

from kvpush.router.upstream_http import UpstreamClient, UpstreamError, UpstreamResponse, answer_head

CHUNKED = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
           b"6\r\ndata: \r\n3;ext=1\r\nabc\r\n0\r\nX-Trailer: 1\r\n\r\n")


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 20))


class _Transport:
    def __init__(self):
        self.paused = False

    def pause_reading(self):
        self.paused = True

    def resume_reading(self):
        self.paused = False


class _Connection:
    """Stands in for the socket side: records whether the answer left it reusable."""

    def __init__(self):
        self.transport = _Transport()
        self.ended: bool | None = None
        self.aborted = False

    def answer_ended(self, reusable: bool) -> None:
        self.ended = reusable

    def abort(self) -> None:
        self.aborted = True


def _response(conn: _Connection) -> UpstreamResponse:
    loop = asyncio.get_running_loop()
    return UpstreamResponse(conn, loop, loop.time() + 10)  # type: ignore[arg-type]


@pytest.mark.parametrize("step", [1, 2, 3, 7, len(CHUNKED)])
def test_chunked_answer_parses_however_the_bytes_are_split(step):
    async def scenario():
        conn = _Connection()
        resp = _response(conn)
        for i in range(0, len(CHUNKED), step):
            resp.feed(CHUNKED[i:i + step])
        assert resp.status == 200 and resp.header("content-type") == "text/event-stream"
        assert await resp.read() == b"data: abc"
        assert conn.ended is True and not conn.aborted

    run(scenario())


def test_length_answer_and_bytes_after_it_make_the_connection_unusable():
    async def scenario():
        conn = _Connection()
        resp = _response(conn)
        resp.feed(b"HTTP/1.1 404 Not Found\r\nContent-Length: 3\r\n\r\nab")
        resp.feed(b"c")
        assert resp.status == 404 and await resp.read() == b"abc" and conn.ended is True
        conn2 = _Connection()
        resp2 = _response(conn2)
        resp2.feed(b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\n\r\nxEXTRA")
        assert await resp2.read() == b"x" and conn2.ended is False

    run(scenario())


def test_connection_close_and_http10_answers_are_not_reused():
    async def scenario():
        for head in (b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 0\r\n\r\n",
                     b"HTTP/1.0 200 OK\r\nContent-Length: 0\r\n\r\n"):
            conn = _Connection()
            resp = _response(conn)
            resp.feed(head)
            assert await resp.read() == b"" and conn.ended is False

    run(scenario())


def test_malformed_answer_fails_with_upstream_error():
    async def scenario():
        for wire in (b"SSH-2.0-OpenSSH\r\n\r\n", b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n"):
            conn = _Connection()
            resp = _response(conn)
            resp.feed(wire)
            with pytest.raises(UpstreamError):
                await resp.head()
                await resp.read()
            assert conn.aborted

    run(scenario())


def test_early_close_mid_body_fails_with_upstream_error():
    async def scenario():
        conn = _Connection()
        resp = _response(conn)
        resp.feed(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n")
        assert await resp.readany() == b"abc"
        resp.feed_eof()
        with pytest.raises(UpstreamError):
            await resp.readany()

    run(scenario())


def test_forwarding_hands_pieces_to_the_sink_and_pauses_on_request():
    async def scenario():
        conn = _Connection()
        resp = _response(conn)
        resp.feed(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nfirst\r\n")
        assert await resp.readany() == b"first"
        resp.feed(b"4\r\nheld\r\n")  # arrives before forwarding starts: the sink gets it first
        got: list[bytes] = []
        blocked = [False]

        def sink(piece: bytes) -> bool:
            got.append(piece)
            return blocked[0]

        resp.forward(sink)
        assert got == [b"held"]
        resp.feed(b"1\r\na\r\n1\r\nb\r\n")  # two chunks in one read: one write
        assert got == [b"held", b"ab"]
        blocked[0] = True
        resp.feed(b"1\r\nc\r\n")
        assert await resp.wait_end() is False and conn.transport.paused
        blocked[0] = False
        resp.resume()
        assert not conn.transport.paused
        resp.feed(b"0\r\n\r\n")
        assert await resp.wait_end() is True
        assert got == [b"held", b"ab", b"c"] and conn.ended is True

    run(scenario())


async def _server(handler) -> tuple[web.AppRunner, str, list]:
    peers: list = []

    async def recording(request: web.Request):
        peers.append(request.transport.get_extra_info("peername")[1])
        return await handler(request)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", recording)
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}", peers


async def _echo(request: web.Request) -> web.Response:
    return web.Response(body=await request.read(), headers={"X-Got": request.headers.get("X-Test", "")})


def test_requests_reuse_a_kept_alive_connection_and_send_headers_and_body():
    async def scenario():
        runner, url, peers = await _server(_echo)
        client = UpstreamClient(keepalive_s=10)
        try:
            for body in (b'{"a": 1}', b'{"b": 2}'):
                resp = await client.request("POST", url, "/x", {"X-Test": "yes"}, body, 1, 5)
                assert resp.status == 200 and resp.header("x-got") == "yes"
                assert await resp.read() == body
                resp.close()
            assert len(peers) == 2 and peers[0] == peers[1]
        finally:
            client.close()
            await runner.cleanup()

    run(scenario())


def test_connections_idle_past_keepalive_are_not_reused():
    async def scenario():
        runner, url, peers = await _server(_echo)
        client = UpstreamClient(keepalive_s=0.05)
        try:
            for _ in range(2):
                resp = await client.request("GET", url, "/health", {}, None, 1, 5)
                await resp.read()
                resp.close()
                await asyncio.sleep(0.1)
            assert len(peers) == 2 and peers[0] != peers[1]
        finally:
            client.close()
            await runner.cleanup()

    run(scenario())


def test_total_timeout_bounds_the_body_and_drops_the_connection():
    async def slow(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        await resp.prepare(request)
        await resp.write(b"first")
        await asyncio.sleep(30)
        return resp

    async def scenario():
        runner, url, peers = await _server(slow)
        client = UpstreamClient(keepalive_s=10)
        try:
            # the bound covers the connect and the server's first write too, which a loaded machine may delay
            resp = await client.request("POST", url, "/x", {}, b"{}", 1, 2.0)
            assert await resp.readany() == b"first"
            with pytest.raises(asyncio.TimeoutError):
                await resp.readany()
            resp = await client.request("POST", url, "/y", {}, b"{}", 1, 5)  # a new connection
            assert len(peers) == 2 and peers[0] != peers[1]
            resp.close()
        finally:
            client.close()
            await runner.cleanup()

    run(scenario())


def test_refused_connection_is_an_upstream_error():
    async def scenario():
        runner, url, _ = await _server(_echo)
        await runner.cleanup()  # nothing listens there now
        client = UpstreamClient(keepalive_s=10)
        with pytest.raises(UpstreamError, match="Cannot connect to host"):
            await client.request("GET", url, "/health", {}, None, 1, 5)

    run(scenario())


def test_only_plain_http_urls_are_accepted():
    async def scenario():
        with pytest.raises(UpstreamError, match="not http://host:port"):
            await UpstreamClient(keepalive_s=1).request("GET", "https://h:1", "/health", {}, None, 1, 1)

    run(scenario())


class _OtherLegFailed(Exception):
    pass


def test_an_answer_failed_while_its_connection_is_made_sends_nothing():
    async def scenario():
        runner, url, peers = await _server(_echo)
        client = UpstreamClient(keepalive_s=10)
        try:
            resp = client.start("POST", url, "/x", {}, b"{}", 1, 5)  # no idle connection: connects in the background
            resp.fail(_OtherLegFailed())
            with pytest.raises(_OtherLegFailed):
                await answer_head(resp)
            await asyncio.sleep(0.1)
            assert peers == []
        finally:
            client.close()
            await runner.cleanup()

    run(scenario())


def test_failing_an_answer_wakes_its_reader_and_drops_the_connection():
    async def scenario():
        dropped = asyncio.Event()

        async def slow(request: web.Request) -> web.StreamResponse:
            resp = web.StreamResponse()
            await resp.prepare(request)
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                dropped.set()
                raise
            return resp

        runner, url, _ = await _server(slow)
        client = UpstreamClient(keepalive_s=10)
        try:
            resp = await client.request("POST", url, "/x", {}, b"{}", 1, 5)
            reader = asyncio.ensure_future(resp.readany())
            await asyncio.sleep(0.05)
            resp.fail(_OtherLegFailed())
            with pytest.raises(_OtherLegFailed):
                await reader
            await asyncio.wait_for(dropped.wait(), 2)  # the instance saw its client go
        finally:
            client.close()
            await runner.cleanup()

    run(scenario())


def test_no_connection_within_connect_s_is_an_upstream_error():
    async def scenario():
        loop = asyncio.get_running_loop()

        async def never_connects(*args, **kwargs):
            await asyncio.sleep(30)

        loop.create_connection = never_connects  # type: ignore[method-assign]
        with pytest.raises(UpstreamError, match="no connection within 0.1 s"):
            await UpstreamClient(keepalive_s=10).request("GET", "http://127.0.0.1:1", "/health", {}, None, 0.1, 5)

    run(scenario())


STREAM_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"


def test_a_silence_limit_replaces_the_deadline_and_fails_only_a_stream_that_stops_sending():
    async def scenario():
        conn = _Connection()
        loop = asyncio.get_running_loop()
        resp = UpstreamResponse(conn, loop, loop.time() + 0.05)  # type: ignore[arg-type]
        resp.feed(STREAM_HEAD)
        resp.limit_silence(2.0)  # far above the pieces' gaps, however late a loaded machine runs this loop
        for _ in range(25):  # 2.5 s of a steady stream: past the 0.05 s deadline and the limit, never 2 s quiet
            await asyncio.sleep(0.1)
            resp.feed(b"5\r\ntoken\r\n")
            assert await resp.readany() == b"token"
        with pytest.raises(asyncio.TimeoutError, match="sent nothing for 2 s"):
            await resp.readany()  # then it stops sending
        assert conn.aborted

    run(scenario())


def test_time_paused_for_a_slow_client_is_not_silence():
    async def scenario():
        conn = _Connection()
        loop = asyncio.get_running_loop()
        resp = UpstreamResponse(conn, loop, loop.time() + 10)  # type: ignore[arg-type]
        resp.feed(STREAM_HEAD)
        resp.forward(lambda piece: True)  # the client's buffer is full: pause after each piece
        resp.limit_silence(0.05)
        resp.feed(b"5\r\ntoken\r\n")
        assert conn.transport.paused and await resp.wait_end() is False
        await asyncio.sleep(0.2)  # paused four times the limit
        resp.resume()
        resp.feed(b"0\r\n\r\n")
        assert await resp.wait_end() is True

    run(scenario())
