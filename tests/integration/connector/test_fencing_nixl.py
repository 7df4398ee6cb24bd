"""Fencing by evidence with real NIXL between processes: blocks a prefill may still write into come
back to decode only on prefill's word (DONE, a FAIL that nothing can land, QUIESCED once every
WRITE it posted ended) or its death; the backstop (late_write_hold_s) drops the connection, so a
prefill that resumes posts nothing, and the next transfer makes the connection and NIXL peer anew."""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from decode_proc import DecodeProcess  # noqa: E402
from peer_proc import PeerProcess, identity, kv_buffer, layer_major_buffer, view_of, wait_outcomes  # noqa: E402

from kvpush.connector.consumer import Consumer, ConsumerConfig
from kvpush.connector.layout import kv_regions
from kvpush.connector.transfer import NixlEngine

NUM_BLOCKS, BLOCK_SHAPE, SEED = 64, (2, 16, 64), 7  # 4 KiB blocks
os.environ.update({"UCX_MODULES": "^ib", "UCX_MEM_EVENTS": "no", "NIXL_LOG_LEVEL": "WARN"})


def process_state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def wait_stopped(peer: PeerProcess, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while process_state(peer.proc.pid) != "T":
        assert time.monotonic() < deadline, "prefill did not stop itself where the test asked"
        time.sleep(0.01)


def wait_unfenced(consumer: Consumer, timeout_s: float) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        _, _, unfenced = consumer.take()
        if unfenced:
            return unfenced
        time.sleep(0.005)
    return []


def wait_record(peer: PeerProcess, timeout_s: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        records = peer.status()["records"]
        if records:
            return records[0]
        time.sleep(0.02)
    raise AssertionError("prefill recorded no outcome of its push")


class DecodeHere:
    """The decode side in this process: a zeroed layer-major buffer (`layers` > 0) or a plain one."""

    def __init__(self, engine_id: str, prefill: str, layers: int = 0, **config):
        if layers:
            self.arr = layer_major_buffer(NUM_BLOCKS, layers, BLOCK_SHAPE, None)
            regions = kv_regions([view_of(layer) for layer in self.arr], NUM_BLOCKS)
        else:
            self.arr = kv_buffer(NUM_BLOCKS, BLOCK_SHAPE, None)
            regions = kv_regions([view_of(self.arr)], NUM_BLOCKS)
        self.engine = NixlEngine(engine_id, regions)
        self.consumer = Consumer(ConsumerConfig(engine_id, 0, identity(self.arr, layers=layers), frozenset({prefill}),
                                                **config), self.engine.name, self.engine.metadata, tuple(regions))

    def blocks(self, ids: list[int]) -> np.ndarray:
        """A copy of those blocks (every layer's)."""
        return self.arr[:, ids] if self.arr.ndim == 5 else self.arr[ids]

    def zero(self, ids: list[int]) -> None:
        if self.arr.ndim == 5:
            self.arr[:, ids] = 0
        else:
            self.arr[ids] = 0

    def close(self) -> None:
        self.consumer.close()
        self.engine.close()


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
def test_a_prefill_given_up_on_for_silence_ends_the_hold_with_its_word_and_nothing_lands_after(streamed):
    """Prefill stops (SIGSTOP) with a push matched (or, streamed, mid-way through its layers).
    Decode gives up on it for silence, fails the request and holds the blocks, keeping the
    connection and cancelling the transfer. Once prefill resumes, its answer (FAIL cancelled, or
    DONE if it wrote on before it read the CANCEL) ends the hold: nothing lands after that, so
    vLLM may reuse the blocks."""
    layers = 16 if streamed else 0
    decode = DecodeHere("D.f", "P.f", layers, timeout_s=30.0, peer_silence_s=1.0, late_write_hold_s=600.0)
    stop = {"stop_before_post": 4, "stream_writes": True, "layer_major": True, "layers": layers,
            "stream_drive_s": 30.0} if streamed else {"stop_before_write": True}
    peer = PeerProcess("P.f", ["D.f"], num_blocks=NUM_BLOCKS, block_shape=BLOCK_SHAPE, seed=SEED, **stop)
    blocks = list(range(8, 40))
    try:
        decode.consumer.expect("rq", "t-resume", "P.f", "127.0.0.1", peer.port, blocks, 0, 16 * len(blocks))
        peer.wait_registered("t-resume")
        peer.send(offer=["t-resume", "pr", blocks, "D.f"])
        wait_stopped(peer)
        [outcome] = wait_outcomes(decode.consumer, 1, timeout_s=20.0)
        assert not outcome.ok and "no answer" in outcome.reason and outcome.may_still_land
        time.sleep(0.5)
        assert decode.consumer.take()[2] == []  # no timer frees them while prefill is stopped
        os.kill(peer.proc.pid, signal.SIGCONT)
        assert wait_unfenced(decode.consumer, 20.0) == ["t-resume"]  # prefill's own word
        decode.zero(blocks)  # vLLM hands the blocks to another request
        time.sleep(0.5)
        record = wait_record(peer)
        print(f"\nprefill resumed and answered: ok={record['ok']} {record['reason']!r}")
        assert not decode.blocks(blocks).any(), "prefill wrote into the blocks after it said it was done"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(peer.proc.pid, signal.SIGCONT)
        peer.kill()
        decode.close()


def test_quiesced_ends_the_hold_of_a_write_prefill_gave_up_on():
    """Decode stopped (SIGSTOP) before the first WRITE into it: the WRITE cannot end while decode
    does not run, so prefill fails it at its deadline saying it may still land, and keeps polling
    its handle instead of releasing it. Decode resumes, the WRITE lands, prefill says QUIESCED,
    and only that ends decode's hold on the blocks."""
    decode = DecodeProcess("D.q", ["P.q"], num_blocks=NUM_BLOCKS, block_shape=BLOCK_SHAPE, late_write_hold_s=600.0)
    peer = PeerProcess("P.q", ["D.q"], num_blocks=NUM_BLOCKS, block_shape=BLOCK_SHAPE, seed=SEED, timeout_s=0.5)
    src, dst = [1, 2, 3], [20, 21, 22]
    try:
        peer.send(accept=["t-q"])  # P holds the request: neither side expires the registration
        decode.ask(expect=["rq", "t-q", "P.q", "127.0.0.1", peer.port, dst, 0, 48])
        peer.wait_registered("t-q")
        os.kill(decode.proc.pid, signal.SIGSTOP)
        peer.send(offer=["t-q", "pr", src, "D.q"])
        record = wait_record(peer)
        assert not record["ok"] and "still copying 0.5 s after it was posted" in record["reason"]
        os.kill(decode.proc.pid, signal.SIGCONT)
        got = decode.wait_taken({}, lambda g: g.get("unfenced"))
        [outcome] = got["outcomes"]
        assert not outcome["ok"] and outcome["may_still_land"] and got["unfenced"] == ["t-q"]
        expected = kv_buffer(NUM_BLOCKS, BLOCK_SHAPE, SEED)[src]
        assert decode.ask(blocks=dst)["hex"] == expected.tobytes().hex()  # the late WRITE did land, before QUIESCED
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(decode.proc.pid, signal.SIGCONT)
        peer.kill()
        decode.kill()


def test_the_backstop_drops_the_connection_a_resumed_prefill_posts_nothing_and_the_peer_is_made_anew():
    """Prefill stops with a push matched and never answers. After late_write_hold_s decode drops its
    connection (counted) and lets the blocks go. Prefill, resumed, sees the close before posting
    anything; the next transfer makes a new connection, on which prefill makes decode its NIXL
    peer anew, and lands byte-exact."""
    decode = DecodeHere("D.b", "P.b", timeout_s=30.0, peer_silence_s=1.0, late_write_hold_s=2.0)
    peer = PeerProcess("P.b", ["D.b"], num_blocks=NUM_BLOCKS, block_shape=BLOCK_SHAPE, seed=SEED, stop_before_write=True)
    expected = kv_buffer(NUM_BLOCKS, BLOCK_SHAPE, SEED)
    try:
        decode.consumer.expect("rq", "t-b1", "P.b", "127.0.0.1", peer.port, [10, 11], 0, 32)
        peer.wait_registered("t-b1")
        peer.send(offer=["t-b1", "pr", [1, 2], "D.b"])
        wait_stopped(peer)
        [outcome] = wait_outcomes(decode.consumer, 1, timeout_s=20.0)
        assert outcome.may_still_land
        given_up = time.monotonic()
        assert wait_unfenced(decode.consumer, 20.0) == ["t-b1"]
        assert time.monotonic() - given_up >= 1.5  # the backstop, late_write_hold_s after the give-up
        assert decode.consumer.take_counts()["late_write_backstop"] == 1
        os.kill(peer.proc.pid, signal.SIGCONT)
        record = wait_record(peer)
        assert not record["ok"] and "disconnected before the WRITE" in record["reason"]
        time.sleep(0.3)
        assert not decode.arr[[10, 11]].any()  # nothing was written after the backstop
        decode.consumer.expect("rq2", "t-b2", "P.b", "127.0.0.1", peer.port, [30, 31], 0, 32)
        peer.wait_registered("t-b2")
        peer.send(offer=["t-b2", "pr2", [5, 6], "D.b"])
        [outcome] = wait_outcomes(decode.consumer, 1)
        assert outcome.ok and np.array_equal(decode.arr[[30, 31]], expected[[5, 6]])
        assert peer.status()["peers_added"] == 2  # a new handshake made decode its NIXL peer anew
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(peer.proc.pid, signal.SIGCONT)
        peer.kill()
        decode.close()
