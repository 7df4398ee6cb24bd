"""Drive a deployment with the multi-turn workload (conversations.py), and write what it measured in
the shape of a `vllm bench serve --save-detailed` result file, so the bench reads it like any other.

Every request is a streamed completion of token ids (greedy, EOS ignored, the answer's token ids
returned), with X-Request-Id = the prefix and its index (conversations.request_index). Besides the
usual per-request lists the file has, per request, its conversation, turn, prompt tokens, the
tokens new in that turn, and the answer's token ids (to compare modes' answers). A turn that fails
ends its conversation: its later turns are recorded as failed without being sent.

Run by the bench's client worker (client_worker.py) as `kvpush-conversations ARGS` (argv_for), the
router's API key in OPENAI_API_KEY.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from .conversations import Conversation, Workload, new_tokens, next_prompt, plan, request_index
from .tails import percentile

PROGRAM = "kvpush-conversations"
API_KEY_VARIABLE = (
    "OPENAI_API_KEY"  # the router's key for both clients (vLLM's sends it as `Authorization: Bearer ...`)
)
COMPLETIONS_PATH = "/v1/completions"


@dataclass
class TurnResult:
    conversation: int
    turn: int
    prompt_tokens: int
    new_tokens: int
    ttft_s: float = 0.0
    latency_s: float = 0.0
    itls_s: list[float] = field(default_factory=list)
    answer: list[int] = field(default_factory=list)  # token ids
    error: str = ""


def turn_body(model: str, prompt: list[int], output_len: int) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True}


class StreamReader:
    """The token ids of a streamed completion and when each chunk of them arrived."""

    def __init__(self, started: float):
        self.started = started
        self.token_ids: list[int] = []
        self.arrivals: list[float] = []  # one per chunk that carried tokens
        self.error = ""
        self.done = False

    def line(self, raw: bytes, now: float) -> None:
        text = raw.decode(errors="replace").strip()
        if not text.startswith("data:"):
            return
        data = text[5:].strip()
        if data == "[DONE]":
            self.done = True
            return
        try:
            event = json.loads(data)
        except ValueError:
            self.error = f"not JSON in the stream: {data[:120]}"
            return
        if "error" in event:
            self.error = f"error event: {json.dumps(event['error'])[:200]}"
            return
        for choice in event.get("choices") or []:
            ids = choice.get("token_ids") or []
            if ids:
                self.token_ids.extend(ids)
                self.arrivals.append(now)


async def _send(session, base_url: str, headers: dict, body: dict, result: TurnResult, timeout_s: float) -> None:
    import aiohttp

    started = time.perf_counter()
    reader = StreamReader(started)
    try:
        async with session.post(base_url + COMPLETIONS_PATH, json=body, headers=headers,
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            if resp.status != 200:
                result.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return
            async for raw in resp.content:
                reader.line(raw, time.perf_counter())
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"[:200]
        return
    ended = time.perf_counter()
    if reader.error or not reader.done or not reader.token_ids:
        result.error = reader.error or ("stream ended without [DONE]" if not reader.done else "no tokens")
        return
    result.answer = reader.token_ids
    result.ttft_s = reader.arrivals[0] - started
    result.latency_s = ended - started
    result.itls_s = [b - a for a, b in zip(reader.arrivals, reader.arrivals[1:])]


async def _conversation(session, args, conversation: Conversation, workload: Workload, results: list[TurnResult],
                        t0: float, headers: dict) -> None:
    await asyncio.sleep(max(0.0, t0 + conversation.start_s - time.perf_counter()))
    prompt: list[int] = []
    answer: list[int] = []
    for turn, user in enumerate(conversation.users):
        prompt = next_prompt(prompt, answer, user)
        result = results[request_index(conversation.index, turn, workload.turns)]
        result.prompt_tokens, result.new_tokens = len(prompt), new_tokens(turn, len(prompt), workload)
        await _send(
            session,
            args.base_url,
            {
                **headers,
                "X-Request-Id": f"{args.request_id_prefix}{request_index(conversation.index, turn, workload.turns)}",
            },
            turn_body(args.model, prompt, args.output_len),
            result,
            args.timeout,
        )
        if result.error:
            for later in range(turn + 1, workload.turns):
                results[request_index(conversation.index, later, workload.turns)].error = f"turn {turn + 1} failed"
            return
        answer = result.answer


async def run(args, conversations: list[Conversation], workload: Workload) -> tuple[list[TurnResult], float]:
    import aiohttp

    results = [TurnResult(c.index, t, 0, 0) for c in conversations for t in range(workload.turns)]
    key = os.environ.get(API_KEY_VARIABLE)
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        t0 = time.perf_counter()
        await asyncio.gather(*(_conversation(session, args, c, workload, results, t0, headers) for c in conversations))
        return results, time.perf_counter() - t0


def _ms_stats(prefix: str, values: list[float]) -> dict:
    if not values:
        return {f"{s}_{prefix}_ms": None for s in ("mean", "median", "p50", "p90", "p99")}
    ms = [v * 1000 for v in values]
    return {f"mean_{prefix}_ms": statistics.fmean(ms), f"median_{prefix}_ms": percentile(ms, 0.5),
            f"p50_{prefix}_ms": percentile(ms, 0.5), f"p90_{prefix}_ms": percentile(ms, 0.9),
            f"p99_{prefix}_ms": percentile(ms, 0.99)}


def result_document(results: Sequence[TurnResult], duration_s: float, rate: float, workload: Workload) -> dict:
    """The result file: `vllm bench serve --save-detailed`'s fields (per-request lists in request
    order, failed requests with 0 output tokens and their error), then the conversations' own."""
    done = [r for r in results if not r.error]
    output = sum(len(r.answer) for r in done)
    inputs = sum(r.prompt_tokens for r in done)
    tpots = [(r.latency_s - r.ttft_s) / (len(r.answer) - 1) for r in done if len(r.answer) > 1]
    doc = {
        "backend": PROGRAM,
        "request_rate": rate,
        "completed": len(done),
        "failed": len(results) - len(done),
        "duration": duration_s,
        "request_throughput": len(done) / duration_s if duration_s else 0.0,
        "output_throughput": output / duration_s if duration_s else 0.0,
        "total_token_throughput": (inputs + output) / duration_s if duration_s else 0.0,
        "total_input_tokens": inputs,
        "total_output_tokens": output,
        "max_concurrent_requests": None,
        **_ms_stats("ttft", [r.ttft_s for r in done]),
        **_ms_stats("tpot", tpots),
        **_ms_stats("itl", [g for r in done for g in r.itls_s]),
        **_ms_stats("e2el", [r.latency_s for r in done]),
        "input_lens": [r.prompt_tokens for r in results],
        "output_lens": [len(r.answer) if not r.error else 0 for r in results],
        "ttfts": [r.ttft_s if not r.error else 0.0 for r in results],
        "itls": [r.itls_s if not r.error else [] for r in results],
        "latencies": [r.latency_s if not r.error else 0.0 for r in results],
        "errors": [r.error for r in results],
        "conversations": {
            "workload": {
                "conversations": workload.conversations,
                "turns": workload.turns,
                "first_tokens": workload.first_tokens,
                "turn_tokens": workload.turn_tokens,
                "prefix_len": workload.prefix_len,
            },
            "conversation": [r.conversation for r in results],
            "turn": [r.turn for r in results],
            "new_tokens": [r.new_tokens for r in results],
            "answer_token_ids": [r.answer for r in results],
        },
    }
    return doc


