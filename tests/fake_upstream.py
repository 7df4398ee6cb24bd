"""A fast in-process imitation of one vLLM OpenAI server, for the router's tests and overhead benchmark.

It answers like vLLM (same JSON shapes, SSE framing, error bodies) with deterministic text, and can
be told to misbehave: fail with a status, report a KV-transfer failure, hang, die mid-stream, or
stop answering anything until told to go on (as a SIGSTOPped process does until SIGCONT).
It records what it received and how many requests were abandoned by their client.
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field

from aiohttp import web


@dataclass
class Behavior:
    first_token_delay_s: float = 0.0
    kv_wait_s: float = 0.0  # legs carrying kv_transfer_params for a consumer wait this long more, as for their KV
    token_delay_s: float = 0.0
    fail_status: int | None = None  # answer generation requests with this status...
    fail_times: int | None = None  # ...this many times (None: always)
    transfer_error: bool = False  # legs carrying kv_transfer_params for a consumer end like a failed KV load
    error_event: dict | None = None  # streams send this as their first event ({"error": {...}}), then [DONE]
    hang: bool = False  # never answer generation requests
    die_after_tokens: int | None = None  # drop the connection mid-stream
    stall_after_tokens: int | None = None  # go silent mid-stream (the connection stays open)
    cut_answer_after_bytes: int | None = None  # drop the connection inside a non-streamed answer's body
    unhealthy: bool = False  # /health answers 503
    stopped: bool = False  # nothing is answered (health, metrics, generation) until this is cleared
    label_answers: bool = False  # each choice's text starts with "[<prompt>#<sample>]"


@dataclass
class Received:
    path: str
    body: dict
    headers: dict  # lower-cased names
    at: float


@dataclass
class FakeVllm:
    model: str = "fake"
    behavior: Behavior = field(default_factory=Behavior)
    received: list[Received] = field(default_factory=list)
    abandoned: int = 0  # generation requests whose client went away before the answer ended
    running: int = 0
    metrics_text: str | None = None  # override of /metrics
    created: int | None = None  # fixed `created` timestamps make answers byte-comparable
    start_time: float = 1_700_000_000.0  # its /metrics' process_start_time_seconds (a restart changes it)
    prefix_caching: bool = True  # what its /metrics says (vllm:cache_config_info)
    url: str = ""
    _runner: web.AppRunner | None = None

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        app = web.Application()
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post("/tokenize", self._tokenize)
        app.router.add_post("/detokenize", self._detokenize)
        app.router.add_get("/version", self._version)
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        bound = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://{host}:{bound}"
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # --- handlers ----------------------------------------------------------------------------

    async def _while_stopped(self) -> None:
        while self.behavior.stopped:
            await asyncio.sleep(0.01)

    async def _health(self, request: web.Request) -> web.Response:
        await self._while_stopped()
        return web.Response(status=503 if self.behavior.unhealthy else 200)

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.model, "object": "model", "created": 0,
                                                              "owned_by": "vllm", "root": self.model, "parent": None,
                                                              "max_model_len": 2048, "permission": []}]})

    async def _metrics(self, request: web.Request) -> web.Response:
        await self._while_stopped()
        text = self.metrics_text
        if text is None:
            text = (f'vllm:num_requests_running{{engine="0",model_name="{self.model}"}} {float(self.running)}\n'
                    f'vllm:num_requests_waiting{{engine="0",model_name="{self.model}"}} 0.0\n'
                    f'vllm:kv_cache_usage_perc{{engine="0",model_name="{self.model}"}} 0.0\n'
                    f'vllm:cache_config_info{{block_size="16",enable_prefix_caching="{self.prefix_caching}",'
                    f'engine="0"}} 1.0\n'
                    f'process_start_time_seconds {self.start_time}\n')
        return web.Response(text=text, content_type="text/plain")

    async def _tokenize(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.received.append(Received(request.path, body, {k.lower(): v for k, v in request.headers.items()}, time.perf_counter()))
        tokens = [ord(c) for c in str(body.get("prompt", ""))]
        return web.json_response({"count": len(tokens), "max_model_len": 2048, "tokens": tokens, "token_strs": None})

    async def _detokenize(self, request: web.Request) -> web.Response:
        body = await request.json()
        return web.json_response({"prompt": "".join(chr(t) for t in body.get("tokens", []))})

    async def _version(self, request: web.Request) -> web.Response:
        self.received.append(Received(request.path, {}, {k.lower(): v for k, v in request.headers.items()}, time.perf_counter()))
        return web.json_response({"version": "0.0.0-fake"})

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    def _now(self) -> int:
        return self.created if self.created is not None else int(time.time())

    def _should_fail(self) -> bool:
        b = self.behavior
        if b.fail_status is None:
            return False
        if b.fail_times is None:
            return True
        if b.fail_times > 0:
            b.fail_times -= 1
            return True
        return False

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        body = await request.json()
        self.received.append(Received(request.path, body, {k.lower(): v for k, v in request.headers.items()}, time.perf_counter()))
        self.running += 1
        finished = False
        try:
            response = await self._answer(request, body, chat)
            finished = True
            return response
        finally:
            self.running -= 1
            if not finished:
                self.abandoned += 1

    async def _answer(self, request: web.Request, body: dict, chat: bool) -> web.StreamResponse:
        b = self.behavior
        await self._while_stopped()
        if b.hang:
            await asyncio.sleep(3600)
        if self._should_fail():
            return web.json_response({"error": {"message": "fake failure", "type": "InternalServerError",
                                                "param": None, "code": b.fail_status}}, status=b.fail_status)
        params = body.get("kv_transfer_params") or {}
        consumer = params.get("do_remote_prefill") or params.get("kvpush_role") == "consumer"
        prompts = _prompts(body, chat)
        n = int(body.get("n") or 1)
        if params and (n > 1 or len(prompts) > 1):  # one transfer cannot serve several sequences
            return web.json_response({"error": {"message": "kv_transfer_params on a request of several sequences",
                                                "type": "InternalServerError", "param": None, "code": 500}}, status=500)
        await asyncio.sleep(b.first_token_delay_s + (b.kv_wait_s if consumer else 0.0))
        request_id = ("chatcmpl-" if chat else "cmpl-") + request.headers.get("X-Request-Id", uuid.uuid4().hex)
        max_tokens = int(body.get("max_completion_tokens") or body.get("max_tokens") or 16)
        tokens = [f" t{i}" for i in range(max_tokens)]
        sequences = [(p, i) for p in range(len(prompts)) for i in range(n)]  # choice index = p * n + i

        def label(p: int, i: int) -> str:
            return f"[{prompts[p]}#{i}]" if b.label_answers else ""

        usage = {"prompt_tokens": 4 * len(prompts), "total_tokens": 4 * len(prompts) + max_tokens * len(sequences),
                 "completion_tokens": max_tokens * len(sequences)}
        if b.transfer_error and consumer:
            if body.get("stream"):
                resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
                await resp.prepare(request)
                error = {"error": {"message": "Internal server error", "type": "InternalServerError",
                                   "param": None, "code": 500}}
                if chat:
                    await resp.write(_sse(_chat_chunk(self._now(), request_id, self.model, {"role": "assistant", "content": ""}, None)))
                await resp.write(_sse(error) + b"data: [DONE]\n\n")
                await resp.write_eof()
                return resp
            return web.json_response({"error": {"message": "Internal server error", "type": "InternalServerError",
                                                "param": None, "code": 500}}, status=500)
        if b.error_event is not None and body.get("stream"):
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
            await resp.prepare(request)
            await resp.write(_sse(b.error_event) + b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        if not body.get("stream"):
            answer: dict = {"id": request_id, "object": "chat.completion" if chat else "text_completion",
                            "created": self._now(), "model": self.model}
            if chat:
                answer["choices"] = [{"index": p * n + i, "message": {"role": "assistant", "content": label(p, i) + "".join(tokens)},
                                      "logprobs": None, "finish_reason": "length", "stop_reason": None}
                                     for p, i in sequences]
            else:
                answer["choices"] = [{"index": p * n + i, "text": label(p, i) + "".join(tokens), "logprobs": None,
                                      "finish_reason": "length", "stop_reason": None, "prompt_logprobs": None}
                                     for p, i in sequences]
            answer["usage"] = usage
            if params.get("do_remote_decode"):
                answer["kv_transfer_params"] = {"do_remote_prefill": True, "do_remote_decode": False,
                                                "remote_block_ids": [[1]], "remote_engine_id": "fake-engine",
                                                "remote_request_id": request_id, "remote_host": "127.0.0.1",
                                                "remote_port": 5600, "tp_size": 1}
            else:
                answer["kv_transfer_params"] = None
            if b.cut_answer_after_bytes is not None:
                data = json.dumps(answer).encode()
                cut = web.StreamResponse(headers={"Content-Type": "application/json"})
                cut.content_length = len(data)
                await cut.prepare(request)
                await cut.write(data[:b.cut_answer_after_bytes])
                assert request.transport is not None
                request.transport.abort()
                return cut
            return web.json_response(answer)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await resp.prepare(request)
        if chat:
            for p, i in sequences:
                await resp.write(_sse(_chat_chunk(self._now(), request_id, self.model, {"role": "assistant", "content": ""},
                                                  None, p * n + i)))
        for k, tok in enumerate(tokens):
            if b.die_after_tokens is not None and k >= b.die_after_tokens:
                assert request.transport is not None
                request.transport.abort()
                return resp
            if b.stall_after_tokens is not None and k >= b.stall_after_tokens:
                await asyncio.sleep(3600)
            await self._while_stopped()
            last = k == len(tokens) - 1
            reason = "length" if last else None
            for p, i in sequences:
                text = (label(p, i) if k == 0 else "") + tok
                if chat:
                    chunk = _chat_chunk(self._now(), request_id, self.model, {"content": text}, reason, p * n + i)
                else:
                    chunk = {"id": request_id, "object": "text_completion", "created": self._now(), "model": self.model,
                             "choices": [{"index": p * n + i, "text": text, "logprobs": None, "finish_reason": reason,
                                          "stop_reason": None}]}
                await resp.write(_sse(chunk))
            if not last and b.token_delay_s:
                await asyncio.sleep(b.token_delay_s)
        if (body.get("stream_options") or {}).get("include_usage"):
            await resp.write(_sse({"id": request_id, "object": "chat.completion.chunk" if chat else "text_completion",
                                   "created": self._now(), "model": self.model, "choices": [], "usage": usage}))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


def _prompts(body: dict, chat: bool) -> list[str]:
    """The request's prompts as short labels: one for chat and for a single prompt."""
    prompt = body.get("prompt")
    if chat or not isinstance(prompt, list) or not prompt or isinstance(prompt[0], int):
        one = prompt if isinstance(prompt, str) else "chat" if chat else "ids"
        return [str(one)]
    return [p if isinstance(p, str) else f"ids{len(p)}" for p in prompt]


def _chat_chunk(created: int, request_id: str, model: str, delta: dict, reason: str | None, index: int = 0) -> dict:
    return {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": index, "delta": delta, "logprobs": None, "finish_reason": reason}]}


def _sse(obj: dict) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()
