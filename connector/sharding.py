"""Which KV heads each tensor-parallel rank holds, and which prefill rank writes which heads into
which decode rank. Pure arithmetic on head indices; byte offsets come from coalesce.slice_segments.

vLLM splits a model's H KV heads over T ranks in contiguous runs of H/T heads when T divides H,
and replicates them when H divides T (rank r holds head r // (T/H), each head on T/H ranks). A
latent (MLA) cache is one "head" that every rank holds. Any pair of valid sizes can be bridged:
every decode rank receives each of its heads exactly once, from one prefill rank that holds it;
where several prefill ranks hold a head (replication), decode ranks spread over them.
"""
from __future__ import annotations

from dataclasses import dataclass


class ShardingError(ValueError):
    """A TP size that cannot split the model's KV heads; the message names both numbers."""


@dataclass(frozen=True)
class HeadSharding:
    """How one instance's KV heads lie over its TP ranks."""

    total_heads: int  # the model's KV heads; 1 for a latent (MLA) cache
    tp_size: int

    def __post_init__(self) -> None:
        problem = tp_problem(self.total_heads, self.tp_size)
        if problem:
            raise ShardingError(problem)

    @property
    def heads_per_rank(self) -> int:
        return max(1, self.total_heads // self.tp_size)

    @property
    def replicas(self) -> int:
        """Ranks that hold each head."""
        return max(1, self.tp_size // self.total_heads)

    def heads_of(self, rank: int) -> range:
        """The global head indices rank `rank` holds, in the order they lie in its cache."""
        if not 0 <= rank < self.tp_size:
            raise ShardingError(f"TP rank {rank} outside 0..{self.tp_size - 1}")
        if self.tp_size <= self.total_heads:
            n = self.total_heads // self.tp_size
            return range(rank * n, rank * n + n)
        head = rank // self.replicas
        return range(head, head + 1)

    def holders(self, head: int) -> range:
        """The ranks that hold global head `head`."""
        if self.tp_size <= self.total_heads:
            rank = head // (self.total_heads // self.tp_size)
            return range(rank, rank + 1)
        return range(head * self.replicas, (head + 1) * self.replicas)


def tp_problem(total_heads: int, tp_size: int) -> str:
    """Why vLLM cannot split `total_heads` KV heads over `tp_size` ranks ("" if it can)."""
    if total_heads < 1 or tp_size < 1:
        return f"TP size {tp_size} with {total_heads} KV heads: both must be at least 1"
    if total_heads % tp_size and tp_size % total_heads:
        return (f"TP size {tp_size} does not divide the model's {total_heads} KV heads, nor do they divide it; "
                f"use a TP size that divides {total_heads} or a multiple of it")
    return ""


@dataclass(frozen=True)
class Piece:
    """Global heads [start, stop) that prefill rank `p_rank` writes into decode rank `d_rank`."""

    p_rank: int
    d_rank: int
    start: int
    stop: int

    @property
    def num_heads(self) -> int:
        return self.stop - self.start


def pieces_for_decode(d_rank: int, prefill: HeadSharding, decode: HeadSharding) -> list[Piece]:
    """What decode rank `d_rank` receives and from whom: its heads, each from one prefill rank
    holding it (among replicas, the one at index d_rank mod replicas), in head order."""
    _same_model(prefill, decode)
    out: list[Piece] = []
    for head in decode.heads_of(d_rank):
        holders = prefill.holders(head)
        source = holders[d_rank % len(holders)]
        if out and out[-1].p_rank == source and out[-1].stop == head:
            last = out[-1]
            out[-1] = Piece(source, d_rank, last.start, head + 1)
        else:
            out.append(Piece(source, d_rank, head, head + 1))
    return out


def pieces_for_prefill(p_rank: int, prefill: HeadSharding, decode: HeadSharding) -> list[Piece]:
    """What prefill rank `p_rank` writes, to which decode ranks, in decode rank order."""
    return [piece for d in range(decode.tp_size) for piece in pieces_for_decode(d, prefill, decode)
            if piece.p_rank == p_rank]


def sources_of(d_rank: int, prefill: HeadSharding, decode: HeadSharding) -> list[int]:
    """The prefill ranks decode rank `d_rank` receives from."""
    return sorted({p.p_rank for p in pieces_for_decode(d_rank, prefill, decode)})


def targets_of(p_rank: int, prefill: HeadSharding, decode: HeadSharding) -> list[int]:
    """The decode ranks prefill rank `p_rank` writes into."""
    return sorted({p.d_rank for p in pieces_for_prefill(p_rank, prefill, decode)})


def _same_model(prefill: HeadSharding, decode: HeadSharding) -> None:
    if prefill.total_heads != decode.total_heads:
        raise ShardingError(
            f"prefill has {prefill.total_heads} KV heads, decode {decode.total_heads}: not the same model"
        )
