"""A matrix of OpenAI API requests, sent with the official `openai` client, each reduced to what
must be the same through the router as from one plain vLLM server: the outcome class (an answer,
or an error with its status), the choice count, each choice's text and finish reason, the usage.

Prompts are fresh per request (their own seed), so a request's KV is never in a prefix cache
before it is sent; greedy sampling except where a seed fixes the samples.
"""
from __future__ import annotations

import json
import random
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any, Callable

import openai

from random_prompts import VOCAB

MODEL = "tiny"
_WORDS = ("river", "stone", "light", "paper", "cloud", "green", "table", "seven", "north", "glass", "music",
          "window", "orange", "silver", "garden", "winter", "planet", "butter", "mirror", "engine")


def words(seed: int, count: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(_WORDS) for _ in range(count))


def token_ids(seed: int, count: int) -> list[int]:
    rng = random.Random(1000 + seed)
    return [rng.randint(10, VOCAB - 1) for _ in range(count)]


@dataclass(frozen=True)
class Case:
    name: str
    endpoint: str  # completions | chat | models | tokenize | detokenize | version
    args: dict = field(default_factory=dict)
    # (prompt tokens a transfer should move, samples) for the KV-movement check; None: not checked
    transfer_check: tuple[int, int] | None = None


def _chat(seed: int, n_words: int = 12) -> list[dict]:
    return [{"role": "system", "content": "answer briefly"}, {"role": "user", "content": words(seed, n_words)}]


GREEDY = {"temperature": 0.0, "max_tokens": 8}
SEEDED = {"temperature": 0.8, "seed": 3, "max_tokens": 8}  # vLLM refuses n > 1 with greedy sampling
TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "look a word up",
                                           "parameters": {"type": "object", "properties": {"word": {"type": "string"}}}}}]

MATRIX: list[Case] = [
    Case("text", "completions", {"prompt": words(1, 30), **GREEDY}),
    Case("tokens", "completions", {"prompt": token_ids(2, 300), **GREEDY}),
    Case("batch of strings", "completions", {"prompt": [words(3, 20), words(4, 45), words(5, 5)], **GREEDY}),
    Case("batch of token lists", "completions", {"prompt": [token_ids(6, 130), token_ids(7, 260)], **GREEDY},
         transfer_check=(390, 1)),
    Case("n=3", "completions", {"prompt": token_ids(8, 700), "n": 3, **SEEDED}, transfer_check=(700, 3)),
    Case("n=2, another seed", "completions", {"prompt": token_ids(9, 200), "n": 2, **SEEDED, "seed": 7}),
    Case("batch with n=2", "completions", {"prompt": [words(10, 25), words(11, 40)], "n": 2, **SEEDED}),
    Case("beam search", "completions", {"prompt": words(30, 20), "n": 2, "extra_body": {"use_beam_search": True},
                                        **GREEDY}),
    Case("echo", "completions", {"prompt": words(12, 15), "echo": True, **GREEDY}),
    Case("logprobs", "completions", {"prompt": words(13, 15), "logprobs": 3, **GREEDY}),
    Case("echo with logprobs", "completions", {"prompt": words(14, 15), "echo": True, "logprobs": 2, **GREEDY}),
    Case("stop", "completions", {"prompt": words(15, 20), "stop": ["e", "a"], "temperature": 0.0, "max_tokens": 24}),
    Case("long prompt", "completions", {"prompt": token_ids(16, 1900), **GREEDY}),
    Case("stream", "completions", {"prompt": words(17, 30), "stream": True, **GREEDY}),
    Case("stream with usage", "completions", {"prompt": token_ids(18, 200), "stream": True,
                                              "stream_options": {"include_usage": True}, **GREEDY}),
    Case("stream of a batch", "completions", {"prompt": [token_ids(19, 50), token_ids(20, 140), token_ids(21, 10)],
                                              "stream": True, "stream_options": {"include_usage": True}, **GREEDY}),
    Case("stream with n=2", "completions", {"prompt": words(22, 30), "n": 2, "stream": True,
                                            "stream_options": {"include_usage": True}, **SEEDED}),
    Case("chat", "chat", {"messages": _chat(23), **GREEDY}),
    Case("chat n=2", "chat", {"messages": _chat(24), "n": 2, **SEEDED}),
    Case("chat stream", "chat", {"messages": _chat(25), "stream": True, "stream_options": {"include_usage": True},
                                 **GREEDY}),
    Case("chat stream n=2", "chat", {"messages": _chat(26), "n": 2, "stream": True, **SEEDED}),
    Case("chat with tools", "chat", {"messages": _chat(27), "tools": TOOLS, "tool_choice": "none", **GREEDY}),
    Case("chat json_object", "chat", {"messages": _chat(28), "response_format": {"type": "json_object"}, **GREEDY}),
    # invalid parameters: vLLM's 4xx, passed through
    Case("max_tokens -1", "completions", {"prompt": words(40, 5), "max_tokens": -1}),
    Case("n=0", "completions", {"prompt": words(41, 5), "n": 0}),
    Case("n=2 with greedy sampling", "completions", {"prompt": words(49, 5), "n": 2, **GREEDY}),
    Case("temperature -1", "completions", {"prompt": words(42, 5), "temperature": -1.0}),
    Case("logprobs over the limit", "completions", {"prompt": words(43, 5), "logprobs": 50}),
    Case("empty prompt", "completions", {"prompt": "", "max_tokens": 4}),
    Case("unknown model", "completions", {"prompt": words(44, 5), "model": "no-such-model"}),
    Case("max_tokens over the model length", "completions", {"prompt": words(45, 5), "max_tokens": 5000}),
    Case("stream_options without stream", "completions", {"prompt": words(46, 5), "stream_options": {"include_usage": True}}),
    Case("prompt_logprobs while streaming", "completions", {"prompt": words(47, 5), "stream": True,
                                                          "extra_body": {"prompt_logprobs": 1}}),
    Case("chat without messages", "chat", {"messages": []}),
    Case("chat max_tokens -1", "chat", {"messages": _chat(48), "max_tokens": -1}),
    # the rest of what the server serves
    Case("models", "models"),
    Case("tokenize", "tokenize", {"prompt": words(50, 10)}),
    Case("detokenize", "detokenize", {"tokens": token_ids(51, 10)}),
    Case("version", "version"),
]


