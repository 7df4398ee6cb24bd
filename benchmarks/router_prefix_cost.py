"""What the prefix-aware policy costs the router per request, and its record's memory per entry.

For one long prompt (16,384 tokens by default), in one process, no I/O: the block chain
(router/prompt_blocks.py) of the prompt as token ids, as text (4 characters per token) and as a
chat of 16 messages of that text; then choosing among 2 and 8 candidates and recording the prompt
(pool.Pool.pick + Pool.sent) with a record already holding `--warm-blocks` entries. Optionally the
cost of what the router does not do: tokenizing the text with a Hugging Face fast tokenizer
(`--tokenizer DIR`). Also the record's memory per entry (tracemalloc). Prints one JSON object;
medians over `--repeats` runs.

    python benchmarks/router_prefix_cost.py [--tokens 16384] [--tokenizer ~/.cache/kvpush/models/tiny-llama]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
import tracemalloc
from typing import Callable

from kvpush.router.config import PrefixAwareSettings, Upstream
from kvpush.router.metrics import RouterMetrics
from kvpush.router.pool import Pool
from kvpush.router.prefix_policy import PrefixRecord
from kvpush.router.prompt_blocks import prompt_blocks

WORDS = ("the", "router", "keeps", "a", "record", "of", "what", "went", "where", "and", "weighs", "load")


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append((time.perf_counter() - started) * 1000)
    return round(statistics.median(times), 4)


def text_of(chars: int, rng: random.Random) -> str:
    out, size = [], 0
    while size < chars:
        word = rng.choice(WORDS)
        out.append(word)
        size += len(word) + 1
    return " ".join(out)[:chars]


def pool_of(n: int, settings: PrefixAwareSettings) -> Pool:
    ups = [Upstream(name=f"d{i}", url=f"http://h:{i + 1}", engine_id=f"d{i}", side_channel_host="h",
                    side_channel_port=i + 1) for i in range(n)]
    pool = Pool("decode", ups, "prefix-aware", 2, RouterMetrics(), settings)
    for inst in pool.instances:
        pool.restore(inst)
    return pool


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--warm-blocks", type=int, default=100_000, help="entries in the record before timing")
    parser.add_argument("--tokenizer", default=None, help="a local tokenizer directory: also time tokenizing the text")
    args = parser.parse_args()
    rng = random.Random(0)
    settings = PrefixAwareSettings()
    ids = [rng.randrange(32000) for _ in range(args.tokens)]
    text = text_of(4 * args.tokens, rng)
    step = len(text) // 16
    messages = [{"role": "user" if i % 2 else "assistant", "content": text[i * step:(i + 1) * step]} for i in range(16)]
    bodies = {"token_ids": ({"model": "m", "prompt": ids}, False), "text": ({"model": "m", "prompt": text}, False),
              "chat_16_messages": ({"model": "m", "messages": messages}, True)}
    out: dict = {"prompt_tokens": args.tokens, "text_chars": len(text), "settings": settings.model_dump(),
                 "repeats": args.repeats, "chain_ms": {}, "choose_and_record_ms": {}}
    for name, (body, chat) in bodies.items():
        out["chain_ms"][name] = median_ms(lambda: prompt_blocks(body, chat, settings.block_tokens, settings.block_chars),
                                          args.repeats)
    for n in (2, 8):
        pool = pool_of(n, settings)
        for i in range(args.warm_blocks // 512):  # other prompts' entries, spread over the instances
            filler = prompt_blocks({"model": "m", "prompt": [i] * (512 * settings.block_tokens)}, False,
                                   settings.block_tokens, settings.block_chars)
            pool.sent(pool.instances[i % n], filler)
        for name, (body, chat) in bodies.items():
            prompt = pool.prompt_of(body, chat)

            def choose_and_record() -> None:
                pool.sent(pool.pick(prompt=prompt), prompt)

            out["choose_and_record_ms"][f"{name}_{n}_candidates"] = median_ms(choose_and_record, args.repeats)
    tracemalloc.start()
    record = PrefixRecord(1 << 30)
    before = tracemalloc.get_traced_memory()[0]
    for k in range(100_000):
        record.add(7, [hash(("m", k))])
    out["record_bytes_per_entry"] = round((tracemalloc.get_traced_memory()[0] - before) / 100_000, 1)
    tracemalloc.stop()
    if args.tokenizer:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
        out["tokenize_text_ms"] = median_ms(lambda: tokenizer(text)["input_ids"], max(args.repeats // 10, 5))
        out["tokenized_text_tokens"] = len(tokenizer(text)["input_ids"])
    out["load_average"] = list(os.getloadavg())
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
