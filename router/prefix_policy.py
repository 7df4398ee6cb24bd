"""The prefix-aware policy: which instance of a role gets a prompt, by how much of the prompt it
already holds and how loaded it is.

What an instance holds is the router's own record of what it sent where (PrefixRecord): for each
instance, the block keys (prompt_blocks.py) of the prompts it was given, in one LRU bounded to
`record_blocks` entries per role. An instance's hit for a prompt is the number of the prompt's
leading blocks recorded for it. A prompt is recorded for an instance when an attempt sends it there
(before its KV arrived: a request close behind with the same prefix goes to the same instance). The
record forgets an instance that left rotation or was restarted (its cache is gone), by giving it a
new salt: its old entries match nothing and age out.

The choice among candidates c (those the retry rules allow, pairs.py):

    score(c) = prefix_weight x held(c) / prompt length  -  load_weight x (load(c) - lowest load)

highest score wins, equal scores go round-robin. load(c) is least-loaded's (pool.Instance.score:
legs in flight, plus queued work of others from the instance's /metrics). So an instance holding
the whole prompt keeps it while it carries fewer than prefix_weight / load_weight legs more than
the least-loaded candidate; a prompt no instance holds goes to the least-loaded one. A
conversation's next turn extends its last prompt, so it returns to the instance holding the
history without any client hint.

Invariant of the record: an instance's recorded blocks of one chain are always a prefix of it.
`add` touches a prompt's blocks from the last to the first, so a chain's earlier blocks are never
older than its later ones and the LRU evicts a chain from its end (as vLLM frees a request's blocks
from its end). `held` can therefore binary-search.
"""
from __future__ import annotations

import random
from collections import OrderedDict
from typing import Protocol, Sequence, TypeVar

from .prompt_blocks import PromptBlocks


class Candidate(Protocol):
    """What the policy reads of an instance (pool.Instance)."""

    prefix_salt: int

    def score(self) -> float: ...


C = TypeVar("C", bound=Candidate)


def new_salt() -> int:
    """An instance's key in the record; a new one forgets everything recorded for it."""
    return random.getrandbits(64)


class PrefixRecord:
    """A bounded LRU of (instance salt, block key) entries."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._entries: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def held(self, salt: int, keys: Sequence[int]) -> int:
        """How many of `keys`' leading blocks are recorded for the instance of `salt`."""
        entries = self._entries
        low, high = 0, len(keys)
        while low < high:
            mid = (low + high + 1) // 2
            if keys[mid - 1] ^ salt in entries:
                low = mid
            else:
                high = mid - 1
        return low

    def add(self, salt: int, keys: Sequence[int]) -> None:
        """Record `keys` for the instance of `salt`, the most recently used entries first to go
        last: the chain's first block is the newest."""
        entries = self._entries
        for key in reversed(keys):
            entry = key ^ salt
            if entry in entries:
                entries.move_to_end(entry)
            else:
                entries[entry] = None
                if len(entries) > self.capacity:
                    entries.popitem(last=False)


class PrefixAware:
    """One role's record and weights."""

    def __init__(self, prefix_weight: float, load_weight: float, record_blocks: int):
        self.prefix_weight = prefix_weight
        self.load_weight = load_weight
        self.record = PrefixRecord(record_blocks)

    def held(self, inst: Candidate, prompt: PromptBlocks) -> int:
        """Prompt units (tokens or characters) `inst` holds, as far as the record knows."""
        return prompt.units(self.record.held(inst.prefix_salt, prompt.keys))

    def choose(self, candidates: list[C], prompt: PromptBlocks | None) -> C:
        """The best of `candidates` (non-empty, in round-robin order) for `prompt`."""
        loads = [c.score() for c in candidates]
        lowest = min(loads)
        if prompt is None or not prompt.keys or self.prefix_weight == 0:
            return candidates[loads.index(lowest)]
        best, best_score = candidates[0], float("-inf")
        for inst, load in zip(candidates, loads):
            score = self.prefix_weight * self.held(inst, prompt) / prompt.length - self.load_weight * (load - lowest)
            if score > best_score:
                best, best_score = inst, score
        return best

    def sent(self, inst: Candidate, prompt: PromptBlocks) -> None:
        self.record.add(inst.prefix_salt, prompt.keys)
