"""One client request: its parts (fanout.py), each part's retryable phase (attempts.py), then the
answer (respond.py).

Each part goes through two phases:
1. retryable, from the pair choice up to decode's head (a stream's first token; a non-streamed
   answer whole, since the client sees none of it before). A LegFailure here is tried again with a
   new transfer id on a pair no attempt of the part used (pairs.py): another prefill (and another
   decode where the failure named decode), as long as one is in rotation; then decode computes the
   prompt itself. No attempt starts later than retry_deadline_s after the request arrived. An
   instance's 4xx ends the request with that answer, unchanged.
2. answering, from the first byte to the client on: nothing is retried. A failure ends a stream
   with an error event and `data: [DONE]`.
A batch is answered once every part reached phase 2, so one prompt's 4xx rejects the batch, as
vLLM would; a part that fails for good fails the batch.
"""
from __future__ import annotations

import asyncio
import logging
import time

from aiohttp import web

from . import metrics as M
from .attempts import Attempts
from .config import RouterConfig
from .errors import error_response
from .fallbacks import DecodeComputed
from .fanout import FALLBACKS, LOCAL, Part, wants_prefill, way_to_decode
from .legs import DecodeHead, LegFailure, LegRunner, UpstreamClientError
from .pairs import PartTries
from .pool import Pool
from .request_context import RequestContext
from .respond import Responder
from .upstream_http import UpstreamClient

log = logging.getLogger("kvpush.router")

DECODE_COMPUTED_HEADER = "X-Kvpush-Decode-Computed-Prompt"  # why decode computed a prompt itself


class EarlyAnswer(Exception):
    """The request ends before its answer started, with this response (4xx, 502/504, 503)."""

    def __init__(self, response: web.Response, outcome: str):
        super().__init__(outcome)
        self.response, self.outcome = response, outcome


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
        self.decode_computed = DecodeComputed(metrics)

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
        wants = wants_prefill(part.body, ctx.chat, colocated)
        tries = PartTries(self.prefill, self.decode, self.decode.prompt_of(part.body, ctx.chat))
        while True:
            failure = tries.failures[-1] if tries.failures else None
            if failure is not None and time.perf_counter() - ctx.started >= self.config.retry_deadline_s:
                raise EarlyAnswer(self._gave_up(tries, f"its retry_deadline_s ({self.config.retry_deadline_s:g} s) "
                                                       "passed", 504), M.FAILED)
            pair = tries.next_pair(wants)
            if pair is None:
                if not self.decode.available():
                    raise EarlyAnswer(self._unavailable("decode", failure), M.UNAVAILABLE)
                raise EarlyAnswer(self._gave_up(tries, "no instance in rotation is left that has not failed it"),
                                  M.FAILED)
            way, why_local = way_to_decode(part.body, ctx.chat, colocated, pair.without_prefill,
                                           pair.decode.prefix_caching is not False)
            prefill = None if way == LOCAL else pair.prefill
            if failure is not None:
                self.metrics.retries.labels(failure.reason).inc()
                log.warning("retrying %s (attempt %d, %s): %s", ctx.endpoint, tries.attempts() + 1,
                            f"decode {pair.decode.name} computing the prompt" if prefill is None
                            else f"prefill {prefill.name} -> decode {pair.decode.name}", failure)
            try:
                head = await self.attempts.run(ctx.endpoint, ctx.chat, ctx.stream, part, way, why_local,
                                               ctx.client_request_id, prefill, pair.decode)
            except LegFailure as exc:
                tries.failed(pair, prefill is not None, exc)
                continue
            except UpstreamClientError as exc:
                raise EarlyAnswer(exc.response(), M.CLIENT_ERROR) from None
            if why_local is not None:
                local_reasons.add(why_local)
                self.decode_computed.served(why_local, self._fallback_detail(why_local, failure))
            return head

    def _fallback_detail(self, why_local: str, failure: LegFailure | None) -> str:
        if why_local not in FALLBACKS:
            return ""
        if failure is not None:
            return f"last failure: {failure}"
        return f"prefill instances listed: {', '.join(i.name for i in self.prefill.instances) or 'none'}"

    def _gave_up(self, tries: PartTries, why: str, status: int = 502) -> web.Response:
        """The answer of a part no attempt could serve: why, what was tried, what failed last."""
        last = tries.failures[-1]
        if last.reason == "timeout":
            status = 504
        tried = [f"{f.role} {f.instance}: {f.reason}" for f in tries.failures]
        n = tries.attempts()
        return error_response(status, f"gave up after {n} attempt{'s' if n > 1 else ''}: {why} "
                                      f"(failures: {', '.join(tried)}); last failure: {last}")

    def _unavailable(self, role: str, failure: LegFailure | None) -> web.Response:
        pool = self.decode if role == "decode" else self.prefill
        names = ", ".join(i.name for i in pool.instances)
        last = f"; last failure: {failure}" if failure is not None else ""
        return error_response(
            503, f"no {role} instance in rotation ({names} failed and are being probed; retry later){last}"
        )
