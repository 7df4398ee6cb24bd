"""Push protocol state, pure (no vLLM, no NIXL, no sockets): callers pass the time in.

ProducerState (P) matches its finished blocks with D's registration by transfer id, in either
order. ConsumerState (D) tracks registrations until P reports DONE or FAIL, the peer goes away, or
they expire, and fences the blocks of a part P may still write into (fences.py). Both count what
they drop, so stray or late messages are visible but harmless.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace

from kvpush.common.kv_params import PromptIdentity

from .fences import Fences


@dataclass(frozen=True)
class Offer:
    """P's side of a transfer: the request's blocks, complete after its prefill step."""

    transfer_id: str
    req_id: str
    block_ids: tuple[int, ...]
    peer_engine: str
    created: float
    prompt: PromptIdentity | None = None  # P's request's prompt: D's registration must name the same


@dataclass(frozen=True)
class Registration:
    """D's side of a transfer as P received it."""

    transfer_id: str
    peer_engine: str
    block_ids: tuple[int, ...]
    first_block: int
    created: float
    generation: int = (
        0  # the connection it came on (P numbers the connections it admits); a post checks it is still live
    )
    prompt: PromptIdentity | None = None  # the prompt D loads the KV for


@dataclass(frozen=True)
class Match:
    offer: Offer
    registration: Registration
    src_blocks: tuple[int, ...]
    dst_blocks: tuple[int, ...]

    @property
    def wait_s(self) -> float:
        """How long the earlier half waited for the later one."""
        return abs(self.offer.created - self.registration.created)


@dataclass(frozen=True)
class Rejection:
    """A registration P answers with FAIL (reason), e.g. its request was aborted."""

    transfer_id: str
    peer_engine: str
    reason: str
    req_id: str | None = None  # P's request whose blocks are free again, if an offer was consumed
    tell_decode: bool = True  # False: only P's request is refused; D's transfer (another request's) goes on


