"""Random token-id prompts for the real-vLLM tests: deterministic per seed, the first ones at the
edges of KV blocks (16 tokens on GPU, 128 on vLLM's CPU backend) and at the extremes."""
from __future__ import annotations

import random

VOCAB = 2800


def random_prompts(n: int, max_len: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    edges = [1, 2, 15, 16, 17, 127, 128, 129, 255, 256, 257, max_len]
    lengths = edges + [rng.randint(1, max_len) for _ in range(n)]
    return _random_tokens(rng, lengths[:n])


def full_length_prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    return _random_tokens(random.Random(seed), [length] * n)


def _random_tokens(rng: random.Random, lengths: list[int]) -> list[list[int]]:
    return [[rng.randint(10, VOCAB - 1) for _ in range(k)] for k in lengths]
