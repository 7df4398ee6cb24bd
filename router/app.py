"""The router's HTTP front (aiohttp): routes, API key, validation; the process's signals (stop,
reload). The background health, load and instance-list work is rotation.py's."""
from __future__ import annotations

import asyncio
import gc
import logging
import secrets
import signal
import socket
import threading
import time
from pathlib import Path

from aiohttp import web
from aiohttp.http import HttpVersion11

from .config import RouterConfig
from .connections import ConnectionGuard, GuardedSite, closing, listening_socket, raise_open_files_limit
from .dispatch import Dispatcher
from .errors import error_response
from .fanout import split
from .keys import Keys
from .metrics import CLIENT_ERROR, RouterMetrics
from .pool import Pool
from .process_signals import RELOAD_SIGNAL, STOP_SIGNALS, describe_process
from .reload import InstanceListReloader
from .request_context import RequestContext
from .rotation import Rotation
from .upstream_http import UpstreamClient, UpstreamError
from .validation import RequestRejected, check_request_id, parse_request

log = logging.getLogger("kvpush.router")

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
# Far below vLLM's (uvicorn's) 5 s keep-alive: on a loaded host the two timers drift, and a leg
# sent on a connection the server is closing that instant fails with a reset (seen at 4 s).
UPSTREAM_KEEPALIVE_S = 2.0
# How long a refused request's unread body is read and dropped before the connection closes, so
# the client reads the refusal instead of a reset (aiohttp's default, 10 s, holds a connection).
LINGER_S = 1.0


