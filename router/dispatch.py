"""One client request -> the legs each protocol needs, with retry-once, cancellation and streaming.

Invariants:
- nothing reaches the client until the decode leg produced its first token (or its full answer), so
  every failure before that point can be retried on another pair;
- a failing leg cancels (closes the connection of) the other leg of the same attempt, so neither
  instance keeps blocks reserved for a request nobody waits for;
- every request ends in a complete answer or an OpenAI-style error (a stream that breaks after its
  first token ends with an error event and `data: [DONE]`).
"""
from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from . import metrics as M
from .config import RouterConfig
from .errors import error_response, sse_error_event
from .pool import Instance, Pool
from .protocols import CONCURRENT_PROTOCOLS, concurrent_legs, new_transfer_id, pull_decode_leg, pull_prefill_leg
from .relay import StreamRelay
from .upstream_http import UpstreamClient, UpstreamError, UpstreamResponse, answer_head

log = logging.getLogger("kvpush.router")

DONE_EVENT = b"data: [DONE]\n\n"
_TOKEN_DELTA_KEYS = ("content", "reasoning_content", "reasoning", "tool_calls")


class LegFailure(Exception):
    """A leg failed in a way another attempt may fix (connection, 5xx, timeout, transfer)."""

    def __init__(self, role: str, instance: str, reason: str, detail: str):
        super().__init__(f"{role} leg on instance {instance} failed: {detail}")
        self.role, self.instance, self.reason = role, instance, reason


class OtherLegFailed(Exception):
    """What a leg's answer is failed with when the other leg of its attempt failed first."""


def _fail_if_failed(resp: UpstreamResponse, task: asyncio.Task) -> None:
    """Done callback of a leg's task: its failure ends the wait on the other leg's answer `resp`."""
    if not task.cancelled() and task.exception() is not None:
        resp.fail(OtherLegFailed())


class UpstreamClientError(Exception):
    """The instance rejected the request itself (4xx): the client gets that answer verbatim."""

    def __init__(self, status: int, body: bytes, content_type: str):
        super().__init__(f"upstream answered {status}")
        self.status, self.body, self.content_type = status, body, content_type


@dataclass
class RequestContext:
    request: web.Request
    endpoint: str  # "/v1/completions" or "/v1/chat/completions"
    body: dict
    raw: bytes  # the client's body as sent: legs that change nothing forward it without re-encoding
    stream: bool
    started: float = field(default_factory=time.perf_counter)

    @property
    def chat(self) -> bool:
        return self.endpoint.endswith("/chat/completions")


@dataclass
class DecodeHead:
    """The decode leg up to its first token: what was read so far, ready to hand to the client."""

    leg: "Leg"
    resp: UpstreamResponse | None  # None once fully read
    held: bytes
    content_type: str
    first_token_at: float


class Leg:
    """Bookkeeping of one leg on one instance: in-flight count, latency, health verdict."""

    def __init__(self, pool: Pool, inst: Instance, metrics: M.RouterMetrics):
        self.pool, self.inst, self.metrics = pool, inst, metrics
        self.started = time.perf_counter()
        self._ended = False
        pool.leg_started(inst)

    @property
    def role(self) -> str:
        return self.pool.role

    @property
    def name(self) -> str:
        return self.inst.name

    @property
    def ended(self) -> bool:
        return self._ended

    def end(self, failure: str | None = None, cancelled: bool = False) -> None:
        if self._ended:
            return
        self._ended = True
        self.pool.leg_ended(self.inst)
        if cancelled:
            return
        if failure is None:
            self.pool.succeeded(self.inst)
            self.pool.leg_latency.observe(time.perf_counter() - self.started)
        else:
            self.pool.failed(self.inst, failure)


