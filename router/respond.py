"""Answering the client once every part of its request reached decode's head (a stream's first
token; a non-streamed answer whole): nothing here is retried (the client sees the answer from now
on), and every answer ends complete or with an OpenAI-style error (a stream that breaks ends with
an error event and `data: [DONE]`).

One streamed part is relayed socket to socket (relay.py). A split batch is merged (merge.py):
non-streamed answers into one answer, streams event by event into one stream.
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid

from aiohttp import web

from . import metrics as M
from .config import RouterConfig
from .errors import error_response, sse_error_event
from .legs import DecodeHead
from .merge import DONE_EVENT, StreamMerger, merge_answers
from .relay import StreamRelay
from .request_context import RequestContext
from .upstream_http import UpstreamError
from .validation import choices_per_prompt


class AnswerCut(Exception):
    """A decode stream of a batch broke after the merged stream had started."""


def _failure_reason(exc: BaseException) -> str:
    return "stream_idle" if isinstance(exc, asyncio.TimeoutError) else "mid_stream"


def _detail(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__


class Responder:
    def __init__(self, config: RouterConfig, metrics: M.RouterMetrics):
        self.config = config
        self.metrics = metrics

    async def answer(self, ctx: RequestContext, heads: list[DecodeHead],
                     headers: dict[str, str]) -> tuple[web.StreamResponse, str]:
        try:
            if not ctx.stream:
                return await self._whole(ctx, heads, headers)
            if len(heads) == 1:
                return await self._relay(ctx, heads[0], headers)
            return await self._merged_stream(ctx, heads, headers)
        finally:
            for head in heads:
                head.abandon()  # a no-op for legs that ended

    def _response_id(self, ctx: RequestContext) -> str:
        prefix = "chatcmpl-" if ctx.chat else "cmpl-"
        return prefix + (ctx.client_request_id or uuid.uuid4().hex)

    # --- non-streamed ------------------------------------------------------------------------

    async def _whole(self, ctx: RequestContext, heads: list[DecodeHead],
                     headers: dict[str, str]) -> tuple[web.StreamResponse, str]:
        bodies = [h.held for h in heads]  # read whole in the retryable phase (legs.decode_head)
        if len(heads) == 1:
            return web.Response(status=200, body=bodies[0],
                                headers={"Content-Type": heads[0].content_type, **headers}), M.OK
        try:
            answers = [json.loads(b) for b in bodies]
            if not all(isinstance(a, dict) for a in answers):
                raise ValueError("not a JSON object")
        except ValueError as exc:
            return error_response(502, f"a decode answer of the batch is not JSON ({exc})"), M.FAILED
        merged = merge_answers(answers, choices_per_prompt(ctx.parts[0].body), self._response_id(ctx))
        return web.json_response(merged, headers=headers, dumps=lambda o: json.dumps(o, ensure_ascii=False)), M.OK

    # --- one stream, relayed -----------------------------------------------------------------

    async def _relay(self, ctx: RequestContext, head: DecodeHead,
                     headers: dict[str, str]) -> tuple[web.StreamResponse, str]:
        client = web.StreamResponse(status=200, headers={"Content-Type": head.content_type, **headers})
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
                    head.leg.end(_failure_reason(exc))
                    await client.write(
                        sse_error_event(
                            502, f"decode leg on instance {head.leg.name} failed mid-stream: {_detail(exc)}"
                        )
                    )
                    return client, M.FAILED_MID_STREAM
                if relay.client_gone:
                    raise ConnectionResetError("the client went away")
                tail = relay.tail
                if relay.saw_error:
                    outcome = M.FAILED_MID_STREAM
            if tail != DONE_EVENT:  # the upstream closed cleanly but early
                head.leg.end("ended_early")
                await client.write(
                    sse_error_event(502, f"decode leg on instance {head.leg.name} ended its stream early")
                )
                return client, M.FAILED_MID_STREAM
            head.leg.end()
            await client.write_eof()
            return client, outcome
        except (ConnectionResetError, asyncio.CancelledError) as exc:
            head.leg.end(cancelled=True)
            if isinstance(exc, asyncio.CancelledError):
                raise
            return client, M.CANCELLED

    # --- a batch's streams, merged -----------------------------------------------------------

    async def _merged_stream(self, ctx: RequestContext, heads: list[DecodeHead],
                             headers: dict[str, str]) -> tuple[web.StreamResponse, str]:
        client = web.StreamResponse(status=200, headers={"Content-Type": heads[0].content_type, **headers})
        merger = StreamMerger(len(heads), choices_per_prompt(ctx.parts[0].body), self._response_id(ctx))
        write_lock = asyncio.Lock()  # one writer at a time: aiohttp keeps a single drain waiter

        async def write(data: bytes) -> None:
            if data:
                async with write_lock:
                    await client.write(data)

        async def pump(part: int, head: DecodeHead) -> None:
            """One part's stream into the merged one; returns when it ended or reported an error."""
            await write(merger.feed(part, head.held))
            resp = head.resp
            while resp is not None and not merger.error and not merger.done[part]:
                try:
                    chunk = await resp.readany()
                except (UpstreamError, asyncio.TimeoutError) as exc:
                    head.leg.end(_failure_reason(exc))
                    raise AnswerCut(
                        f"decode leg on instance {head.leg.name} failed mid-stream: {_detail(exc)}"
                    ) from None
                if not chunk:
                    break
                await write(merger.feed(part, chunk))
            if merger.error:
                head.leg.end("generation_error")
            elif not merger.done[part]:
                head.leg.end("ended_early")
                raise AnswerCut(f"decode leg on instance {head.leg.name} ended its stream early")
            else:
                head.leg.end()

        try:
            await client.prepare(ctx.request)
            self.metrics.ttft.observe(time.perf_counter() - ctx.started)
            tasks = [asyncio.ensure_future(pump(i, h)) for i, h in enumerate(heads)]
            try:
                pending = set(tasks)
                while pending and not merger.error:
                    done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                    for task in done:
                        task.result()  # AnswerCut, or the client's connection gone
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.wait(tasks)
            if merger.error:
                await write(DONE_EVENT)
                return client, M.FAILED_MID_STREAM
            await write(merger.finish())
            await client.write_eof()
            return client, M.OK
        except AnswerCut as exc:
            await write(sse_error_event(502, str(exc)))
            return client, M.FAILED_MID_STREAM
        except (ConnectionResetError, asyncio.CancelledError) as exc:
            if isinstance(exc, asyncio.CancelledError):
                raise
            return client, M.CANCELLED
