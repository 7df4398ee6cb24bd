"""Is a prefill peer still answering? D's side of the side channel's ping.

A P that is killed, hung or dying slowly may keep its TCP connection open for seconds (the kernel
closes a killed process's sockets only once the whole process has exited), and an accepted
transfer has no deadline of its own. So while D has transfers pending on a P, it pings that P
every `interval_s`; P's reactor thread answers at once, whatever its compute thread is doing. Any
message from P counts as an answer. A P that has left a ping unanswered for `silence_s` is gone.
Pure logic, driven by the consumer's reactor thread.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

DEFAULT_PING_INTERVAL_S = 0.2
DEFAULT_SILENCE_S = 1.0


@dataclass
class PeerLiveness:
    interval_s: float = DEFAULT_PING_INTERVAL_S
    silence_s: float = DEFAULT_SILENCE_S
    _last_ping: dict[str, float] = field(default_factory=dict)
    _unanswered_since: dict[str, float] = field(default_factory=dict)  # first ping not yet answered

    def heard(self, peer: str) -> None:
        self._unanswered_since.pop(peer, None)

    def forget(self, peer: str) -> None:
        self._last_ping.pop(peer, None)
        self._unanswered_since.pop(peer, None)

    def due(self, busy_peers: Iterable[str], now: float) -> tuple[list[str], list[str]]:
        """(peers to ping now, peers silent for too long) among those D waits on."""
        busy = set(busy_peers)
        for idle in [p for p in self._unanswered_since if p not in busy]:
            del self._unanswered_since[idle]  # nothing pending there: its silence harms no request
        to_ping, silent = [], []
        for peer in sorted(busy):
            since = self._unanswered_since.get(peer)
            if since is not None and now - since > self.silence_s:
                silent.append(peer)
            elif now - self._last_ping.get(peer, float("-inf")) >= self.interval_s:
                to_ping.append(peer)
                self._last_ping[peer] = now
                self._unanswered_since.setdefault(peer, now)
        return to_ping, silent

    def next_deadline(self, busy_peers: Iterable[str]) -> float | None:
        """When `due` next has something to do for these peers (monotonic), None when idle."""
        times = []
        for peer in busy_peers:
            last = self._last_ping.get(peer)
            if last is None:
                return float("-inf")  # never pinged: now
            times.append(last + self.interval_s)
            since = self._unanswered_since.get(peer)
            if since is not None:
                times.append(since + self.silence_s)
        return min(times) if times else None