class Router:
    def __init__(self, config: RouterConfig, keys: Keys):
        self.config = config
        self.keys = keys
        self.public_paths = frozenset(config.public_paths)
        self.metrics = RouterMetrics()
        self.guard = ConnectionGuard(config, self.metrics)
        self.prefill = Pool("prefill", config.prefill, config.policy, config.eject_after_failures, self.metrics,
                            config.prefix_aware)
        self.decode = Pool("decode", config.decode, config.policy, config.eject_after_failures, self.metrics,
                           config.prefix_aware)
        self.upstream: UpstreamClient | None = None
        self.dispatcher: Dispatcher | None = None
        self.rotation: Rotation | None = None
        self.reloader: InstanceListReloader | None = None

    # --- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        self.guard.start()
        # Idle upstream connections are dropped before vLLM's (uvicorn's) 5 s keep-alive closes them,
        # so a leg never goes out on a connection the server is closing at that moment.
        self.upstream = UpstreamClient(keepalive_s=UPSTREAM_KEEPALIVE_S)
        self.dispatcher = Dispatcher(self.config, self.prefill, self.decode, self.metrics, self.upstream,
                                     self.keys.instance)
        self.rotation = Rotation(self.config, self.prefill, self.decode, self.metrics, self._get)
        self.reloader = InstanceListReloader(self.config.instances_file, self.rotation.take)
        await self.rotation.start()

    async def stop(self) -> None:
        self.guard.stop()
        if self.rotation is not None:
            await self.rotation.stop()
        if self.dispatcher is not None:
            await self.dispatcher.close()
        if self.upstream is not None:
            self.upstream.close()

    def reload(self) -> asyncio.Task | None:
        """Read the instance list of instances_file again (on SIGHUP), off the event loop; the task
        that takes it."""
        return self.reloader.request() if self.reloader is not None else None

    def pools(self) -> list[Pool]:
        return [self.prefill, self.decode]

    def _instance_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.keys.instance}"} if self.keys.instance else {}

    async def _get(self, base_url: str, path: str, timeout_s: float) -> tuple[int, str]:
        assert self.upstream is not None
        resp = await self.upstream.request("GET", base_url, path, self._instance_headers(), None, timeout_s, timeout_s)
        try:
            return resp.status, (await resp.read()).decode(errors="replace")
        finally:
            resp.close()

    # --- handlers ------------------------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, COMPLETIONS)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, CHAT)

    async def _generate(self, request: web.Request, endpoint: str) -> web.StreamResponse:
        started = time.perf_counter()
        config = self.config
        chat = endpoint == CHAT
        try:
            request_id = check_request_id(request.headers.get("X-Request-Id"))
            raw = await self.guard.read_body(request)
            parsed = parse_request(
                raw, chat, config.served_model_name, config.max_prompt_chars, config.max_batch_prompts
            )
            parts = split(parsed, chat, config.protocol == "colocated")
        except RequestRejected as exc:
            return self._rejected(endpoint, exc)
        assert self.dispatcher is not None
        ctx = RequestContext(request, endpoint, bool(parsed.body.get("stream")), parts, request_id, started)
        return await self.dispatcher.handle(ctx)

    def _rejected(self, endpoint: str, exc: RequestRejected) -> web.Response:
        self.metrics.request_done(endpoint, CLIENT_ERROR)
        return rejection(exc)

    async def _forward(self, request: web.Request) -> web.Response | None:
        """The request as-is to the first decode instance that answers; None if none does."""
        assert self.upstream is not None
        headers = {"Content-Type": "application/json", **self._instance_headers()}
        body = await self.guard.read_body(request)
        timeouts = self.config.timeouts
        for inst in self.decode.available():
            try:
                resp = await self.upstream.request(request.method, inst.upstream.url, request.path, headers,
                                                   body or None, timeouts.connect_s, timeouts.decode_s)
                try:
                    return web.Response(status=resp.status, body=await resp.read(),
                                        headers={"Content-Type": resp.header("content-type", "application/json")})
                finally:
                    resp.close()
            except (UpstreamError, asyncio.TimeoutError):
                continue
        return None

    async def models(self, request: web.Request) -> web.Response:
        """vLLM's own answer from a decode instance; a locally built one if none answers."""
        answer = await self._forward(request)
        if answer is not None and answer.status == 200:
            return answer
        name = self.config.served_model_name
        return web.json_response({"object": "list", "data": [
            {"id": name, "object": "model", "created": int(time.time()), "owned_by": "vllm", "root": name,
             "parent": None, "permission": []}]})

    async def passthrough(self, request: web.Request) -> web.Response:
        """Model-level utilities (/tokenize, /detokenize, /version): any decode instance answers them."""
        answer = await self._forward(request)
        return answer if answer is not None else error_response(503, f"no decode instance answered {request.path}")

    async def health(self, request: web.Request) -> web.Response:
        """200 while every role has an instance in rotation, else 503 naming the missing role.

        A router serving by fallback (decode alone) still answers requests, but it is not healthy:
        a health check must not stay green while no KV is being transferred."""
        missing = [p.role for p in self.pools() if len(p) and not p.available()]
        if not missing:
            return web.Response(status=200)
        return web.Response(status=503, text=f"no {' or '.join(missing)} instance in rotation")

    async def metrics_endpoint(self, request: web.Request) -> web.Response:
        body, content_type = self.metrics.exposition()
        return web.Response(body=body, headers={"Content-Type": content_type})

    async def not_found(self, request: web.Request) -> web.Response:
        return error_response(404, f"{request.method} {request.path} is not served by the kvpush router")

    # --- before a body is read -----------------------------------------------------------------

    def refusal_before_body(self, request: web.BaseRequest) -> web.Response | None:
        """401 for a caller without the key (on every path, unknown ones included, except those the
        config opens: nothing is forwarded, with the instances' key attached, for such a caller),
        413 for a body declared too large; None to go on."""
        key = self.keys.client
        if (
            key
            and request.path not in self.public_paths
            and not authorized(request.headers.get("Authorization", ""), key)
        ):
            unauthorized = web.json_response({"error": "Unauthorized"}, status=401)  # vLLM's exact answer
            return unauthorized if request.content.is_eof() else closing(unauthorized)  # a body left unread
        return self.guard.refuse_declared_body(request)

    async def expect(self, request: web.Request) -> web.Response | None:
        """`Expect: 100-continue`: a request refused before its body is refused before the client
        sends the body; any other is told to go on."""
        refusal = self.refusal_before_body(request)
        if refusal is not None:
            return closing(refusal)
        if request.version != HttpVersion11 or request.headers.get("Expect", "").lower() != "100-continue":
            raise web.HTTPExpectationFailed(text=f"Unknown Expect: {request.headers.get('Expect', '')}")
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.writer.output_size = 0  # the answer's own size counts from here
        return None


ROUTER_KEY = web.AppKey("router", Router)


def authorized(given: str, key: str) -> bool:
    """Constant-time check of an Authorization header; header bytes that are not UTF-8 (aiohttp
    hands them over surrogate-escaped) simply do not match."""
    return secrets.compare_digest(given.encode("utf-8", "surrogateescape"), f"Bearer {key}".encode())


def rejection(exc: RequestRejected) -> web.Response:
    answer = error_response(exc.status, exc.message, exc.param)
    return closing(answer) if exc.status in (408, 413) else answer  # its body was not read whole


