"""Is a prefill peer still answering? D's side of the side channel's ping.

A P that is killed, hung or dying slowly may keep its TCP connection open for seconds (the kernel
closes a killed process's sockets only once the whole process has exited), and an accepted
transfer has no deadline of its own. So while D has transfers pending on a P, it pings that P
every `interval_s`; P's reactor thread answers at once, whatever its compute thread is doing. Any
message from P counts as an answer. A P that has left a ping unanswered for `silence_s` is gone.

P's reactor thread does nothing else (no NIXL call, no lock the engine holds), so how long a PING
waits is how long P's process waits for a core and its GIL, not how long its engine's step is.
Measured on a 2-core host with prefill computing at full load and two busy loops beside it
(benchmarks/results/side-channel-pong-saturated-2026-12-05): the slowest PONG of every run took
well under a tenth of a second. DEFAULT_SILENCE_S is a multiple of that large enough for a garbage
collection pause or a descheduled decode on top; the price is that a prefill that really hangs
fails its transfers that much later (one that dies closes the connection and fails them at once).

A P admits a decode rank (WELCOME) only after making it a NIXL peer, which under CPU contention
took over a second (measured again on the saturated host: at most a fraction of a second); until
then nothing from it can be expected, so a P that has proven its key but not yet admitted D is not
pinged, and has `admission_s` to do so instead.
Pure logic, driven by the consumer's reactor thread.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

DEFAULT_PING_INTERVAL_S = 0.2
DEFAULT_SILENCE_S = 5.0
DEFAULT_ADMISSION_S = 10.0


@dataclass
class PeerLiveness:
    interval_s: float = DEFAULT_PING_INTERVAL_S
    silence_s: float = DEFAULT_SILENCE_S
    admission_s: float = DEFAULT_ADMISSION_S
    _admitting: dict[str, float] = field(default_factory=dict)  # proven its key at, not yet admitted D
    _last_ping: dict[str, float] = field(default_factory=dict)
    _unanswered_since: dict[str, float] = field(default_factory=dict)  # first ping not yet answered

    def heard(self, peer: str) -> None:
        self._unanswered_since.pop(peer, None)

    def forget(self, peer: str) -> None:
        self._admitting.pop(peer, None)
        self._last_ping.pop(peer, None)
        self._unanswered_since.pop(peer, None)

    def proven(self, peer: str, now: float) -> None:
        """P proved its key; its admission of D is under way."""
        self._admitting[peer] = now

    def admitted(self, peer: str) -> None:
        """P admitted D: from now on its silence counts."""
        self._admitting.pop(peer, None)

    def unadmitted(self, waited_on: Iterable[str], now: float) -> list[str]:
        """Peers D waits on that have been admitting it for longer than `admission_s`."""
        return sorted(p for p in set(waited_on) if p in self._admitting and now - self._admitting[p] > self.admission_s)

    def due(self, busy_peers: Iterable[str], now: float) -> tuple[list[str], list[str]]:
        """(peers to ping now, peers silent for too long) among those D waits on."""
        busy = set(busy_peers) - self._admitting.keys()
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
            if peer in self._admitting:
                times.append(self._admitting[peer] + self.admission_s)
                continue
            last = self._last_ping.get(peer)
            if last is None:
                return float("-inf")  # never pinged: now
            times.append(last + self.interval_s)
            since = self._unanswered_since.get(peer)
            if since is not None:
                times.append(since + self.silence_s)
        return min(times) if times else None
