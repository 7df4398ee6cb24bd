"""What a decode rank's push service is told at start-up (consumer.py)."""
from __future__ import annotations

from dataclasses import dataclass, field

from .kv_digest import KvMemory
from .liveness import DEFAULT_ADMISSION_S, DEFAULT_SILENCE_S
from .regions import HeadLayout, LayoutIdentity
from .sharding import HeadSharding


@dataclass
class ConsumerConfig:
    engine_id: str
    tp_rank: int
    identity: LayoutIdentity
    allowed_engines: frozenset[str]
    timeout_s: float = 5.0
    # a prefill's kernel answers a SYN at once however busy the prefill is, but a SYN lost to a full
    # accept queue is sent again only after 1 s: a 1 s bound would fail transfers for that alone
    connect_timeout_s: float = 5.0
    peer_silence_s: float = DEFAULT_SILENCE_S  # a P waited on that answers no ping this long is gone
    admission_timeout_s: float = DEFAULT_ADMISSION_S  # a P that proved its key must admit D within this (liveness.py)
    accepted_timeout_s: float = 300.0  # a P that accepted a transfer and then sent nothing this long
    sharding: HeadSharding = field(default_factory=lambda: HeadSharding(1, 1))  # this instance's heads over its ranks
    head_layouts: tuple[HeadLayout, ...] = ()  # per region; () = one head filling each block
    side_channel_key: bytes = b""  # the deployment's (auth.py); empty: no authentication (tests, benchmarks)
    # Where each allowed prefill's side channel is (engine id -> host, base port), from the
    # deployment's configuration: a request naming another address is refused, so no client can
    # point this decode at a host of its choosing. None: the request's address is used (tests).
    peers: dict[str, tuple[str, int]] | None = None
    # the backstop of a fence (fences.py): how long after a part was given up on while P may still
    # write into its blocks this side drops P's connection and lets the blocks go; 0: never
    late_write_hold_s: float = 30.0
    # verify_kv (kv_digest_check.py): where this rank's KV is read for digests; None: no check
    verify_kv: KvMemory | None = None
