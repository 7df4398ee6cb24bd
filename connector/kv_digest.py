"""The end-to-end KV check (setting `verify_kv`): a digest of the exact bytes a push WRITEs, computed
by prefill over its source blocks and by decode over its destination blocks once they landed.

What is hashed: every 8-byte word a push writes, keyed by where it lands in decode's terms: its
region (the same index on both sides), its block's position in the transfer's block list and its
offset inside decode's block. Never by an address or a descriptor boundary, so the two sides may
cut their memory differently (prefill's coalesced segments, decode's head slices) and still
agree; and since words add up, the digest of a whole push is the sum (mod 2**64) of its parts'
(a streamed push's layers).

Why this digest: sum over the words w (key k) of M(w ^ k), where M(x) = (y ^ (y >> 32)) * C2 with
y = x * C1 (mod 2**64, C1 and C2 odd) is a bijection of 64-bit words that mixes every bit. So
- one changed word always changes the sum (M is injective);
- a wrong block, a stale one (bytes of an earlier request) or two blocks swapped change many
  words at many keys; their changes cancel only by chance, ~2**-64;
- the same bytes at another place are other keys: a swap or a shifted slice is caught too.
It is no MAC: a peer that means to pass forged KV can compute it. Keeping strangers out is the
side channel's authentication (docs/security.md); this catches faults and bugs: a block mapping
wrong on either side, a WRITE that did not land, bytes corrupted on the way.
And it is cheap: five elementwise passes over the bytes, vectorised. On host memory numpy does
it about as fast as zlib's crc32 and faster than any hashlib digest on this machine (36 MiB:
numpy 18 ms, crc32 17 ms, sha1 20 ms, sha256 31 ms, blake2b 41 ms; torch on the CPU 142 ms,
so host memory goes through numpy); on GPU memory torch computes it on the device and only the
8-byte sum comes back to the host.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any, Iterable, Protocol, Sequence

import numpy as np

from .coalesce import Segment
from .regions import HeadLayout, Region

WORD = 8
MASK = (1 << 64) - 1
C1 = 0x9E3779B97F4A7C15
C2 = 0xBF58476D1CE4E5B9
K_REGION = 0xD6E8FEB86659FD93
K_BLOCK = 0xA0761D6478BD642F
K_WORD = 0xE7037ED1A0B428DB


class DigestError(ValueError):
    """KV that this digest cannot cover (a slice not made of whole 8-byte words)."""


@dataclass(frozen=True)
class Slice:
    """The bytes a push writes of each of its blocks in one region: `length` bytes landing at
    `offset` in decode's block, found here at `base` + block * `stride`."""

    region: int
    offset: int
    length: int
    base: int
    stride: int

    def __post_init__(self) -> None:
        if self.offset % WORD or self.length % WORD:
            raise DigestError(
                f"verify_kv: region {self.region}'s slice at byte {self.offset} of {self.length} bytes is "
                f"not made of whole {WORD}-byte words; set verify_kv: false for this model"
            )


class KvMemory(Protocol):
    def rows(self, base: int, stride: int, length: int, blocks: np.ndarray) -> Any:
        """Those blocks' `length` bytes at base + block * stride, as one row of 64-bit words each."""


class HostMemory:
    """KV in this process's memory (a CPU KV cache), read by address through numpy."""

    def rows(self, base: int, stride: int, length: int, blocks: np.ndarray) -> np.ndarray:
        top = int(blocks.max())
        size = top * stride + length
        raw = np.frombuffer(memoryview((ctypes.c_char * size).from_address(base)), dtype=np.uint8)
        view = np.lib.stride_tricks.as_strided(raw, shape=(top + 1, length), strides=(stride, 1), writeable=False)
        return view[blocks].view(np.uint64)  # the gather copies: rows are contiguous words


class TorchMemory:
    """KV in torch tensors (GPU memory): read and hashed on their device."""

    def __init__(self, tensors: Iterable[Any]):
        import torch

        self._torch = torch
        self._storages: list[tuple[int, int, Any]] = []  # (address, bytes, storage as a flat uint8 tensor)
        seen = set()
        for t in tensors:
            storage = t.untyped_storage()
            if storage.data_ptr() in seen:
                continue
            seen.add(storage.data_ptr())
            flat = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)
            self._storages.append((storage.data_ptr(), storage.nbytes(), flat))

    def rows(self, base: int, stride: int, length: int, blocks: np.ndarray) -> Any:
        torch = self._torch
        top = int(blocks.max())
        for start, size, flat in self._storages:
            if start <= base and base + top * stride + length <= start + size:
                view = flat.as_strided((top + 1, length), (stride, 1), base - start)
                index = torch.as_tensor(blocks, device=flat.device)
                return view.index_select(0, index).view(torch.int64)
        raise DigestError(f"verify_kv: no KV tensor holds the {length} bytes at {base:#x}")


