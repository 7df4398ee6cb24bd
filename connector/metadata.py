"""What the scheduler-side connector tells the worker-side connector each step, and back.

Plain dataclasses (vLLM-free); connector.py derives the class vLLM carries from KVConnectorMetadata.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from kvpush.common.kv_params import PromptIdentity


@dataclass(frozen=True)
class SendSpec:
    """P: this request's prefill completes in this step; push its blocks after the forward."""

    req_id: str
    transfer_id: str
    block_ids: tuple[int, ...]
    peer_engine: str
    peer_tp_size: int = 1


@dataclass(frozen=True)
class RecvSpec:
    """D: blocks allocated for this request; register them with P now."""

    req_id: str
    transfer_id: str
    peer_engine: str
    peer_host: str
    peer_port: int
    peer_tp_size: int
    block_ids: tuple[int, ...]
    first_block: int
    num_tokens: int
    report: bool = True  # False: nothing to load (local hit); only tell P, vLLM waits for nothing
    prompt: PromptIdentity | None = None  # what P's request must agree with before it writes (REGISTER)
    refused: str = ""  # why the request's kv_transfer_params were refused: its load fails, P is not contacted


@dataclass
class PushMetadata:
    sends: list[SendSpec] = field(default_factory=list)
    recvs: list[RecvSpec] = field(default_factory=list)
    # P: (transfer id, decode TP size, the prompt's identity) of new requests
    accepts: list[tuple[str, int, PromptIdentity | None]] = field(default_factory=list)
    aborts: list[tuple[str, str, int]] = field(default_factory=list)  # P: (transfer id, reason, decode TP size)
    cancels: list[str] = field(default_factory=list)  # D: transfer ids
    # D: requests this step computes for the first time since their KV was reported received
    loading: list[str] = field(default_factory=list)
    # D: (request, transfer) ended after its KV was reported received but before it was computed:
    # report it received again once nothing can land in its blocks any more (vLLM frees them then)
    releases: list[tuple[str, str]] = field(default_factory=list)
    idle: bool = False  # the step computes no tokens: it runs only to collect transfer outcomes


@dataclass(frozen=True)
class Evictions:
    """Worker -> scheduler: blocks to drop from the prefix cache (a streamed WRITE into them failed
    after vLLM had cached them as loaded)."""

    blocks: frozenset[int] = frozenset()

    def aggregate(self, other: Evictions) -> Evictions:
        return type(self)(self.blocks | other.blocks)
