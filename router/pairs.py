"""Which pair the next attempt at one part of a request goes to, after the attempts before it.

Every attempt goes to a pair no earlier attempt of the part used, so a part is tried at most as
many times as there are pairs in rotation:
1. a transfer (a prefill and a decode) on a prefill that no failure of this part named, with a
   decode that no failure named if there is one; else with a decode named only by failed KV
   loads, which name its prefill too (the failure may well have been prefill's), never with one
   that failed on its own (refused, timed out, a 5xx);
2. once no such pair is left, decode computes the prompt itself (a fallback), on a decode that
   has not failed doing so for this part, one no failure named first;
3. once no decode is left either, the part fails.
Instances leave and enter rotation meanwhile (pool.py): each choice looks at rotation as it is.
Among the instances these rules allow, the pool's policy picks (under prefix-aware, the one that
best holds the part's prompt for its load), and the pair's instances record that they were sent it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .fanout import NO_PREFILL, TRANSFERS_FAILED
from .legs import LegFailure
from .pool import Instance, Pool
from .prompt_blocks import PromptBlocks


@dataclass
class Pair:
    prefill: Instance | None  # None: decode computes the prompt itself
    decode: Instance
    without_prefill: str | None = None  # why there is no prefill although the part wanted one (fanout.FALLBACKS)


@dataclass
class PartTries:
    """One part's attempts so far: the pairs used and the instances their failures named."""

    prefill: Pool
    decode: Pool
    prompt: PromptBlocks | None = None  # the part's prompt, for the prefix-aware policy (Pool.prompt_of)
    named: dict[str, set[str]] = field(default_factory=lambda: {"prefill": set(), "decode": set()})
    transfers: set[tuple[str, str]] = field(default_factory=set)  # (prefill, decode) pairs that failed
    decode_faults: set[str] = field(default_factory=set)  # decodes whose leg failed with no prefill named
    alone: set[str] = field(default_factory=set)  # decodes that failed computing the prompt themselves
    failures: list[LegFailure] = field(default_factory=list)

    def next_pair(self, wants_prefill: bool) -> Pair | None:
        """The pair for the next attempt; None once no instance in rotation is left to try."""
        pair = self._choose(wants_prefill)
        if pair is not None:
            if pair.prefill is not None:
                self.prefill.sent(pair.prefill, self.prompt)
            self.decode.sent(pair.decode, self.prompt)
        return pair

    def _choose(self, wants_prefill: bool) -> Pair | None:
        if wants_prefill:
            pair = self._transfer_pair()
            if pair is not None:
                return pair
        decode = (self.decode.pick(self.alone | self.named["decode"], strict=True, prompt=self.prompt)
                  or self.decode.pick(self.alone, strict=True, prompt=self.prompt))
        if decode is None:
            return None
        if not wants_prefill:
            return Pair(None, decode)
        return Pair(None, decode, TRANSFERS_FAILED if self.prefill.available() else NO_PREFILL)

    def _transfer_pair(self) -> Pair | None:
        prefills = [p.name for p in self.prefill.available() if p.name not in self.named["prefill"]]
        if not prefills:
            return None
        # decodes with a prefill left to pair with: those no failure named first
        spent = {d.name for d in self.decode.available()
                 if d.name in self.alone or all((p, d.name) in self.transfers for p in prefills)}
        decode = (self.decode.pick(spent | self.named["decode"], strict=True, prompt=self.prompt)
                  or self.decode.pick(spent | self.decode_faults, strict=True, prompt=self.prompt))
        if decode is None:
            return None
        tried_with_it = {p for p, d in self.transfers if d == decode.name}
        prefill = self.prefill.pick(self.named["prefill"] | tried_with_it, strict=True, prompt=self.prompt)
        assert prefill is not None  # `spent` left out every decode without one
        return Pair(prefill, decode)

    def failed(self, pair: Pair, transferred: bool, exc: LegFailure) -> None:
        """An attempt on `pair` failed with `exc`; `transferred`: its prompt was to come from the prefill."""
        self.failures.append(exc)
        if transferred:
            assert pair.prefill is not None
            self.transfers.add((pair.prefill.name, pair.decode.name))
        else:
            self.alone.add(pair.decode.name)
        self.named[exc.role].add(exc.instance)
        for role, name in exc.also_avoid:
            self.named[role].add(name)
        if exc.role == "decode" and not exc.also_avoid:
            self.decode_faults.add(exc.instance)

    def attempts(self) -> int:
        return len(self.failures)
