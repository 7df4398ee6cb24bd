"""P's decode ranks that completed a handshake: their live connection, their NIXL peer, and the
number (generation) of every admitted connection still open. A registration belongs to the
connection it came on; a push is written only while that connection is the decode rank's live one.
Plain bookkeeping; the producer's lock guards writes, and `live` may be read without it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .channel import Connection
from .transfer import Peer


@dataclass
class Peers:
    """D ranks that completed a handshake (keyed engine#rank): their live connection and NIXL peer,
    and the number (generation) of every admitted connection still open: a registration belongs
    to the connection it came on."""

    conns: dict[str, Connection] = field(default_factory=dict)
    nixl: dict[str, Peer] = field(default_factory=dict)
    generations: dict[Connection, int] = field(default_factory=dict)
    admitted: int = 0

    def admit(self, key: str, conn: Connection, peer: Peer) -> Connection | None:
        """The decode rank's new live connection; the one it replaces, if any."""
        old = self.conns.get(key)
        self.admitted += 1
        self.generations[conn] = self.admitted
        self.conns[key], self.nixl[key] = conn, peer
        return old if old is not conn else None

    def generation(self, conn: Connection) -> int:
        """0 for a connection not admitted (or closed)."""
        return self.generations.get(conn, 0)

    def closed(self, conn: Connection) -> tuple[int, bool]:
        """The connection's generation (0 if it was never admitted), and whether it was live."""
        generation = self.generations.pop(conn, 0)
        engine_id = conn.engine_id
        if engine_id is None or self.conns.get(engine_id) is not conn:
            return generation, False
        del self.conns[engine_id]
        return generation, True

    def live(self, engine_id: str, generation: int) -> Connection | None:
        """The connection of that generation, if it is still the decode rank's live one. Reads
        only (no lock needed for a check the compute thread makes between two streamed parts)."""
        conn = self.conns.get(engine_id)
        return conn if conn is not None and self.generations.get(conn) == generation else None