@dataclass
class ProducerState:
    timeout_s: float
    offers: dict[str, Offer] = field(default_factory=dict)
    registrations: dict[str, Registration] = field(default_factory=dict)
    # transfer ids that are finished here (matched, aborted, expired): late duplicates are dropped
    closed: dict[str, float] = field(default_factory=dict)
    matched: set[str] = field(default_factory=set)  # closed ids whose KV was (being) sent
    aborted: dict[str, str] = field(default_factory=dict)  # transfer id -> reason, until D asks
    # requests P's scheduler holds (queued or prefilling): their registrations wait, not expire
    accepted: set[str] = field(default_factory=set)
    dropped: Counter = field(default_factory=Counter)

    def accept(self, transfer_id: str) -> Registration | None:
        """P has the request; returns D's registration if it is already waiting."""
        if transfer_id not in self.closed:
            self.accepted.add(transfer_id)
        return self.registrations.get(transfer_id)

    def offer(self, offer: Offer) -> Match | Rejection | None:
        tid = offer.transfer_id
        self.accepted.discard(tid)
        if tid in self.offers or tid in self.matched:  # a second request claims this transfer id
            self.dropped["duplicate_offer"] += 1
            return Rejection(tid, offer.peer_engine, f"transfer id {tid} is already another request's", offer.req_id,
                             tell_decode=False)
        if tid in self.closed:  # D cancelled or its registration expired: release the blocks
            self.dropped["late_offer"] += 1
            return Rejection(
                tid, offer.peer_engine, "decode gave up on this transfer before prefill finished", offer.req_id
            )
        reg = self.registrations.pop(tid, None)
        if reg is None:
            self.offers[tid] = offer
            return None
        return self._match(offer, reg)

    def register(self, reg: Registration) -> Match | Rejection | None:
        tid = reg.transfer_id
        if tid in self.aborted:
            reason = self.aborted.pop(tid)
            self.closed[tid] = reg.created
            return Rejection(tid, reg.peer_engine, reason)
        if tid in self.registrations:
            self.dropped["duplicate_registration"] += 1
            return None
        if tid in self.closed:
            self.dropped["late_registration"] += 1
            return Rejection(
                tid,
                reg.peer_engine,
                "prefill no longer holds KV for this transfer (expired, cancelled or already sent)",
            )
        offer = self.offers.pop(tid, None)
        if offer is None:
            self.registrations[tid] = reg
            return None
        return self._match(offer, reg)

    def _match(self, offer: Offer, reg: Registration) -> Match | Rejection:
        self.closed[offer.transfer_id] = max(offer.created, reg.created)
        self.matched.add(offer.transfer_id)
        if offer.peer_engine != reg.peer_engine:
            self.dropped["wrong_peer"] += 1
            return Rejection(
                offer.transfer_id,
                reg.peer_engine,
                f"transfer belongs to engine {offer.peer_engine!r}, not {reg.peer_engine!r}",
                offer.req_id,
            )
        if offer.prompt != reg.prompt:  # KV of one prompt must never be cached under another's
            self.dropped["prompt_mismatch"] += 1
            return Rejection(
                offer.transfer_id,
                reg.peer_engine,
                f"decode's prompt ({_tokens(reg.prompt)}) is not prefill's "
                f"({_tokens(offer.prompt)}): nothing is written",
                offer.req_id,
            )
        end = reg.first_block + len(reg.block_ids)
        if end > len(offer.block_ids):
            return Rejection(
                offer.transfer_id,
                reg.peer_engine,
                f"D registered blocks [{reg.first_block}, {end}) but P has {len(offer.block_ids)}",
                offer.req_id,
            )
        return Match(offer, reg, offer.block_ids[reg.first_block:end], reg.block_ids)

    def abort(self, transfer_id: str, reason: str, now: float) -> Registration | None:
        """P's request went away before its blocks were offered. Returns D's waiting registration
        (to answer FAIL now) or remembers the reason for when it arrives."""
        self.accepted.discard(transfer_id)
        reg = self.registrations.pop(transfer_id, None)
        if reg is not None:
            self.closed[transfer_id] = now
            return reg
        if transfer_id not in self.closed:
            self.aborted[transfer_id] = reason
            self.closed[transfer_id] = now
        return None

    def cancel(self, transfer_id: str, peer_engine: str, now: float) -> Offer | None:
        """D gave up: drop its registration; return P's unmatched offer so its blocks are freed."""
        reg = self.registrations.get(transfer_id)
        if reg is not None and reg.peer_engine == peer_engine:
            del self.registrations[transfer_id]
            self.accepted.discard(transfer_id)
        offer = self.offers.get(transfer_id)
        if offer is not None and offer.peer_engine == peer_engine:
            del self.offers[transfer_id]
            self.closed[transfer_id] = now
            return offer
        if transfer_id not in self.closed:
            self.closed[transfer_id] = now
        return None

    def peer_gone(self, peer_engine: str, now: float, generation: int | None = None) -> None:
        """D's connection (`generation`; None: any) is gone: its registrations with it. An offer for
        one of them later is refused at once (its blocks freed), not held until it expires."""
        for tid in [t for t, r in self.registrations.items()
                    if r.peer_engine == peer_engine and generation in (None, r.generation)]:
            del self.registrations[tid]
            self.accepted.discard(tid)
            self.closed[tid] = now

    def expire(self, now: float) -> tuple[list[Offer], list[Registration]]:
        """Unmatched halves older than the timeout: offers (free P's blocks) and registrations
        (answer D with FAIL). Closed ids are remembered a while longer to drop late duplicates."""
        cutoff = now - self.timeout_s
        offers = [o for o in self.offers.values() if o.created < cutoff]
        regs = [r for r in self.registrations.values() if r.created < cutoff and r.transfer_id not in self.accepted]
        for o in offers:
            del self.offers[o.transfer_id]
            self.closed[o.transfer_id] = now
        for r in regs:
            del self.registrations[r.transfer_id]
            self.closed[r.transfer_id] = now
        self.dropped["expired_offer"] += len(offers)
        self.dropped["expired_registration"] += len(regs)
        forget = now - 10 * self.timeout_s
        for tid in [t for t, at in self.closed.items() if at < forget]:
            del self.closed[tid]
            self.aborted.pop(tid, None)
            self.matched.discard(tid)
        return offers, regs

    def next_deadline(self) -> float | None:
        created = [o.created for o in self.offers.values()] + [
            r.created for r in self.registrations.values() if r.transfer_id not in self.accepted]
        return min(created) + self.timeout_s if created else None


def _tokens(prompt: PromptIdentity | None) -> str:
    return "unknown" if prompt is None else f"{prompt.tokens} tokens, digest {prompt.digest[:12]}"


@dataclass(frozen=True)
class Pending:
    """D's side of a transfer, from registration until an outcome."""

    transfer_id: str
    req_id: str
    peer_engine: str
    block_ids: tuple[int, ...]
    created: float
    expected_bytes: int | None = None  # what P's DONE must report for these blocks; None: not checked
    # the connection to P (numbered per prefill rank, from 1) its REGISTER went out on; 0: not yet,
    # so nothing of it can land
    generation: int = 0


