"""The chaos suite's prompt set and the plain server's answers to it.

A prompt set is random token-id prompts of 1 to 1,500 tokens (the first ones at KV block edges,
tests/random_prompts.py), each with its own number of greedy output tokens (1 included: a request
that may finish in the step its KV arrives). Clients draw from the set at random, so one set
of reference answers, computed once (and kept in a file when a path is given), checks every answer.
"""
from __future__ import annotations

import json
import random
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from fault_load import completion_request
from random_prompts import random_prompts

MAX_PROMPT_TOKENS = 1500
OUTPUT_TOKENS = (1, 2, 8, 16, 32)


@dataclass(frozen=True)
class PromptSet:
    seed: int
    prompts: list[list[int]]
    max_tokens: list[int]
    answers: list[str]  # the plain server's greedy answer to each prompt

    def __len__(self) -> int:
        return len(self.prompts)


def make_prompts(n: int, seed: int) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed + 1)
    return random_prompts(n, MAX_PROMPT_TOKENS, seed), [rng.choice(OUTPUT_TOKENS) for _ in range(n)]


def plain_answer(url: str, prompt: list[int], max_tokens: int, timeout_s: float = 300) -> str:
    with urllib.request.urlopen(completion_request(url, prompt, max_tokens=max_tokens), timeout=timeout_s) as response:
        return json.loads(response.read())["choices"][0]["text"]


def reference_prompt_set(reference_url: str, n: int, seed: int, cache: Path | None = None, key: str = "") -> PromptSet:
    """The set of n prompts made from seed and the reference server's answers to them, asked 4 at
    a time; with `cache`, read from that file when it holds this set's answers under `key` (which
    names what the answers depend on: the model, vLLM), else computed and written there."""
    prompts, max_tokens = make_prompts(n, seed)
    if cache is not None and cache.exists():
        kept = json.loads(cache.read_text())
        if (kept["n"], kept["seed"], kept["key"]) == (n, seed, key):
            return PromptSet(seed, prompts, max_tokens, kept["answers"])
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda i: plain_answer(reference_url, prompts[i], max_tokens[i]), range(n)))
    if cache is not None:
        cache.write_text(json.dumps({"n": n, "seed": seed, "key": key, "answers": answers}))
    return PromptSet(seed, prompts, max_tokens, answers)
