"""D's fences: the parts of transfers given up on while their prefill rank may still write into the
blocks. Pure bookkeeping (no sockets, no clock): callers pass the time in.

A part is fenced when it fails without prefill's word that nothing more of it lands (D gave up on
a silent P, a landing or an acceptance was overdue, or P's own FAIL said a WRITE it could not
recall was still copying). Its blocks stay out of vLLM's hands until evidence ends the fence:
- prefill's word, on the connection the part was registered on (its generation): DONE, a FAIL that
  says nothing can land any more, or QUIESCED (every WRITE handle it posted for the part ended);
- prefill's death: that connection closed by prefill's side (the kernel closes a dead process's
  sockets);
- the backstop: `hold_s` after the fence began, the caller drops that prefill's connection (so a
  resumed prefill sees the close before posting anything) and only then the fence ends. Counted:
  it is the one way a block comes back without evidence.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Fence:
    peer_engine: str  # the prefill rank (engine#rank) that may still write
    generation: int  # the connection to it the part's registration went out on
    since: float


@dataclass
class Fences:
    held: dict[str, Fence] = field(default_factory=dict)  # part key ->
    counts: Counter = field(default_factory=Counter)
    _ended: list[str] = field(default_factory=list)  # part keys whose fence ended since take_ended

    def hold(self, key: str, peer_engine: str, generation: int, now: float) -> None:
        self.held[key] = Fence(peer_engine, generation, now)

    def __contains__(self, key: str) -> bool:
        return key in self.held

    def word(self, key: str, peer_engine: str, generation: int) -> bool:
        """Prefill said nothing more of this part lands; False if no fence of that connection."""
        fence = self.held.get(key)
        if fence is None or fence.peer_engine != peer_engine or fence.generation != generation:
            return False
        self._end(key)
        self.counts["ended_by_prefill"] += 1
        return True

    def writer_gone(self, peer_engine: str, generation: int) -> int:
        """That prefill rank's connection was closed by its side: its process is gone. Returns how
        many fences that ended."""
        keys = [k for k, f in self.held.items() if f.peer_engine == peer_engine and f.generation == generation]
        for key in keys:
            self._end(key)
        self.counts["ended_by_death"] += len(keys)
        return len(keys)

    def overdue(self, now: float, hold_s: float) -> dict[tuple[str, int], list[tuple[str, Fence]]]:
        """The connections (prefill rank, generation) with a fence older than `hold_s` (0: none
        ever is), each with every fence of that connection, younger ones too: the caller drops
        those connections and only then ends the fences (`end_by_backstop`), so the blocks never
        come back while a resumed prefill could still find its connection open. Changes nothing."""
        if hold_s <= 0:
            return {}
        due = sorted({(f.peer_engine, f.generation) for f in self.held.values() if now - f.since >= hold_s})
        return {conn: [(k, f) for k, f in self.held.items() if (f.peer_engine, f.generation) == conn] for conn in due}

    def end_by_backstop(self, fences: list[tuple[str, Fence]]) -> int:
        """End these fences (from `overdue`) once their connections are dropped; one that ended
        meanwhile (prefill's word, its death) or was made anew is left alone. Returns how many ended."""
        ended = [key for key, fence in fences if self.held.get(key) is fence]
        for key in ended:
            self._end(key)
        self.counts["ended_by_backstop"] += len(ended)
        return len(ended)

    def next_deadline(self, hold_s: float) -> float | None:
        if hold_s <= 0 or not self.held:
            return None
        return min(f.since for f in self.held.values()) + hold_s

    def take_ended(self) -> list[str]:
        ended, self._ended = self._ended, []
        return ended

    def _end(self, key: str) -> None:
        del self.held[key]
        self._ended.append(key)