def producer_slices(segments: Sequence[Segment], local: Sequence[Region], remote: Sequence[Region],
                    regions: Iterable[int] | None = None) -> list[Slice]:
    """Prefill: what its plan (coalesce.py) writes, by region, in decode's block coordinates.
    A segment of several regions (adjacent on both sides) is cut back into them."""
    wanted = None if regions is None else set(regions)
    out: list[Slice] = []
    for seg in segments:
        if len(seg.regions) == 1:
            [k] = seg.regions
            parts = [(k, seg.remote_base - remote[k].base, seg.block_len, seg.local_base, seg.local_stride)]
        else:
            parts = [(k, 0, local[k].block_len, local[k].base, local[k].stride) for k in seg.regions]
        out.extend(Slice(*p) for p in parts if wanted is None or p[0] in wanted)
    return out


def decode_slices(regions: Sequence[Region], heads: Sequence[HeadLayout], first_head: int, num_heads: int,
                  whole: bool) -> list[Slice]:
    """Decode: what a push from one prefill rank writes into its blocks: heads
    [first_head, first_head + num_heads) of each chunk, or, where both sides hold exactly these
    heads (`whole`: prefill pairs whole blocks then), every byte of the block."""
    out = []
    for k, (region, layout) in enumerate(zip(regions, heads)):
        if whole:
            out.append(Slice(k, 0, region.block_len, region.base, region.stride))
            continue
        for at in layout.chunk_offsets:
            offset = at + first_head * layout.head_bytes
            out.append(Slice(k, offset, num_heads * layout.head_bytes, region.base + offset, region.stride))
    return out


def digest(
    memory: KvMemory, slices: Iterable[Slice], blocks: Sequence[int], regions: Iterable[int] | None = None
) -> int:
    """The digest of those slices (of `regions` only, if given) over `blocks`, block i keyed by i."""
    wanted = None if regions is None else set(regions)
    ids = np.asarray(blocks, dtype=np.int64)
    total = 0
    if ids.size == 0:
        return total
    for s in slices:
        if wanted is not None and s.region not in wanted:
            continue
        rows = memory.rows(s.base, s.stride, s.length, ids)
        total += _sum(rows, s.region, s.offset // WORD)
    return total & MASK


def _sum(rows: Any, region: int, first_word: int) -> int:
    if isinstance(rows, np.ndarray):
        return _sum_numpy(rows, region, first_word)
    return _sum_torch(rows, region, first_word)


def _sum_numpy(rows: np.ndarray, region: int, first_word: int) -> int:
    n, words = rows.shape
    col = np.arange(first_word, first_word + words, dtype=np.uint64) * np.uint64(K_WORD)
    row = np.arange(n, dtype=np.uint64) * np.uint64(K_BLOCK) + np.uint64(region * K_REGION & MASK)
    h = rows ^ col  # a new array: the caller's rows stay as they are
    h ^= row[:, None]
    h *= np.uint64(C1)
    h ^= h >> np.uint64(32)
    h *= np.uint64(C2)
    return int(h.sum(dtype=np.uint64))


def _signed(value: int) -> int:
    """A 64-bit constant as torch's int64 holds it (torch has no unsigned arithmetic to speak of)."""
    return value - (1 << 64) if value >= 1 << 63 else value


def _sum_torch(rows: Any, region: int, first_word: int) -> int:
    import torch

    n, words = rows.shape
    device = rows.device
    col = torch.arange(first_word, first_word + words, dtype=torch.int64, device=device) * _signed(K_WORD)
    row = torch.arange(n, dtype=torch.int64, device=device) * _signed(K_BLOCK) + _signed(region * K_REGION & MASK)
    h = rows ^ col
    h ^= row[:, None]
    h *= _signed(C1)
    h ^= (h >> 32) & 0xFFFFFFFF  # torch shifts int64 arithmetically: keep the logical shift's bits
    h *= _signed(C2)
    return int(h.sum().item()) & MASK


def to_wire(value: int) -> str:
    return f"{value & MASK:016x}"


def from_wire(text: str) -> int:
    return int(text, 16)