def vocabulary(tokenizer_dir: str) -> list[int]:
    """Token ids a prompt may hold: the tokenizer's, less its special tokens."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    special = set(tokenizer.all_special_ids)
    return [i for i in range(len(tokenizer)) if i not in special]


def argv_for(base_url: str, model: str, tokenizer: str, rate: float, seed: int, workload: Workload, output_len: int,
             result_path: Path, request_id_prefix: str, timeout_s: float) -> list[str]:
    return [PROGRAM, "--base-url", base_url, "--model", model, "--tokenizer", tokenizer, "--rate", f"{rate:g}",
            "--seed", str(seed), "--conversations", str(workload.conversations), "--turns", str(workload.turns),
            "--input-len", str(workload.first_tokens), "--turn-tokens", str(workload.turn_tokens),
            "--prefix-len", str(workload.prefix_len), "--output-len", str(output_len), "--result", str(result_path),
            "--request-id-prefix", request_id_prefix, "--timeout", f"{timeout_s:g}"]


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=PROGRAM, description="multi-turn conversations against a kvpush router")
    for name, kind in (("--base-url", str), ("--model", str), ("--tokenizer", str), ("--rate", float), ("--seed", int),
                       ("--conversations", int), ("--turns", int), ("--input-len", int), ("--turn-tokens", int),
                       ("--prefix-len", int), ("--output-len", int), ("--result", Path), ("--request-id-prefix", str),
                       ("--timeout", float)):
        parser.add_argument(name, type=kind, required=True)
    return parser.parse_args(list(argv))


def main(argv: Sequence[str] | None = None) -> None:
    import sys

    args = parse_args(sys.argv[1:] if argv is None else argv)
    workload = Workload(args.conversations, args.turns, args.input_len, args.turn_tokens, args.prefix_len)
    if workload.problem():
        raise SystemExit(workload.problem())
    conversations = plan(workload, args.rate, args.seed, vocabulary(args.tokenizer))
    results, duration = asyncio.run(run(args, conversations, workload))
    doc = result_document(results, duration, args.rate, workload)
    args.result.parent.mkdir(parents=True, exist_ok=True)
    args.result.write_text(json.dumps(doc))
    print(f"{doc['completed']} of {len(results)} requests completed in {duration:.1f} s")
    if doc["failed"]:
        print("first failures: " + "; ".join(e for e in doc["errors"] if e)[:500])


if __name__ == "__main__":
    main()
