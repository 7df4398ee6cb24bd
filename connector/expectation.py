"""What a decode rank expects of one transfer before it registers a block: whether the prefill a
request names may write into this rank at all, and, for each prefill rank holding KV heads of
this rank, the part it sends: its name, the bytes it brings and, with verify_kv, what its digest
covers. Pure: the push service (consumer.py) turns a refusal into the request's outcome.
"""
from __future__ import annotations

from dataclasses import dataclass

from . import wire
from .consumer_config import ConsumerConfig
from .fanin import rank_key
from .kv_digest import Slice
from .kv_digest_check import slices_for_piece
from .sharding import HeadSharding, ShardingError, pieces_for_decode


class Refused(Exception):
    """The request's prefill may not write here; `counter` names the refusal among the counters."""

    def __init__(self, counter: str, reason: str):
        super().__init__(reason)
        self.counter = counter
        self.reason = reason


@dataclass(frozen=True)
class Part:
    """What prefill rank `p_rank` sends of the transfer; `slices` only with verify_kv."""

    key: str
    p_rank: int
    expected_bytes: int
    slices: list[Slice] | None


def prefill_sharding(config: ConsumerConfig, peer_engine: str, host: str, port: int,
                     peer_tp_size: int) -> HeadSharding:
    """The KV heads of prefill `peer_engine` (TP `peer_tp_size`, side channel at `host`:`port`)
    over its ranks; Refused if this rank takes no KV from it."""
    if peer_engine not in config.allowed_engines:
        raise Refused(
            "refused_peer",
            f"prefill engine {peer_engine!r} is not in allowed_engines {sorted(config.allowed_engines)}",
        )
    try:
        prefill = HeadSharding(config.sharding.total_heads, peer_tp_size)
    except ShardingError as exc:
        raise Refused("refused_peer", f"prefill {peer_engine} runs TP {peer_tp_size}: {exc}") from exc
    known = config.peers.get(peer_engine) if config.peers is not None else (host, port)
    if known != (host, port):
        raise Refused(
            "unknown_address",
            f"the request names {host}:{port} as prefill {peer_engine}'s side channel, which the deployment "
            f"places at {f'{known[0]}:{known[1]}' if known else 'no address'}",
        )
    return prefill


def expected_parts(config: ConsumerConfig, layout: wire.Layout, prefill: HeadSharding, transfer_id: str,
                   num_blocks: int, verify: bool) -> list[Part]:
    """One part per prefill rank that writes into this rank's `num_blocks` blocks, in head order.
    With `verify`, DigestError for KV a digest cannot cover."""
    pieces = pieces_for_decode(config.tp_rank, prefill, config.sharding)
    slices = [
        slices_for_piece(layout.regions, layout.head_layouts, p, prefill, config.sharding) if verify else None
        for p in pieces
    ]
    return [
        Part(rank_key(transfer_id, piece.p_rank), piece.p_rank,
             num_blocks * _bytes_per_block(layout, piece.num_heads), part_slices)
        for piece, part_slices in zip(pieces, slices)
    ]


def _bytes_per_block(layout: wire.Layout, num_heads: int) -> int:
    """What `num_heads` of this rank's heads take of one block, over every region."""
    return sum(num_heads * h.head_bytes * len(h.chunk_offsets) for h in layout.head_layouts)
