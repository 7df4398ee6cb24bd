"""One client request: its parts (fanout.py), each part's retryable phase (attempts.py), then the
answer (respond.py).

Each part goes through two phases:
1. retryable, from the pair choice up to decode's head (a stream's first token, a non-streamed
   answer's status line). A LegFailure here is retried (max_retries) with a new transfer id on a
   pair that avoids the failed instance (and the prefill of a transfer decode failed, attempts.py):
   another decode, or the same one if there is no other; another prefill, or none (decode computes
   the prompt) if every prefill in rotation failed this part. An instance's 4xx ends the request
   with that answer, unchanged.
2. answering, from the first byte to the client on: nothing is retried. A failure ends a stream
   with an error event and `data: [DONE]`, a non-streamed answer with a 502.
A batch is answered once every part reached phase 2, so one prompt's 4xx rejects the batch, as
vLLM would; a part that fails for good fails the batch.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from aiohttp import web

from . import metrics as M
from .attempts import Attempts
from .config import RouterConfig
from .errors import error_response
from .fanout import NO_PREFILL, PREFILL_FAILED, Part, way_to_decode
from .legs import DecodeHead, LegFailure, LegRunner, UpstreamClientError
from .pool import Pool
from .respond import Responder
from .upstream_http import UpstreamClient

log = logging.getLogger("kvpush.router")

DECODE_COMPUTED_HEADER = "X-Kvpush-Decode-Computed-Prompt"  # why decode computed a prompt itself


class EarlyAnswer(Exception):
    """The request ends before its answer started, with this response (4xx, 502/504, 503)."""

    def __init__(self, response: web.Response, outcome: str):
        super().__init__(outcome)
        self.response, self.outcome = response, outcome


@dataclass
class RequestContext:
    request: web.Request
    endpoint: str  # "/v1/completions" or "/v1/chat/completions"
    stream: bool
    parts: list[Part]
    client_request_id: str | None = None  # the client's X-Request-Id, already checked
    started: float = field(default_factory=time.perf_counter)

    @property
    def chat(self) -> bool:
        return self.endpoint.endswith("/chat/completions")


class Dispatcher:
    def __init__(self, config: RouterConfig, prefill: Pool, decode: Pool, metrics: M.RouterMetrics,
                 upstream: UpstreamClient, instance_key: str | None):
        self.config = config
        self.prefill = prefill
        self.decode = decode
        self.metrics = metrics
        self.legs = LegRunner(config, upstream, metrics, instance_key)
        self.attempts = Attempts(config, prefill, decode, metrics, self.legs)
        self.responder = Responder(config, metrics)

    async def close(self) -> None:
        await self.attempts.close()

    async def handle(self, ctx: RequestContext) -> web.StreamResponse:
        outcome = M.FAILED
        try:
            try:
                heads, local_reasons = await self._heads(ctx)
            except EarlyAnswer as answer:
                outcome = answer.outcome
                return answer.response
            headers = {DECODE_COMPUTED_HEADER: ", ".join(sorted(local_reasons))} if local_reasons else {}
            response, outcome = await self.responder.answer(ctx, heads, headers)
            return response
        except asyncio.CancelledError:
            outcome = M.CANCELLED
            raise
        finally:
            self.metrics.request_done(ctx.endpoint, outcome)
            self.metrics.latency.observe(time.perf_counter() - ctx.started)

    # --- phase 1: every part up to decode's head ----------------------------------------------

    async def _heads(self, ctx: RequestContext) -> tuple[list[DecodeHead], set[str]]:
        reasons: set[str] = set()
        if len(ctx.parts) == 1:
            return [await self._head(ctx, ctx.parts[0], reasons)], reasons
        tasks = [asyncio.ensure_future(self._head(ctx, part, reasons)) for part in ctx.parts]
        try:
            pending = set(tasks)
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_EXCEPTION)
                failed = next((t for t in tasks if t in done and not t.cancelled() and t.exception()), None)
                if failed is not None:
                    raise failed.exception()  # type: ignore[misc]
            return [t.result() for t in tasks], reasons
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.wait(tasks)
            for task in tasks:
                if not task.cancelled() and task.exception() is None:
                    task.result().abandon()
            raise

    async def _head(self, ctx: RequestContext, part: Part, local_reasons: set[str]) -> DecodeHead:
        colocated = self.config.protocol == "colocated"
        avoid: dict[str, set[str]] = {"prefill": set(), "decode": set()}
        failure: LegFailure | None = None
        for attempt in range(self.config.max_retries + 1):
            decode = self.decode.pick(avoid["decode"])
            if decode is None:
                raise EarlyAnswer(self._unavailable("decode", failure), M.UNAVAILABLE)
            prefill = None if colocated else self.prefill.pick(avoid["prefill"], strict=True)
            way, why_local = way_to_decode(part.body, ctx.chat, colocated, prefill is not None,
                                           decode.prefix_caching is not False)
            if why_local == NO_PREFILL and avoid["prefill"] and self.prefill.available():
                why_local = PREFILL_FAILED
            if attempt > 0 and failure is not None:
                self.metrics.retries.labels(failure.reason).inc()
                log.warning("retrying %s (attempt %d): %s", ctx.endpoint, attempt + 1, failure)
            try:
                head = await self.attempts.run(ctx.endpoint, ctx.chat, ctx.stream, part, way, why_local,
                                               ctx.client_request_id, prefill, decode)
            except LegFailure as exc:
                failure = exc
                avoid[exc.role].add(exc.instance)
                for role, name in exc.also_avoid:
                    avoid[role].add(name)
                continue
            except UpstreamClientError as exc:
                raise EarlyAnswer(exc.response(), M.CLIENT_ERROR) from None
            if why_local is not None:
                local_reasons.add(why_local)
            return head
        assert failure is not None
        status = 504 if failure.reason == "timeout" else 502
        tries = self.config.max_retries + 1
        raise EarlyAnswer(error_response(status, f"{failure}; gave up after {tries} attempt{'s' if tries > 1 else ''}"),
                          M.FAILED)

    def _unavailable(self, role: str, failure: LegFailure | None) -> web.Response:
        pool = self.decode if role == "decode" else self.prefill
        names = ", ".join(i.name for i in pool.instances)
        last = f"; last failure: {failure}" if failure is not None else ""
        return error_response(503, f"no {role} instance in rotation ({names} failed and are being probed; retry later){last}")
