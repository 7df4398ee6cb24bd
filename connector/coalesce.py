"""One request's blocks as few NIXL descriptors as both sides' memory allows.

Two kinds of adjacency are merged, each only where it holds on the local and the remote side:
- regions: region i+1 starts where region i's block ends and both step by the same stride (K and V
  inside one block, or all layers of a block-major cross-layer cache) -> one segment whose block
  is their union;
- blocks: pairs (s, d), (s+1, d+1) of a segment whose blocks are packed (stride == block length)
  on both sides -> one descriptor per run instead of one per block.

Pure numpy on addresses, so it is testable without NIXL or a GPU; descriptors come out as Nx3
uint64 arrays (address, length, device), the form NIXL converts fastest.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .regions import HeadLayout, Region

# A head slice of a block may be cut into this many ranges (a K/V split); more means the layout
# puts tokens outside the heads (NHD), one range per token: refused rather than pushed that way.
MAX_SLICE_CHUNKS = 2
HEAD_MAJOR_LAYOUTS = "LBHNC, BLHNC or BHLNC"


class CoalesceError(ValueError):
    """Two sides whose regions cannot be paired block for block."""


@dataclass(frozen=True)
class Segment:
    """Consecutive regions that move as one: block b starts at base + b * stride on each side."""

    local_base: int
    remote_base: int
    block_len: int
    local_stride: int
    remote_stride: int
    regions: tuple[int, ...]  # indices of the paired regions it covers (same index on both sides)

    @property
    def num_regions(self) -> int:
        return len(self.regions)

    @property
    def packed(self) -> bool:
        """Blocks follow each other without gaps on both sides, so a run of blocks is one range."""
        return self.local_stride == self.block_len == self.remote_stride


def pair_segments(local: Sequence[Region], remote: Sequence[Region]) -> tuple[Segment, ...]:
    """Pair region i here with region i there and merge neighbours adjacent on both sides.

    Pairs are visited in local address order, so the order layers were listed in does not matter.
    """
    if len(local) != len(remote):
        raise CoalesceError(f"{len(local)} KV regions here vs {len(remote)} on the peer")
    for i, (mine, theirs) in enumerate(zip(local, remote)):
        if mine.block_len != theirs.block_len:
            raise CoalesceError(f"KV region {i}: {mine.block_len}-byte blocks here vs {theirs.block_len} on the peer")
    segments: list[Segment] = []
    prev: tuple[Region, Region] | None = None
    for index, mine, theirs in sorted(zip(range(len(local)), local, remote), key=lambda item: item[1].base):
        if prev is not None and _continues(segments[-1], prev, mine, theirs):
            s = segments[-1]
            segments[-1] = Segment(s.local_base, s.remote_base, s.block_len + mine.block_len,
                                   s.local_stride, s.remote_stride, s.regions + (index,))
        else:
            segments.append(Segment(mine.base, theirs.base, mine.block_len, mine.stride, theirs.stride, (index,)))
        prev = (mine, theirs)
    return tuple(segments)


def slice_segments(local: Sequence[Region], local_heads: Sequence[HeadLayout], local_first: int,
                   remote: Sequence[Region], remote_heads: Sequence[HeadLayout], remote_first: int,
                   num_heads: int) -> tuple[Segment, ...]:
    """Segments that move `num_heads` heads of every block: from local head `local_first` on of
    region i here into remote head `remote_first` on of region i there. Whole blocks on both
    sides (equal TP) pair as `pair_segments` does, merging neighbours; a head slice is one
    segment per region and chunk, its blocks one descriptor each (a slice is never packed)."""
    if len(local) != len(remote) or len(local_heads) != len(local) or len(remote_heads) != len(remote):
        raise CoalesceError(f"{len(local)} KV regions here vs {len(remote)} on the peer")
    whole = all(local_first == 0 == remote_first and lh.heads == num_heads == rh.heads
                for lh, rh in zip(local_heads, remote_heads))
    if whole:
        return pair_segments(local, remote)
    segments = []
    for i, (mine, my_heads, theirs, their_heads) in enumerate(zip(local, local_heads, remote, remote_heads)):
        if my_heads.head_bytes != their_heads.head_bytes:
            raise CoalesceError(
                f"KV region {i}: {my_heads.head_bytes}-byte heads here vs {their_heads.head_bytes} on the peer"
            )
        if local_first + num_heads > my_heads.heads or remote_first + num_heads > their_heads.heads:
            raise CoalesceError(f"KV region {i}: heads {local_first}..{local_first + num_heads - 1} here -> "
                                f"{remote_first}..{remote_first + num_heads - 1} there, but the blocks hold "
                                f"{my_heads.heads} and {their_heads.heads}")
        chunks = max(len(my_heads.chunk_offsets), len(their_heads.chunk_offsets))
        if chunks > MAX_SLICE_CHUNKS or len(my_heads.chunk_offsets) != len(their_heads.chunk_offsets):
            raise CoalesceError(
                f"a head slice of a block is {chunks} separate ranges in this KV layout (tokens lie "
                f"outside the heads); TP sizes that differ need a head-major layout ({HEAD_MAJOR_LAYOUTS}): "
                f"set VLLM_KV_CACHE_LAYOUT=BLHNC on both instances"
            )
        for mine_at, theirs_at in zip(my_heads.chunk_offsets, their_heads.chunk_offsets):
            segments.append(Segment(mine.base + mine_at + local_first * my_heads.head_bytes,
                                    theirs.base + theirs_at + remote_first * their_heads.head_bytes,
                                    num_heads * my_heads.head_bytes, mine.stride, theirs.stride, (i,)))
    return tuple(segments)


def _continues(seg: Segment, prev: tuple[Region, Region], mine: Region, theirs: Region) -> bool:
    # with two or more blocks the next region starts inside the previous one's span, so both lie in
    # one allocation (and one registration, see layout.region_spans)
    prev_mine, prev_theirs = prev
    return (mine.num_blocks > 1 and theirs.num_blocks > 1
            and mine.base == seg.local_base + seg.block_len and theirs.base == seg.remote_base + seg.block_len
            and mine.stride == seg.local_stride and theirs.stride == seg.remote_stride
            and seg.block_len + mine.block_len <= min(seg.local_stride, seg.remote_stride)  # blocks stay apart
            and mine.num_blocks == prev_mine.num_blocks and theirs.num_blocks == prev_theirs.num_blocks)


@dataclass(frozen=True)
class Runs:
    """Maximal runs of block pairs adjacent on both sides: src[i]..src[i]+n-1 -> dst[i]..dst[i]+n-1."""

    src: np.ndarray
    dst: np.ndarray
    length: np.ndarray

    def __len__(self) -> int:
        return len(self.length)


def block_runs(src_blocks: Sequence[int] | np.ndarray, dst_blocks: Sequence[int] | np.ndarray) -> Runs:
    src = np.asarray(src_blocks, dtype=np.int64)
    dst = np.asarray(dst_blocks, dtype=np.int64)
    if src.shape != dst.shape or src.ndim != 1:
        raise CoalesceError(f"{src.size} source blocks vs {dst.size} destination blocks")
    if src.size == 0:
        empty = np.zeros(0, dtype=np.int64)
        return Runs(empty, empty, empty)
    # plain operators and methods only: numpy's Python-level helpers (diff, flatnonzero,
    # broadcast_to) cost more than the arithmetic at request sizes
    first = np.empty(src.size, dtype=bool)  # pair i starts a run
    first[0] = True
    np.not_equal(src[1:] - src[:-1], 1, out=first[1:])
    first[1:] |= dst[1:] - dst[:-1] != 1
    starts = first.nonzero()[0]
    lengths = np.empty_like(starts)
    lengths[:-1] = starts[1:] - starts[:-1]
    lengths[-1] = src.size - starts[-1]
    return Runs(src[starts], dst[starts], lengths)


class Plan:
    """The segments of one peer pairing as column arrays, built once per peer so that a request
    costs only its own arithmetic (tens of microseconds)."""

    def __init__(self, segments: Sequence[Segment], local_device: int = 0, remote_device: int = 0):
        self.segments = tuple(segments)
        self.bytes_per_block = sum(s.block_len for s in self.segments)
        self.local_device = local_device
        self.remote_device = remote_device
        packed = [s for s in self.segments if s.packed]
        loose = [s for s in self.segments if not s.packed]
        self._packed = _columns(packed)
        self._loose = _columns(loose)

    @classmethod
    def pair(cls, local: Sequence[Region], remote: Sequence[Region], local_device: int = 0,
             remote_device: int = 0) -> Plan:
        return cls(pair_segments(local, remote), local_device, remote_device)

    @property
    def num_regions(self) -> int:
        return len({i for s in self.segments for i in s.regions})

    def parts(self, src_blocks, dst_blocks) -> list[tuple[np.ndarray, np.ndarray, tuple[int, ...]]]:
        """`descriptors` cut into one part per set of regions, in local address order (layer order
        for a layer-major cache): (local rows, remote rows, indices of the regions the part fills).
        Sent one after another, they let the receiver use each layer as soon as its part lands."""
        local, remote = self.descriptors(src_blocks, dst_blocks)
        packed = [s for s in self.segments if s.packed]
        loose = [s for s in self.segments if not s.packed]
        num_blocks = len(src_blocks)
        rows_per_packed = (len(local) - num_blocks * len(loose)) // len(packed) if packed else 0  # the runs
        rows = {id(seg): rows_per_packed if seg.packed else num_blocks for seg in self.segments}
        start, at = {}, 0
        for seg in packed + loose:
            start[id(seg)] = at  # the row order `descriptors` writes: packed segments first
            at += rows[id(seg)]
        groups: dict[tuple[int, ...], list[tuple[int, int]]] = {}  # the segments that fill a region set
        for seg in sorted(self.segments, key=lambda s: s.local_base):
            lo, hi = start[id(seg)], start[id(seg)] + rows[id(seg)]
            if hi > lo:
                groups.setdefault(seg.regions, []).append((lo, hi))
        out = []
        for regions, spans in groups.items():
            pick = np.concatenate([np.arange(lo, hi) for lo, hi in spans]) if len(spans) > 1 else slice(*spans[0])
            out.append((local[pick], remote[pick], regions))
        return out

    def descriptors(self, src_blocks, dst_blocks) -> tuple[np.ndarray, np.ndarray]:
        """Local and remote Nx3 (address, length, device) uint64 arrays, row i of one pairing row i
        of the other: one row per run in packed segments, one row per block in the others."""
        src = np.asarray(src_blocks, dtype=np.int64)
        dst = np.asarray(dst_blocks, dtype=np.int64)
        if src.shape != dst.shape or src.ndim != 1:
            raise CoalesceError(f"{src.size} source blocks vs {dst.size} destination blocks")
        parts: list[tuple[_Columns, np.ndarray, np.ndarray, np.ndarray | None]] = []
        if self._packed is not None:
            runs = block_runs(src, dst)
            parts.append((self._packed, runs.src, runs.dst, runs.length))
        if self._loose is not None:
            parts.append((self._loose, src, dst, None))
        rows = sum(cols.local_base.size * s.size for cols, s, _, _ in parts)
        local = np.empty((rows, 3), dtype=np.int64)  # filled as int64, handed out as uint64 (no casts)
        remote = np.empty((rows, 3), dtype=np.int64)
        local[:, 2] = self.local_device
        remote[:, 2] = self.remote_device
        at = 0
        for cols, s, d, length in parts:
            n = cols.local_base.size * s.size
            # run (or block) i of segment k sits at row at + k * len(runs) + i
            mine = local[at:at + n].reshape(cols.local_base.size, s.size, 3)
            theirs = remote[at:at + n].reshape(cols.local_base.size, s.size, 3)
            mine[:, :, 0] = cols.local_base + s * cols.local_stride
            theirs[:, :, 0] = cols.remote_base + d * cols.remote_stride
            mine[:, :, 1] = cols.block_len if length is None else cols.block_len * length
            at += n
        remote[:, 1] = local[:, 1]
        return local.view(np.uint64), remote.view(np.uint64)


@dataclass(frozen=True)
class _Columns:
    local_base: np.ndarray  # (segments, 1) int64
    remote_base: np.ndarray
    local_stride: np.ndarray
    remote_stride: np.ndarray
    block_len: np.ndarray


def _columns(segments: Sequence[Segment]) -> _Columns | None:
    if not segments:
        return None

    def col(name: str) -> np.ndarray:
        return np.array([getattr(s, name) for s in segments], dtype=np.int64)[:, None]

    return _Columns(col("local_base"), col("remote_base"), col("local_stride"), col("remote_stride"), col("block_len"))