def classify_event(event: bytes) -> str:
    """'token' (the first output the client should see), 'error', 'done' or 'other' (e.g. a
    role-only chat chunk that precedes the first token)."""
    if not event.startswith(b"data: "):
        return "other"
    payload = event[6:].strip()
    if payload == b"[DONE]":
        return "done"
    try:
        obj = json.loads(payload)
    except ValueError:
        return "other"
    if not isinstance(obj, dict):
        return "other"
    if "error" in obj:
        return "error"
    for choice in obj.get("choices") or ():
        reason = choice.get("finish_reason")
        if reason == "error":
            return "error"
        if reason is not None or choice.get("text"):
            return "token"
        delta = choice.get("delta") or {}
        if any(delta.get(k) for k in _TOKEN_DELTA_KEYS):
            return "token"
    return "other"


def _error_message(payload: bytes) -> str:
    try:
        err = json.loads(payload.split(b"data: ", 1)[-1]).get("error")
        return err.get("message", str(err)) if isinstance(err, dict) else str(err)
    except (ValueError, AttributeError):
        return payload[:200].decode(errors="replace")


class Dispatcher:
    def __init__(self, config: RouterConfig, prefill: Pool, decode: Pool, metrics: M.RouterMetrics,
                 upstream: UpstreamClient, api_key: str | None):
        self.config = config
        self.prefill = prefill
        self.decode = decode
        self.metrics = metrics
        self.upstream = upstream
        self.api_key = api_key
        self._detached: set[asyncio.Task] = set()

    # --- request level ---------------------------------------------------------------------

    async def handle(self, ctx: RequestContext) -> web.StreamResponse:
        outcome = M.FAILED
        try:
            response, outcome = await self._handle_with_retry(ctx)
            return response
        except asyncio.CancelledError:
            outcome = M.CANCELLED
            raise
        finally:
            self.metrics.request_done(ctx.endpoint, outcome)
            self.metrics.latency.observe(time.perf_counter() - ctx.started)

    async def _handle_with_retry(self, ctx: RequestContext) -> tuple[web.StreamResponse, str]:
        avoid = {"prefill": set(), "decode": set()}
        failure: LegFailure | None = None
        for attempt in range(self.config.max_retries + 1):
            decode = self.decode.pick(avoid["decode"])
            if decode is None:
                return self._unavailable("decode", failure), M.UNAVAILABLE
            prefill = None
            if self.config.protocol != "colocated":
                prefill = self.prefill.pick(avoid["prefill"])
            if attempt > 0 and failure is not None:
                self.metrics.retries.labels(failure.reason).inc()
                log.warning("retrying %s (attempt %d): %s", ctx.endpoint, attempt + 1, failure)
            try:
                head = await self._attempt(ctx, prefill, decode)
            except LegFailure as exc:
                failure = exc
                avoid[exc.role].add(exc.instance)
                continue
            except UpstreamClientError as exc:
                return web.Response(status=exc.status, body=exc.body, headers={"Content-Type": exc.content_type}), M.CLIENT_ERROR
            return await self._respond(ctx, head)
        assert failure is not None
        status = 504 if failure.reason == "timeout" else 502
        tries = self.config.max_retries + 1
        return error_response(status, f"{failure}; gave up after {tries} attempt{'s' if tries > 1 else ''}"), M.FAILED

    def _unavailable(self, role: str, failure: LegFailure | None) -> web.Response:
        pool = self.decode if role == "decode" else self.prefill
        names = ", ".join(i.name for i in pool.instances)
        last = f"; last failure: {failure}" if failure is not None else ""
        return error_response(503, f"no {role} instance in rotation ({names} failed and are being probed; retry later){last}")

    # --- attempts per protocol -------------------------------------------------------------

    def _headers(self, request_id: str | None) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        if request_id:
            headers["X-Request-Id"] = request_id
        return headers

    async def _attempt(self, ctx: RequestContext, prefill: Instance | None, decode: Instance) -> DecodeHead:
        protocol = self.config.protocol
        decode_s = self.config.timeouts.decode_s
        if protocol == "colocated":
            headers = self._headers(ctx.request.headers.get("X-Request-Id"))
            return await self._decode_head(ctx, *self._send(self.decode, decode, ctx.endpoint, ctx.raw, headers, decode_s))
        if prefill is None:  # every prefill instance is out: decode computes the prompt itself
            self.metrics.fallbacks.inc()
            headers = self._headers(new_transfer_id())
            return await self._decode_head(ctx, *self._send(self.decode, decode, ctx.endpoint, ctx.raw, headers, decode_s))
        transfer_id = new_transfer_id()
        headers = self._headers(transfer_id)
        if protocol in CONCURRENT_PROTOCOLS:
            legs = concurrent_legs(protocol, ctx.body, ctx.chat, transfer_id, prefill.upstream, decode.upstream)
            return await self._concurrent(ctx, prefill, legs.prefill, decode, legs.decode, headers)
        prefill_leg, prefill_resp = self._send(self.prefill, prefill, ctx.endpoint, pull_prefill_leg(ctx.body, ctx.chat),
                                               headers, self.config.timeouts.prefill_s)
        answer, answered_at = await self._prefill_answer(prefill_leg, prefill_resp)
        decode_body = pull_decode_leg(ctx.body, answer)
        if decode_body is None:
            Leg(self.prefill, prefill, self.metrics).end("no_kv_transfer_params")
            raise LegFailure("prefill", prefill.name, "no_kv_transfer_params",
                             "answer carried no kv_transfer_params (is the instance started with NixlConnector?)")
        head = await self._decode_head(ctx, *self._send(self.decode, decode, ctx.endpoint, decode_body, headers, decode_s))
        self.metrics.handoff_gap.observe(max(0.0, head.first_token_at - answered_at))
        return head

    async def _concurrent(self, ctx: RequestContext, prefill: Instance, prefill_body: dict,
                          decode: Instance, decode_body: dict, headers: dict) -> DecodeHead:
        """Both legs at once. Both are written to their instances before this coroutine yields
        (decode's first: its first token is what the client waits for), and decode's answer is read
        right here, as colocated reads its one leg: every task step in between (a leg's own, then the
        wake-up of whoever waits for it) waits behind all callbacks already queued, ~1 ms at 64
        streams. Prefill's answer is read by a task; its failure ends the wait for decode's first
        token at once (decode is cancelled, and the attempt fails with prefill's failure)."""
        timeouts = self.config.timeouts
        decode_leg, decode_resp = self._send(self.decode, decode, ctx.endpoint, decode_body, headers, timeouts.decode_s)
        try:
            prefill_leg, prefill_resp = self._send(self.prefill, prefill, ctx.endpoint, prefill_body, headers,
                                                   timeouts.prefill_s)
        except LegFailure:  # decode's leg is out already: it must not hold its blocks for nothing
            decode_leg.end(cancelled=True)
            decode_resp.close()
            raise
        prefill_task = self._leg_task(self._prefill_answer(prefill_leg, prefill_resp), prefill_leg, prefill_resp)
        end_decode_wait = functools.partial(_fail_if_failed, decode_resp)
        prefill_task.add_done_callback(end_decode_wait)
        try:
            head = await self._decode_head(ctx, decode_leg, decode_resp)
            if prefill_task.done():
                _, answered_at = prefill_task.result()  # a prefill failure wins over the token that came with it
                self.metrics.handoff_gap.observe(max(0.0, head.first_token_at - answered_at))
                return head
        except BaseException as exc:
            decode_leg.end(cancelled=True)  # a no-op where decode's own failure ended it
            decode_resp.close()
            prefill_task.cancel()
            await self._settle(prefill_task)
            if isinstance(exc, OtherLegFailed):
                raise prefill_task.exception() from None
            raise
        # Decode's first token came before prefill's HTTP answer (the KV already arrived): let the
        # prefill leg finish on its own; it frees nothing the client waits for.
        prefill_task.remove_done_callback(end_decode_wait)
        self.metrics.handoff_gap.observe(0.0)
        self._detach(prefill_task)
        return head

    async def _settle(self, *tasks: asyncio.Task) -> None:
        """Wait for cancelled legs to close their connections; their own outcome is already recorded."""
        pending = [t for t in tasks if t not in self._detached]
        for task in pending:
            if not task.done():
                try:
                    await asyncio.wait({task})
                except asyncio.CancelledError:
                    for t in pending:
                        t.cancel()
                    raise
            if not task.cancelled():
                task.exception()  # mark retrieved

    def _send(self, pool: Pool, inst: Instance, path: str, body: dict | bytes, headers: dict,
              timeout_s: float) -> tuple[Leg, UpstreamResponse]:
        """Count the leg and send it: written now on a pooled connection, else once connected."""
        leg = Leg(pool, inst, self.metrics)
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        try:
            return leg, self.upstream.start("POST", inst.upstream.url, path, headers, data,
                                            self.config.timeouts.connect_s, timeout_s)
        except UpstreamError as exc:  # e.g. an unusable URL: counted and ended like a refused connection
            raise self._fail(leg, "connect", str(exc)) from None

    @staticmethod
    def _leg_task(coro: Any, leg: Leg, resp: UpstreamResponse) -> asyncio.Task:
        """A task for a leg already counted and sent: one cancelled before its first step never
        runs its own clean-up, so the leg is ended and its answer closed here."""
        task = asyncio.ensure_future(coro)

        def cleanup(t: asyncio.Task) -> None:
            if t.cancelled():
                leg.end(cancelled=True)
                resp.close()

        task.add_done_callback(cleanup)
        return task

    def _detach(self, task: asyncio.Task) -> None:
        self._detached.add(task)

        def forget(t: asyncio.Task) -> None:
            self._detached.discard(t)
            if not t.cancelled() and t.exception() is not None:
                log.info("detached prefill leg ended with %s", t.exception())

        task.add_done_callback(forget)

    async def close(self) -> None:
        for task in list(self._detached):
            task.cancel()
        if self._detached:
            await asyncio.wait(list(self._detached), timeout=5)

    # --- legs --------------------------------------------------------------------------------

    async def _answer_head(self, leg: Leg, resp: UpstreamResponse, timeout_s: float) -> UpstreamResponse:
        try:
            return await answer_head(resp)
        except asyncio.TimeoutError:
            raise self._fail(leg, "timeout", f"no answer within {timeout_s:g} s") from None
        except UpstreamError as exc:
            raise self._fail(leg, "connect", str(exc)) from None

    def _fail(self, leg: Leg, reason: str, detail: str) -> LegFailure:
        leg.end(reason)
        return LegFailure(leg.role, leg.name, reason, detail)

    async def _read_error(self, leg: Leg, resp: UpstreamResponse) -> Exception:
        """A non-200 answer: 4xx goes to the client verbatim, anything else is a leg failure."""
        try:
            body = await resp.read()
        except (UpstreamError, asyncio.TimeoutError):
            body = b""
        finally:
            resp.close()
        if 400 <= resp.status < 500 and resp.status not in (408, 429):
            leg.end()
            return UpstreamClientError(resp.status, body, resp.header("content-type", "application/json"))
        return self._fail(leg, f"http_{resp.status}", f"HTTP {resp.status}: {_error_message(body)}")

    async def _prefill_answer(self, leg: Leg, resp: UpstreamResponse) -> tuple[dict, float]:
        """Prefill's whole (JSON) answer, and when it came."""
        timeout_s = self.config.timeouts.prefill_s
        try:
            await self._answer_head(leg, resp, timeout_s)
            if resp.status != 200:
                raise await self._read_error(leg, resp)
            try:
                raw = await resp.read()
            except asyncio.TimeoutError:
                raise self._fail(leg, "timeout", f"no answer within {timeout_s:g} s") from None
            except UpstreamError as exc:
                raise self._fail(leg, "connect", str(exc)) from None
            finally:
                resp.close()
            answered_at = time.perf_counter()
            try:
                answer = json.loads(raw)
            except ValueError:
                raise self._fail(leg, "bad_answer", f"answer is not JSON: {raw[:100]!r}") from None
            leg.end()
            return answer, answered_at
        except asyncio.CancelledError:
            leg.end(cancelled=True)
            raise

    async def _decode_head(self, ctx: RequestContext, leg: Leg, resp: UpstreamResponse) -> DecodeHead:
        """Decode's answer up to its first token (streaming) or whole; a failure before the first
        token is a LegFailure, which another attempt may fix."""
        timeout_s = self.config.timeouts.decode_s
        try:
            await self._answer_head(leg, resp, timeout_s)
            if resp.status != 200:
                raise await self._read_error(leg, resp)
            content_type = resp.header("content-type", "application/json")
            if not ctx.stream:
                raw = await resp.read()
                resp.release()
                return DecodeHead(leg, None, raw, content_type, time.perf_counter())
            held = bytearray()
            scanned = 0
            while True:
                chunk = await resp.readany()
                if not chunk:  # ended before any token: hand over what came, the client sees it as is
                    resp.release()
                    return DecodeHead(leg, None, bytes(held), content_type, time.perf_counter())
                held += chunk
                while (end := held.find(b"\n\n", scanned)) >= 0:
                    event = bytes(held[scanned:end])
                    scanned = end + 2
                    kind = classify_event(event)
                    if kind == "error":  # e.g. the KV transfer failed: vLLM finishes the request with an error
                        raise self._fail(leg, "generation_error", f"stream error before the first token: {_error_message(event)}")
                    if kind in ("token", "done"):
                        return DecodeHead(leg, resp, bytes(held), content_type, time.perf_counter())
        except asyncio.TimeoutError:
            raise self._fail(leg, "timeout", f"no first token within {timeout_s:g} s") from None
        except UpstreamError as exc:
            raise self._fail(leg, "connect", str(exc)) from None
        except asyncio.CancelledError:
            leg.end(cancelled=True)
            raise
        finally:
            if leg.ended:
                resp.close()

    # --- answering the client ----------------------------------------------------------------

    async def _respond(self, ctx: RequestContext, head: DecodeHead) -> tuple[web.StreamResponse, str]:
        if not ctx.stream:
            head.leg.end()
            return web.Response(status=200, body=head.held, headers={"Content-Type": head.content_type}), M.OK
        client = web.StreamResponse(status=200, headers={"Content-Type": head.content_type})
        outcome = M.OK
        resp = head.resp
        try:
            await client.prepare(ctx.request)
            await client.write(head.held)
            now = time.perf_counter()
            self.metrics.ttft.observe(now - ctx.started)
            # what the router itself adds, whatever the instances and the transfer took
            self.metrics.own_latency.observe((head.leg.started - ctx.started) + (now - head.first_token_at))
            tail = head.held[-len(DONE_EVENT):]
            if resp is not None:
                transport = ctx.request.transport
                if transport is None:
                    raise ConnectionResetError("the client went away")
                chunked = client.headers.get("Transfer-Encoding") == "chunked"  # as aiohttp chose in prepare()
                relay = StreamRelay(transport, chunked, tail, len(DONE_EVENT))
                resp.forward(relay)
                try:
                    while not await resp.wait_end():  # paused: the client reads slower than tokens come
                        await relay.drained()
                        if relay.client_gone:
                            raise ConnectionResetError("the client went away")
                        resp.resume()
                except (UpstreamError, asyncio.TimeoutError) as exc:
                    if relay.client_gone:
                        raise ConnectionResetError("the client went away") from None
                    detail = "timeout" if isinstance(exc, asyncio.TimeoutError) else str(exc)
                    head.leg.end("mid_stream")
                    await client.write(sse_error_event(502, f"decode leg on instance {head.leg.name} failed mid-stream: {detail}"))
                    return client, M.FAILED_MID_STREAM
                if relay.client_gone:
                    raise ConnectionResetError("the client went away")
                tail = relay.tail
                if relay.saw_error:
                    outcome = M.FAILED_MID_STREAM
            if tail != DONE_EVENT:  # the upstream closed cleanly but early
                head.leg.end("mid_stream")
                await client.write(sse_error_event(502, f"decode leg on instance {head.leg.name} ended its stream early"))
                return client, M.FAILED_MID_STREAM
            head.leg.end()
            await client.write_eof()
            return client, outcome
        except (ConnectionResetError, asyncio.CancelledError) as exc:
            head.leg.end(cancelled=True)
            if isinstance(exc, asyncio.CancelledError):
                raise
            return client, M.CANCELLED
        finally:
            if resp is not None:
                resp.close()
