"""A man in the middle of a live side channel, with real NIXL between real processes: frames it
forges (REGISTER, CANCEL, DONE, with no tag or a made-up one) or replays from what it saw are
refused by whichever side receives them; the connection is closed at once and counted
(bad_frame_mac), decode keeps the blocks of what was pending fenced, and real pushes on the fresh
connection decode makes next land byte-exact."""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from mitm_proxy import TO_DECODE, TO_PREFILL, MitmProxy, Session  # noqa: E402
from peer_proc import DecodeSide, PeerProcess, kv_buffer, wait_outcomes  # noqa: E402

from kvpush.connector import frame_mac, wire

NUM_BLOCKS, BLOCK_SHAPE, SEED = 64, (2, 16, 64), 17
KEY = bytes(range(32))
os.environ.update({"UCX_MODULES": "^ib", "UCX_MEM_EVENTS": "no", "NIXL_LOG_LEVEL": "WARN"})


def wait_until(predicate, what: str, timeout_s: float = 20.0) -> None:  # a bound for a loaded machine
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


class Deployment:
    """Prefill in its own process; decode here, reaching prefill only through the proxy."""

    def __init__(self):
        self.peer = PeerProcess("P.m", ["D.m"], num_blocks=NUM_BLOCKS, block_shape=BLOCK_SHAPE, seed=SEED,
                                side_channel_key=KEY.hex())
        self.proxy = MitmProxy(self.peer.port)
        self.decode = DecodeSide("D.m", "P.m", NUM_BLOCKS, BLOCK_SHAPE, key=KEY)
        self.count = 0
        self.source = kv_buffer(NUM_BLOCKS, BLOCK_SHAPE, SEED)
        self.decode_counts: dict[str, int] = {}

    def register(self, dst: list[int]) -> str:
        self.count += 1
        tid = f"t{self.count}"
        self.decode.arr[dst] = 0
        self.decode.consumer.expect(f"req-{tid}", tid, "P.m", "127.0.0.1", self.proxy.port, dst, 0, 16 * len(dst))
        self.peer.wait_registered(tid)
        return tid

    def push(self) -> Session:
        """A real push over the current connection (a fresh one if the last was closed): byte-exact."""
        rng = np.random.default_rng(self.count)
        src = [int(b) for b in rng.choice(NUM_BLOCKS, 4, replace=False)]
        dst = [int(b) for b in rng.choice(NUM_BLOCKS, 4, replace=False)]
        tid = self.register(dst)
        self.peer.send(offer=[tid, f"req-{tid}", src, "D.m"])
        [outcome] = wait_outcomes(self.decode.consumer, 1)
        assert outcome.ok, outcome.reason
        assert np.array_equal(self.decode.arr[dst], self.source[src])
        return self.proxy.sessions[-1]

    def prefill_counts(self) -> dict:
        return self.peer.status()["counters"]

    def refused(self, session: Session, side: str, count_before: int) -> None:
        """The connection was closed and the side that got the frame counted it."""
        wait_until(session.closed.is_set, "the connection with the forged frame was not closed")
        if side == "prefill":
            wait_until(lambda: self.prefill_counts().get("bad_frame_mac", 0) == count_before + 1,
                       "prefill did not count the forged frame")
        else:
            for reason, n in self.decode.consumer.take_counts().items():
                self.decode_counts[reason] = self.decode_counts.get(reason, 0) + n
            assert self.decode_counts.get("bad_frame_mac", 0) == count_before + 1, self.decode_counts
        # decode sees the close before it registers anything more (else that registration is lost with it)
        wait_until(lambda: not self.decode.consumer._conns, "decode did not see the connection close")

    def close(self) -> None:
        self.proxy.close()
        self.decode.close()
        self.peer.kill()


def tagged(msg: wire.Message) -> bytes:
    """A frame as one who lacks the key makes it: the right shape, a tag made up."""
    plain = wire.encode(msg)
    body = plain[wire.LENGTH.size:]
    return wire.LENGTH.pack(len(body) + frame_mac.TAG_BYTES) + body + os.urandom(frame_mac.TAG_BYTES)


def test_forged_and_replayed_frames_close_the_connection_and_real_pushes_go_on():
    d = Deployment()
    try:
        first = d.push()
        assert not d.prefill_counts().get("bad_frame_mac")

        # 1. a REGISTER forged into decode's stream, untagged: prefill closes; nothing is registered
        session = d.push()
        session.inject(TO_PREFILL, wire.encode(wire.Register("forged-1", (1, 2), 0, 32)))
        d.refused(session, "prefill", 0)
        assert not d.peer.proc.poll() and d.push() is not session

        # 2. a CANCEL with a made-up tag, aimed at a registration prefill holds: the registration
        # goes with the closed connection, never by the forged word
        session = d.proxy.sessions[-1]
        tid = d.register([5, 6])
        session.inject(TO_PREFILL, tagged(wire.Cancel(tid)))
        d.refused(session, "prefill", 1)
        [lost] = wait_outcomes(d.decode.consumer, 1)
        assert not lost.ok
        d.push()

        # 3. a REGISTER decode really sent on this connection, replayed into it
        session = d.proxy.sessions[-1]
        captured = [f for f in session.frames[TO_PREFILL]
                    if b'"register"' in f]  # sealed, not encrypted: its type is plain to see
        assert captured
        session.inject(TO_PREFILL, captured[-1])
        d.refused(session, "prefill", 2)
        d.push()

        # 4. a DONE forged into prefill's stream for a transfer decode waits on: decode closes,
        # the transfer fails with its blocks fenced (prefill may still write), never "done"
        session = d.proxy.sessions[-1]
        tid = d.register([20, 21])
        session.inject(TO_DECODE, tagged(wire.Done(tid, 8192)))
        d.refused(session, "decode", 0)
        [forged_done] = wait_outcomes(d.decode.consumer, 1)
        assert not forged_done.ok and forged_done.may_still_land and "MAC" in forged_done.reason, forged_done
        d.push()

        # 5. a DONE prefill really sent, replayed into the live connection while another transfer waits
        session = d.proxy.sessions[-1]
        done = [f for f in session.frames[TO_DECODE] if b'"done"' in f][-1]
        tid = d.register([30, 31])
        session.inject(TO_DECODE, done)
        d.refused(session, "decode", 1)
        [replayed] = wait_outcomes(d.decode.consumer, 1)
        assert not replayed.ok and replayed.may_still_land, replayed
        d.push()

        # 6. a frame of an earlier connection, replayed into a later one
        session = d.proxy.sessions[-1]
        session.inject(TO_PREFILL, [f for f in first.frames[TO_PREFILL] if b'"register"' in f][0])
        d.refused(session, "prefill", 3)
        d.push()

        counters = d.prefill_counts()
        print(f"prefill counters {counters}; decode counters {d.decode_counts}; "
              f"{len(d.proxy.sessions)} connections")
        assert counters.get("bad_frame_mac") == 4 and d.decode_counts.get("bad_frame_mac") == 2
        assert counters.get("sent") == 8  # every real push, and nothing the forged frames asked for
    finally:
        d.close()
