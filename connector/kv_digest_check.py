"""Decode's half of verify_kv: checks prefill's digests (kv_digest.py) against what landed in its
own blocks, before vLLM may compute on them: a streamed layer's when its LANDED comes (before the
layer is reported landed, so a forward pass waiting for it never sees it unchecked), the rest of a
push when its DONE comes (before the transfer's outcome exists). Each part's layers checked on
LANDED are not hashed again on DONE: digests add up, so DONE's is compared with the sum.

Runs on the consumer's reactor thread, outside the arrivals' lock (the hashing takes time).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Sequence

from . import kv_digest
from .kv_digest import DigestError, KvMemory, Slice
from .regions import HeadLayout, Region
from .sharding import HeadSharding, Piece

MISMATCH = "kv_digest_mismatch"  # counter: a part whose KV differs from what prefill sent
MISSING = "kv_digest_missing"  # counter: a part prefill sent without a digest (verify_kv off there)
VERIFIED = "kv_digest_verified"  # counter: a whole push whose every byte matched prefill's digests


def slices_for_piece(regions: Sequence[Region], heads: Sequence[HeadLayout], piece: Piece, prefill: HeadSharding,
                     decode: HeadSharding) -> list[Slice]:
    """What prefill rank `piece.p_rank` writes into this decode rank's blocks: its heads, or the
    whole block where prefill pairs whole blocks (both ranks hold exactly these heads, as
    coalesce.slice_segments decides)."""
    first = piece.start - decode.heads_of(piece.d_rank).start
    whole = (first == 0 and piece.start == prefill.heads_of(piece.p_rank).start
             and piece.num_heads == prefill.heads_per_rank and all(piece.num_heads == h.heads for h in heads))
    return kv_digest.decode_slices(regions, heads, first, piece.num_heads, whole)


@dataclass
class _Part:
    slices: list[Slice]
    checked: set[int] = field(default_factory=set)  # regions whose LANDED digest matched
    checked_sum: int = 0


class KvCheck:
    def __init__(self, memory: KvMemory):
        self._memory = memory
        self._lock = threading.Lock()  # guards _parts only
        self._parts: dict[str, _Part] = {}  # part key ->

    def expect(self, key: str, slices: list[Slice]) -> None:
        with self._lock:
            self._parts[key] = _Part(slices)

    def forget(self, key: str) -> None:
        with self._lock:
            self._parts.pop(key, None)

    def landed(self, key: str, regions: Sequence[int], sent: str, blocks: Sequence[int]) -> tuple[str, str]:
        """A streamed layer landed: ("", "") if its bytes match, else (counter, why)."""
        part = self._part(key)
        if part is None:
            return "", ""
        if not sent:
            return MISSING, "prefill sent no KV digest with a landed layer (verify_kv is off on prefill, on here)"
        try:
            mine = kv_digest.digest(self._memory, part.slices, blocks, regions)
        except DigestError as exc:
            return MISMATCH, str(exc)
        if mine != kv_digest.from_wire(sent):
            return MISMATCH, (f"KV digest mismatch in regions {min(regions)}..{max(regions)}: decode's blocks hold "
                              f"{kv_digest.to_wire(mine)}, prefill wrote {sent}")
        with self._lock:
            part.checked.update(regions)
            part.checked_sum = (part.checked_sum + mine) & kv_digest.MASK
        return "", ""

    def done(self, key: str, sent: str, blocks: Sequence[int]) -> tuple[str, str]:
        """The whole push landed: (VERIFIED, "") if every byte matches, ("", "") if this check does not
        expect the part, else (counter, why)."""
        part = self._part(key)
        if part is None:
            return "", ""
        self.forget(key)
        if not sent:
            return MISSING, "prefill sent no KV digest (verify_kv is off on prefill, on here)"
        rest = {s.region for s in part.slices} - part.checked
        try:
            mine = (part.checked_sum + kv_digest.digest(self._memory, part.slices, blocks, rest)) & kv_digest.MASK
        except DigestError as exc:
            return MISMATCH, str(exc)
        if mine != kv_digest.from_wire(sent):
            return MISMATCH, (
                f"KV digest mismatch: decode's blocks hold {kv_digest.to_wire(mine)}, prefill wrote {sent} "
                f"({len(part.checked)} streamed region(s) had matched)"
            )
        return VERIFIED, ""

    def _part(self, key: str) -> _Part | None:
        with self._lock:
            return self._parts.get(key)
