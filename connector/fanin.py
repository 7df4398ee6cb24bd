"""D's view of one transfer whose KV comes from several prefill ranks (TP sizes that differ, or a
replicated head): the parts, one per source rank, become one outcome for vLLM.

A streamed transfer has started (vLLM may schedule it) once every part streams or is done; it
has an outcome once every part has one. One whose parts all end without streaming only has an
outcome. The first part to fail names the parts still running, which the
caller cancels, so the whole transfer fails as fast as its slowest source can stop writing: its
blocks are never handed back while a source may still write into them. A part that failed while
its source may still write is fenced (fences.py); the whole transfer is free of writers once every
such part's fence ended (`unfenced`). Pure bookkeeping.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .state import Outcome, Pending

RANK_SEPARATOR = "#"  # wire ids never contain it (wire.ID_PATTERN): keys can't collide


def rank_key(name: str, rank: int) -> str:
    """A transfer's or engine's per-rank name on this side: one part, one peer connection."""
    return f"{name}{RANK_SEPARATOR}{rank}"


def base_name(key: str) -> str:
    """The transfer or engine id of a rank_key, as the wire spells it."""
    return key.rsplit(RANK_SEPARATOR, 1)[0]


def rank_of(key: str) -> int:
    return int(key.rsplit(RANK_SEPARATOR, 1)[1])


@dataclass
class _Transfer:
    whole: Pending
    outcomes: dict[str, Outcome | None]  # part key -> its outcome, once in
    streaming: set[str] = field(default_factory=set)
    announced: bool = False
    first_failure: Outcome | None = None  # its reason is the transfer's
    fenced: set[str] = field(default_factory=set)  # parts whose source may still write into the blocks


class Parts:
    """Transfers of this D rank by id, each with the part keys of its source ranks."""

    def __init__(self) -> None:
        self._transfers: dict[str, _Transfer] = {}
        self._owner: dict[str, str] = {}  # part key -> transfer id (running, or over with a fenced part)
        self._fenced: dict[str, set[str]] = {}  # transfer id -> its parts still fenced, once it is over

    def add(self, whole: Pending, part_keys: list[str]) -> None:
        self._transfers[whole.transfer_id] = _Transfer(whole, dict.fromkeys(part_keys))
        for key in part_keys:
            self._owner[key] = whole.transfer_id

    def __contains__(self, transfer_id: str) -> bool:
        return transfer_id in self._transfers

    def failing(self, transfer_id: str) -> bool:
        """A part failed: the transfer will fail once the others stop."""
        t = self._transfers.get(transfer_id)
        return t is not None and t.first_failure is not None

    def running(self, transfer_id: str) -> list[str]:
        """Its parts without an outcome yet."""
        t = self._transfers.get(transfer_id)
        return [k for k, o in t.outcomes.items() if o is None] if t is not None else []

    def streaming(self, part_key: str) -> Pending | None:
        """A part began its streamed WRITE: the whole transfer, the first time every part streams
        or is done (and none failed); else None."""
        t = self._part(part_key)
        if t is None:
            return None
        t.streaming.add(part_key)
        return self._announce(t)

    def settle(self, part: Outcome) -> tuple[Outcome | None, list[str], Pending | None]:
        """A part's outcome. Returns the whole transfer's outcome once every part has one, the
        parts to cancel now (the first failure stops the others), and the whole transfer if this
        outcome completes its start (a part done before the others streamed)."""
        key = part.pending.transfer_id
        t = self._part(key)
        if t is None or t.outcomes[key] is not None:
            return None, [], None
        t.outcomes[key] = part
        if part.may_still_land:
            t.fenced.add(key)
        cancel: list[str] = []
        if not part.ok and t.first_failure is None:
            t.first_failure = part
            cancel = [k for k, o in t.outcomes.items() if o is None]
        started = self._announce(t)
        if any(o is None for o in t.outcomes.values()):
            return None, cancel, started
        del self._transfers[t.whole.transfer_id]
        for k in t.outcomes:
            if k not in t.fenced:
                self._owner.pop(k, None)
        if t.fenced:
            self._fenced[t.whole.transfer_id] = t.fenced
        return _whole_outcome(t), cancel, started

    def unfenced(self, part_key: str) -> str | None:
        """A part's fence ended: the transfer id once none of its parts is fenced any more and its
        outcome is out (None before, or for a part of no transfer here)."""
        tid = self._owner.get(part_key)
        if tid is None:
            return None
        running = self._transfers.get(tid)
        if running is not None:
            running.fenced.discard(part_key)
            return None
        fenced = self._fenced.get(tid)
        if fenced is None:
            return None
        fenced.discard(part_key)
        del self._owner[part_key]
        if fenced:
            return None
        del self._fenced[tid]
        return tid

    def _part(self, key: str) -> _Transfer | None:
        tid = self._owner.get(key)
        return self._transfers.get(tid) if tid is not None else None

    @staticmethod
    def _announce(t: _Transfer) -> Pending | None:
        if t.announced or t.first_failure is not None or not t.streaming:
            return None
        if all(k in t.streaming or (o is not None and o.ok) for k, o in t.outcomes.items()):
            t.announced = True
            return t.whole
        return None


def _whole_outcome(t: _Transfer) -> Outcome:
    parts = [o for o in t.outcomes.values() if o is not None]
    if t.first_failure is None:
        return Outcome(t.whole, True, num_bytes=sum(o.num_bytes for o in parts))
    return Outcome(t.whole, False, t.first_failure.reason, may_still_land=bool(t.fenced))