@dataclass(frozen=True)
class Outcome:
    pending: Pending
    ok: bool
    reason: str = ""
    num_bytes: int = 0
    # a failure while P may still write into the blocks (D gave up on a silent P, a landing or an
    # acceptance was overdue, or P's own FAIL said a WRITE was still copying): the blocks stay out
    # of vLLM's hands until the transfer's fence ends (fences.py)
    may_still_land: bool = False


@dataclass
class ConsumerState:
    """A registration expires only while P has not ACCEPTED it: once P holds the request, only
    P's DONE/FAIL or the connection's loss end it (P bounds its own side). Messages about a part
    count only from the connection its REGISTER went out on."""

    timeout_s: float
    accepted_timeout_s: float = 300.0  # safety net for a P that accepted and then sent nothing
    pending: dict[str, Pending] = field(default_factory=dict)
    accepted: dict[str, float] = field(default_factory=dict)  # transfer id -> when P accepted
    # transfers P streams (STREAMING seen, no outcome yet) -> indices of regions that have landed
    landing: dict[str, set[int]] = field(default_factory=dict)
    fences: Fences = field(default_factory=Fences)
    dropped: Counter = field(default_factory=Counter)

    def add(self, pending: Pending) -> bool:
        if pending.transfer_id in self.pending:
            self.dropped["duplicate_registration"] += 1
            return False
        self.pending[pending.transfer_id] = pending
        return True

    def sent(self, transfer_id: str, generation: int) -> bool:
        """Its REGISTER goes out on that connection now; False if the transfer already ended (then
        it must not go out: P would write into blocks vLLM may have back)."""
        p = self.pending.get(transfer_id)
        if p is None:
            return False
        self.pending[transfer_id] = replace(p, generation=generation)
        return True

    def accept(self, transfer_id: str, peer_engine: str, now: float, generation: int = 0) -> bool:
        if self._mine(transfer_id, peer_engine, generation, "accepted") is None:
            return False
        self.accepted.setdefault(transfer_id, now)
        return True

    def streaming(self, transfer_id: str, peer_engine: str, generation: int = 0) -> Pending | None:
        """P started a streamed WRITE; returns the transfer, once (None if unknown or repeated)."""
        p = self._mine(transfer_id, peer_engine, generation, "streaming")
        if p is not None and transfer_id in self.landing:
            self.dropped["duplicate_streaming"] += 1
            return None
        if p is None:
            return None
        self.landing[transfer_id] = set()
        return p

    def landed(self, transfer_id: str, peer_engine: str, regions: tuple[int, ...], num_regions: int,
               generation: int = 0) -> bool:
        p = self._mine(transfer_id, peer_engine, generation, "landed")
        landed = self.landing.get(transfer_id)
        if p is None:
            return False
        if landed is None:
            self.dropped["unknown_landed"] += 1
            return False
        if any(r >= num_regions for r in regions):
            self.dropped["bad_landed"] += 1
            return False
        landed.update(regions)
        return True

    def has_landed(self, transfer_id: str, regions: tuple[int, ...]) -> bool:
        """Those regions hold their bytes, or the transfer is over (its outcome says how)."""
        landed = self.landing.get(transfer_id)
        return landed is None or landed.issuperset(regions)

    def done(self, transfer_id: str, peer_engine: str, num_bytes: int, generation: int = 0,
             now: float = 0.0) -> Outcome | None:
        """P wrote the blocks, and has nothing more in flight for them; a DONE that does not
        account for every byte registered is a failure."""
        p = self._mine(transfer_id, peer_engine, generation, "done", fenced_ok=True)
        if p is None:
            return None
        if p.expected_bytes is not None and num_bytes != p.expected_bytes:
            self.dropped["bad_done"] += 1
            return self._ended(
                p,
                now,
                False,
                f"{peer_engine} reported {num_bytes} bytes written, but these blocks take {p.expected_bytes}",
                num_bytes,
            )
        return self._ended(p, now, True, num_bytes=num_bytes)

    def fail(self, transfer_id: str, peer_engine: str, reason: str, may_still_land: bool = False,
             generation: int = 0, now: float = 0.0) -> Outcome | None:
        """P's FAIL; `may_still_land`: P gave up on a WRITE still copying (QUIESCED follows)."""
        p = self._mine(transfer_id, peer_engine, generation, "fail", fenced_ok=not may_still_land)
        return self._ended(p, now, False, reason, may_still_land=may_still_land) if p else None

    def quiesced(self, transfer_id: str, peer_engine: str, generation: int) -> bool:
        """Every WRITE P posted for this part has ended."""
        if self.fences.word(transfer_id, peer_engine, generation):
            return True
        self.dropped["unknown_quiesced"] += 1
        return False

    def give_up(self, transfer_id: str, reason: str, now: float) -> Outcome | None:
        """D fails the part by itself while P may still be writing it (a landing overdue)."""
        p = self.pending.get(transfer_id)
        return self._ended(p, now, False, reason, may_still_land=True) if p else None

    def _mine(self, transfer_id: str, peer_engine: str, generation: int, what: str,
              fenced_ok: bool = False) -> Pending | None:
        """The pending part a message from this P connection is about. A part given up on that is
        fenced takes P's final word (`fenced_ok`: DONE, or a FAIL that says nothing can land) as
        the end of its fence instead."""
        p = self.pending.get(transfer_id)
        if p is not None and p.peer_engine == peer_engine and p.generation == generation:
            return p
        if p is None and fenced_ok and self.fences.word(transfer_id, peer_engine, generation):
            return None
        if p is None and transfer_id in self.fences and not fenced_ok:
            return None  # P's FAIL that it is still copying: its QUIESCED ends the fence
        self.dropped["stale_generation" if p is not None and p.peer_engine == peer_engine else f"unknown_{what}"] += 1
        return None

    def _forget(self, transfer_id: str) -> Pending:
        self.accepted.pop(transfer_id, None)
        self.landing.pop(transfer_id, None)
        return self.pending.pop(transfer_id)

    def _ended(self, p: Pending, now: float, ok: bool, reason: str = "", num_bytes: int = 0,
               may_still_land: bool = False) -> Outcome:
        """The part's outcome; a failure while P may still write is fenced, unless its REGISTER
        never went out or named no block (then P has nowhere to write)."""
        self._forget(p.transfer_id)
        fenced = not ok and may_still_land and p.generation > 0 and bool(p.block_ids)
        if fenced:
            self.fences.hold(p.transfer_id, p.peer_engine, p.generation, now)
        return Outcome(p, ok, reason, num_bytes, fenced)

    def peer_gone(self, peer_engine: str, reason: str, num_regions: int = 0, may_still_land: bool = False,
                  generation: int = 0, now: float = 0.0) -> list[Outcome]:
        """The transfers registered on that peer's connection `generation` (0: every one of that
        peer, e.g. its connection could not be made) fail, except a streamed one whose
        `num_regions` regions had all landed: its bytes are all there, only DONE was lost.
        `may_still_land`: the peer was given up on or its connection closed by this side, not
        seen to go away. Else that connection was closed by P's side: P's process is gone, and so
        are the fences of that connection."""
        out = []
        for p in [p for p in self.pending.values() if p.peer_engine == peer_engine and generation in (0, p.generation)]:
            landed = self.landing.get(p.transfer_id)
            complete = landed is not None and num_regions > 0 and len(landed) >= num_regions
            out.append(
                self._ended(p, now, True)
                if complete
                else self._ended(p, now, False, reason, may_still_land=may_still_land)
            )
        if not may_still_land and generation:
            self.fences.writer_gone(peer_engine, generation)
        return out

    def expire(self, now: float) -> list[Outcome]:
        out = []
        for p in list(self.pending.values()):
            accepted_at = self.accepted.get(p.transfer_id)
            if accepted_at is None and p.created < now - self.timeout_s:
                reason = f"prefill {p.peer_engine} did not accept the transfer within {self.timeout_s:g} s"
            elif accepted_at is not None and accepted_at < now - self.accepted_timeout_s:
                reason = (f"prefill {p.peer_engine} accepted the transfer but sent nothing within "
                          f"{self.accepted_timeout_s:g} s")
            else:
                continue
            out.append(self._ended(p, now, False, reason, may_still_land=True))
        return out

    def next_deadline(self) -> float | None:
        deadlines = [self.accepted[p.transfer_id] + self.accepted_timeout_s if p.transfer_id in self.accepted
                     else p.created + self.timeout_s for p in self.pending.values()]
        return min(deadlines, default=None)


def counts_since(total: Counter, counted: Counter, skip: frozenset[str] = frozenset()) -> Counter:
    """What `total` gained since `counted`, leaving out `skip`; `counted` is brought up to date."""
    new = Counter({k: v - counted[k] for k, v in total.items() if k not in skip and v > counted[k]})
    counted.update(new)
    return new
