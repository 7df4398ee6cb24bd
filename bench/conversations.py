"""The multi-turn workload (pure): conversations whose every turn repeats the whole history.

A conversation's first prompt is the rate's shared prefix (the same `prefix_len` tokens for every
conversation: a system prompt) and `first_tokens` of its own; each later turn's prompt is the
turn before's prompt, that turn's answer, and `turn_tokens` new tokens:

    prompt(1) = prefix + user(1)
    prompt(t) = prompt(t-1) + answer(t-1) + user(t)

Prompts are token ids, so a turn's prompt extends the one before token for token (text would be
tokenized again at every join). Conversations start as a Poisson process at the rate; a
conversation's next turn is sent as soon as the answer to the last one ended. The answers come from
the deployment at run time (conversation_client.py); everything else is fixed by the seed, so every
mode gets the same conversations, and with equal answers, the same prompts.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class Workload:
    conversations: int
    turns: int
    first_tokens: int  # the first turn's own tokens, after the shared prefix
    turn_tokens: int  # each later turn's new tokens
    prefix_len: int = 0  # tokens every conversation starts with (the same ones)

    def problem(self) -> str | None:
        """What is wrong with it, as one line naming the option; None if nothing."""
        for name, low in (
            ("conversations", 1),
            ("turns", 1),
            ("first_tokens", 1),
            ("turn_tokens", 1),
            ("prefix_len", 0),
        ):
            if getattr(self, name) < low:
                flag = "--input-len" if name == "first_tokens" else f"--{name.replace('_', '-')}"
                return f"{flag} must be at least {low} (got {getattr(self, name)})"
        return None

    @property
    def requests(self) -> int:
        return self.conversations * self.turns


@dataclass(frozen=True)
class Conversation:
    index: int
    start_s: float  # when its first turn is sent, from the rate's start
    users: tuple[tuple[int, ...], ...]  # each turn's new tokens (the first turn's include the shared prefix)


def request_index(conversation: int, turn: int, turns: int) -> int:
    """A request's place in the result file's lists (and in its X-Request-Id): conversation-major."""
    return conversation * turns + turn


def plan(workload: Workload, rate: float, seed: int, vocabulary: Sequence[int]) -> list[Conversation]:
    """Every conversation of one rate: when it starts and what its user says at each turn."""
    if not vocabulary:
        raise ValueError("the vocabulary to draw prompt tokens from is empty")
    rng = random.Random(seed)
    prefix = tuple(rng.choice(vocabulary) for _ in range(workload.prefix_len))
    conversations, start = [], 0.0
    for index in range(workload.conversations):
        if index:
            start += rng.expovariate(rate)
        users = [prefix + tuple(rng.choice(vocabulary) for _ in range(workload.first_tokens))]
        users += [tuple(rng.choice(vocabulary) for _ in range(workload.turn_tokens)) for _ in range(workload.turns - 1)]
        conversations.append(Conversation(index, start, tuple(users)))
    return conversations


def next_prompt(previous: Sequence[int], answer: Sequence[int], user: Sequence[int]) -> list[int]:
    """A turn's prompt: the last turn's prompt and answer, then the user's new tokens."""
    return [*previous, *answer, *user]


def new_tokens(turn: int, prompt_len: int, workload: Workload) -> int:
    """Tokens of a turn's prompt that no instance can hold yet: the whole first prompt; after it, only
    the user's new tokens (the history and the last answer were on decode already)."""
    return prompt_len if turn == 0 else workload.turn_tokens