@web.middleware
async def _auth_and_errors(request: web.Request, handler):
    router: Router = request.app[ROUTER_KEY]
    refusal = router.refusal_before_body(request)
    if refusal is not None:
        return refusal
    connection = router.guard.request_started(request)
    try:
        return await handler(request)
    except RequestRejected as exc:
        return rejection(exc)
    except web.HTTPException as exc:
        if exc.status == 405:
            return error_response(405, f"method {request.method} not allowed on {request.path}")
        if exc.status == 404:
            return await router.not_found(request)
        raise
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception:  # a bug must still answer like vLLM does, not hang or leak a traceback
        log.exception("unexpected error on %s", request.path)
        return error_response(500, "internal router error; see the router log")
    finally:
        router.guard.request_ended(connection)


def build_app(config: RouterConfig, keys: Keys) -> web.Application:
    router = Router(config, keys)
    app = web.Application(middlewares=[_auth_and_errors], client_max_size=config.max_body_bytes)
    app[ROUTER_KEY] = router

    async def lifecycle(_app: web.Application):
        await router.start()
        yield
        await router.stop()

    app.cleanup_ctx.append(lifecycle)
    app.router.add_post(COMPLETIONS, router.completions, expect_handler=router.expect)
    app.router.add_post(CHAT, router.chat, expect_handler=router.expect)
    app.router.add_get("/v1/models", router.models)
    app.router.add_post("/tokenize", router.passthrough, expect_handler=router.expect)
    app.router.add_post("/detokenize", router.passthrough, expect_handler=router.expect)
    app.router.add_get("/version", router.passthrough)
    app.router.add_get("/health", router.health)
    app.router.add_get("/metrics", router.metrics_endpoint)
    return app


async def start_site(app: web.Application, host: str, port: int,
                     listen_socket: socket.socket | None = None) -> web.AppRunner:
    """Start serving, on host:port or on a socket already listening (a worker's), each connection
    through the router's guard (connections.py); handler cancellation on so a client that leaves
    cancels both legs."""
    router = app[ROUTER_KEY]
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, logger=router.guard.server_log,
                           keepalive_timeout=router.config.keepalive_timeout_s, lingering_time=LINGER_S)
    await runner.setup()
    sock = listen_socket if listen_socket is not None else listening_socket(host, port)
    await GuardedSite(runner, sock, router.guard).start()
    return runner


async def serve(config: RouterConfig, keys: Keys, listen_socket: socket.socket | None = None) -> None:
    """Run in the foreground until SIGINT or SIGTERM, reloading the instance list on SIGHUP (all
    blocked by `run`, awaited on a thread)."""
    app = build_app(config, keys)
    # Everything built so far lives as long as the router: keep it out of the collector's full
    # passes, whose walk over the imported modules' objects otherwise stalls every request in flight.
    gc.collect()
    gc.freeze()
    runner = await start_site(app, config.bind, config.port, listen_socket)
    log.info("kvpush router on http://%s:%d: protocol %s, policy %s, %d prefill, %d decode",
             config.bind, config.port, config.protocol, config.policy, len(config.prefill), len(config.decode))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    router: Router = app[ROUTER_KEY]

    def wait_for_signals() -> None:
        while True:
            info = signal.sigwaitinfo(STOP_SIGNALS | {RELOAD_SIGNAL})
            if info.si_signo == RELOAD_SIGNAL:
                log.info("kvpush router reloading its instance list on SIGHUP from %s", describe_process(info.si_pid))
                loop.call_soon_threadsafe(router.reload)
                continue
            # Who sent it: a stray group kill by another tool looks exactly like `kvpush down` otherwise.
            log.info("kvpush router stopping on %s from %s", signal.Signals(info.si_signo).name,
                     describe_process(info.si_pid))
            loop.call_soon_threadsafe(stop.set)
            return

    threading.Thread(target=wait_for_signals, name="kvpush-router-signals", daemon=True).start()
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


def run(config: RouterConfig, keys: Keys, listen_socket: socket.socket | None = None,
        run_dir_parent: Path | None = None) -> None:
    """Serve in the foreground, on uvloop when it is installed (vLLM ships it): about half the
    per-request CPU of the default loop. With `workers` > 1 this process supervises that many
    router processes instead (their shared files go under `run_dir_parent`, default the temp
    directory); a worker is given the socket it serves on."""
    if config.workers > 1 and listen_socket is None:
        from .workers import supervise

        supervise(config, logging.getLevelName(logging.getLogger().getEffectiveLevel()), run_dir_parent)
        return
    signal.pthread_sigmask(
        signal.SIG_BLOCK, STOP_SIGNALS | {RELOAD_SIGNAL}
    )  # every thread: only serve's waiter takes them
    raise_open_files_limit()  # before the guard sizes its connection cap by it
    try:
        import uvloop
    except ImportError:
        asyncio.run(serve(config, keys, listen_socket))
    else:
        uvloop.run(serve(config, keys, listen_socket))
