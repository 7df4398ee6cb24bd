"""What a prefill rank's push service is told at start-up (producer.py)."""
from __future__ import annotations

from dataclasses import dataclass, field

from .channel import AUTH_DEADLINE_S, MAX_CONNECTIONS
from .kv_digest import KvMemory
from .regions import HeadLayout, LayoutIdentity
from .sharding import HeadSharding


@dataclass
class ProducerConfig:
    engine_id: str
    identity: LayoutIdentity
    allowed_engines: frozenset[str]
    host: str
    port: int
    timeout_s: float = 5.0  # unmatched halves expire, and a posted WRITE must end, within this
    tp_rank: int = 0
    # how this instance's KV heads lie over its ranks; which decode ranks this rank writes into
    # follows from it and the decode's TP size (sharding.py)
    sharding: HeadSharding = field(default_factory=lambda: HeadSharding(1, 1))
    head_layouts: tuple[HeadLayout, ...] = ()  # per region; () = one head filling each block
    # The deployment's side-channel key: a decode rank must prove it holds it (auth.py). Empty:
    # no authentication, for tests and benchmarks that build the service directly.
    side_channel_key: bytes = b""
    auth_deadline_s: float = AUTH_DEADLINE_S  # a connection that has not proven itself by then is closed
    max_connections: int = MAX_CONNECTIONS
    # DRAM: the copy is CPU work, so the compute thread that posted a WRITE completes it at once.
    # VRAM: the GPU's copy engines do it; the compute thread returns to vLLM.
    drive_writes: bool = True
    # ... and, where it drives them, writes layer by layer with STREAMING/LANDED to D
    stream_writes: bool = False
    # verify_kv (kv_digest.py): where this rank's KV is read to send decode a digest of each push;
    # None: no digests
    verify_kv: KvMemory | None = None