def _completion_outcome(result: Any, stream: bool, chat: bool) -> tuple:
    texts: dict[int, str] = {}
    finish: dict[int, str | None] = {}
    tokens: dict[int, list] = {}
    usage = None
    for chunk in (result if stream else [result]):
        if getattr(chunk, "usage", None) is not None:
            usage = (chunk.usage.prompt_tokens, chunk.usage.completion_tokens, chunk.usage.total_tokens)
        for choice in chunk.choices:
            if chat:
                part = choice.delta.content if stream else choice.message.content
            else:
                part = choice.text
            texts[choice.index] = texts.get(choice.index, "") + (part or "")
            if choice.finish_reason is not None or choice.index not in finish:
                finish[choice.index] = choice.finish_reason
            logprobs = getattr(choice, "logprobs", None)
            if logprobs is not None and not chat and logprobs.tokens:
                tokens.setdefault(choice.index, []).extend(logprobs.tokens)
    indices = sorted(texts)
    return ("answer", len(indices), tuple((i, texts[i], finish[i], tuple(tokens.get(i, ()))) for i in indices), usage)


def _http(method: str, url: str, body: dict | None) -> tuple:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, None


def run_case(base_url: str, case: Case) -> tuple:
    """The comparable outcome of one request: ("answer", ...) or ("error", status)."""
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0, timeout=180)
    try:
        if case.endpoint in ("completions", "chat"):
            args = {"model": MODEL, **case.args}
            stream = bool(args.get("stream"))
            create: Callable = client.chat.completions.create if case.endpoint == "chat" else client.completions.create
            return _completion_outcome(create(**args), stream, case.endpoint == "chat")
        if case.endpoint == "models":
            return ("answer", tuple((m.id, getattr(m, "max_model_len", None)) for m in client.models.list().data))
        if case.endpoint in ("tokenize", "detokenize"):
            status, answer = _http("POST", f"{base_url}/{case.endpoint}", case.args)
            return ("answer", answer) if status == 200 else ("error", status)
        status, answer = _http("GET", f"{base_url}/{case.endpoint}", None)
        return ("answer", answer) if status == 200 else ("error", status)
    except openai.APIStatusError as exc:
        return ("error", exc.status_code)
    finally:
        client.close()
