"""What pushes.py keeps of each push: a WRITE in flight, one given up on and drained, one made
ahead, and the record of a finished push (for stats)."""
from __future__ import annotations

from dataclasses import dataclass

from .channel import Connection
from .state import Match
from .transfer import NixlEngine, Peer, Write


@dataclass(frozen=True)
class SendRecord:
    """One finished push, for stats and timing analysis."""

    transfer_id: str
    req_id: str
    ok: bool
    num_bytes: int
    offered: float  # prefill step end (monotonic)
    registered: float  # D's registration arrival
    posted: float  # WRITE started (NIXL's post called)
    finished: float
    reason: str = ""
    num_descriptors: int = 0
    prepared_ahead: bool = False  # the WRITE was made before the prefill ended
    peer_rank: int = 0  # the decode rank this push wrote into (transfer_id is the request's, over all ranks)


@dataclass
class InFlight:
    match: Match
    writes: list[Write]  # one, or a streamed WRITE's parts not yet driven to completion
    conn: Connection
    posted: float
    prepared_ahead: bool
    error: str = ""  # a part could not be posted: FAIL once the others are no longer in flight
    num_bytes: int = 0  # of the parts that completed before
    deadline: float = float("inf")  # still copying then: failed (a WRITE that neither ends nor errors)
    digest: str = ""  # verify_kv: of every byte it writes, for its DONE

    def state(self, engine: NixlEngine) -> str:
        """PROC while any part is; then ERR if any part failed or could not be posted."""
        states = [engine.state(w) for w in self.writes]
        if "PROC" in states:
            return "PROC"
        return "ERR" if self.error or "ERR" in states else "DONE"


@dataclass
class Draining:
    """Handles of a push given up on while they still copied: polled until each ended."""

    transfer_id: str
    writes: list[Write]
    conn: Connection | None  # where QUIESCED goes then, if it is still open


@dataclass
class Prepared:
    """A WRITE made before its prefill ended, for exactly these blocks and this peer."""

    engine_id: str
    peer: Peer
    src_blocks: tuple[int, ...]
    dst_blocks: tuple[int, ...]
    write: Write
