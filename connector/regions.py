"""What each side of a push registers and compares at handshake: its KV memory regions, how its
KV heads lie inside their blocks, and the layout identity both sides must share. The HELLO carries
them (wire.py); layout.py computes them from vLLM's KV tensors; the engine (transfer.py) registers
and addresses them.
"""
from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True)
class Region:
    """One registered KV memory region: `num_blocks` blocks of `block_len` bytes, `stride` apart."""

    base: int
    block_len: int
    stride: int
    num_blocks: int


@dataclass(frozen=True)
class LayoutIdentity:
    """What must be equal on both sides for block i of one to mean block i of the other. TP sizes
    may differ: each side's HELLO says how its heads lie (HeadLayout) and P pairs them."""

    model: str
    dtype: str
    block_size: int
    layer_names: tuple[str, ...]
    kv_heads: int  # the model's KV heads (1 for a latent cache), however TP splits them

    def mismatches(self, other: LayoutIdentity) -> list[str]:
        """Human-readable differences, naming this side's value first."""
        out = []
        for f in fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if mine != theirs:
                if f.name == "layer_names":
                    only_mine = sorted(set(mine) - set(theirs))[:3]
                    only_theirs = sorted(set(theirs) - set(mine))[:3]
                    out.append(
                        f"layer_names: {len(mine)} layers (only here: {only_mine}) vs {len(theirs)} (only there: "
                        f"{only_theirs})"
                    )
                else:
                    out.append(f"{f.name}: {mine!r} vs {theirs!r}")
        return out


@dataclass(frozen=True)
class HeadLayout:
    """Where a region's KV heads lie inside each of its blocks: local head h of chunk c occupies
    bytes [chunk_offsets[c] + h * head_bytes, + head_bytes). One chunk when heads are outermost
    in the block (vLLM's CPU layout, LBHNC/BLHNC/BHLNC); more when something lies outside them
    (a K/V split: 2; tokens, as in NHD: one per token, too many to push a head slice)."""

    heads: int
    head_bytes: int
    chunk_offsets: tuple[int, ...]

    @classmethod
    def whole(cls, block_len: int) -> HeadLayout:
        """One head filling the block (a rank's only head, or a latent cache)."""
        return cls(1, block_len, (0,))
