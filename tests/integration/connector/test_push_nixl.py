"""Two processes, real NIXL (UCX on CPU memory): a prefill-side Producer in a child process pushes
random non-contiguous block sets into this process's Consumer buffers, byte-exact; a dead or
refusing peer turns into a failure outcome fast."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from peer_proc import (PeerProcess, identity, kv_buffer, layer_major_buffer, layer_views, view_of,  # noqa: E402
                       wait_outcomes)

from kvpush.connector import wire
from kvpush.connector.consumer import Consumer, ConsumerConfig
from kvpush.connector.layout import kv_regions
from kvpush.connector.transfer import NixlEngine

NUM_BLOCKS, BLOCK_SHAPE, SEED = 64, (2, 16, 64), 7  # 4 KiB blocks
os.environ.update({"UCX_MODULES": "^ib", "UCX_MEM_EVENTS": "no", "NIXL_LOG_LEVEL": "WARN"})


@pytest.fixture(scope="module")
def decode_side():
    arr = kv_buffer(NUM_BLOCKS, BLOCK_SHAPE, None)
    regions = kv_regions([view_of(arr)], NUM_BLOCKS)
    engine = NixlEngine("D.test", regions)
    consumer = Consumer(ConsumerConfig("D.test", 0, identity(arr), frozenset({"P.test", "P.other", "P.badmodel"}), timeout_s=3.0),
                        engine.name, engine.metadata, tuple(regions))
    yield arr, consumer
    consumer.close()
    engine.close()


@pytest.fixture(scope="module")
def producer_proc():
    peer = PeerProcess("P.test", ["D.test"], num_blocks=NUM_BLOCKS, block_shape=BLOCK_SHAPE, seed=SEED)
    yield peer
    peer.kill()


@pytest.mark.parametrize("register_first", [True, False])
def test_random_block_sets_arrive_byte_exact(decode_side, producer_proc, register_first):
    arr, consumer = decode_side
    expected = kv_buffer(NUM_BLOCKS, BLOCK_SHAPE, SEED)
    rng = np.random.default_rng(1 if register_first else 2)
    for round_ in range(5):
        n = int(rng.integers(1, 20))
        src = [int(b) for b in rng.choice(NUM_BLOCKS, n, replace=False)]
        dst = [int(b) for b in rng.choice(NUM_BLOCKS, n, replace=False)]
        first = int(rng.integers(0, 2)) if n > 1 else 0
        tid = f"t-{register_first}-{round_}"
        arr[dst[first:]] = 0
        if register_first:
            consumer.expect("rq", tid, "P.test", "127.0.0.1", producer_proc.port, dst[first:], first, 16 * n)
            time.sleep(0.05)
            producer_proc.send(offer=[tid, "pr", src, "D.test"])
        else:
            producer_proc.send(offer=[tid, "pr", src, "D.test"])
            time.sleep(0.05)
            consumer.expect("rq", tid, "P.test", "127.0.0.1", producer_proc.port, dst[first:], first, 16 * n)
        [outcome] = wait_outcomes(consumer, 1)
        assert outcome.ok, outcome.reason
        assert outcome.num_bytes == (n - first) * arr[0].nbytes
        assert np.array_equal(arr[dst[first:]], expected[src[first:]])
    status = producer_proc.status()
    assert status["freed"] == ["pr"] * 5
    assert all(r["ok"] for r in status["records"])


def test_abort_on_prefill_reaches_decode(decode_side, producer_proc):
    _, consumer = decode_side
    producer_proc.send(abort=["t-abort", "prefill request aborted"])
    consumer.expect("rq", "t-abort", "P.test", "127.0.0.1", producer_proc.port, [1, 2], 0, 32)
    [outcome] = wait_outcomes(consumer, 1)
    assert not outcome.ok and "aborted" in outcome.reason


def test_handshake_mismatch_names_both_values(decode_side):
    _, consumer = decode_side
    peer = PeerProcess("P.badmodel", ["D.test"], num_blocks=NUM_BLOCKS, block_shape=BLOCK_SHAPE, seed=SEED, model="other-model")
    try:
        consumer.expect("rq", "t-mismatch", "P.badmodel", "127.0.0.1", peer.port, [3], 0, 16)
        [outcome] = wait_outcomes(consumer, 1)
        assert not outcome.ok
        assert "'other-model'" in outcome.reason and "'test-model'" in outcome.reason
    finally:
        peer.kill()


def test_engine_not_in_allowlist_is_refused(decode_side):
    _, consumer = decode_side
    peer = PeerProcess("P.other", ["D.somebody-else"], num_blocks=NUM_BLOCKS, block_shape=BLOCK_SHAPE, seed=SEED)
    try:
        consumer.expect("rq", "t-allow", "P.other", "127.0.0.1", peer.port, [3], 0, 16)
        [outcome] = wait_outcomes(consumer, 1)
        assert not outcome.ok and "allowed_engines" in outcome.reason
        assert peer.status()["counters"]["refused_handshake"] == 1
    finally:
        peer.kill()


def test_dead_peer_fails_fast_not_hang(decode_side):
    _, consumer = decode_side
    peer = PeerProcess("P.other", ["D.test"], num_blocks=NUM_BLOCKS, block_shape=BLOCK_SHAPE, seed=SEED)
    consumer.expect("rq", "t-dead", "P.other", "127.0.0.1", peer.port, [4, 5], 0, 32)
    peer.wait_registered("t-dead")  # and waiting for P's prefill
    killed = time.monotonic()
    peer.kill()
    # Sooner than decode's own 3 s no-show timeout: the closed connection, not the clock, failed it.
    [outcome] = wait_outcomes(consumer, 1, timeout_s=2.5)
    latency = time.monotonic() - killed
    print(f"\ndead peer -> failure outcome in {latency * 1000:.1f} ms: {outcome.reason}")
    assert not outcome.ok and "within" not in outcome.reason
    assert not outcome.may_still_land  # a dead process writes nothing more: its blocks are free at once
    # and a peer that is not there at all fails at once too
    consumer.expect("rq", "t-nobody", "P.other", "127.0.0.1", peer.port, [6], 0, 16)
    [outcome] = wait_outcomes(consumer, 1, timeout_s=2.5)
    assert not outcome.ok and "within" not in outcome.reason


def test_hung_peer_holding_an_accepted_transfer_fails_fast(decode_side):
    """A stopped P keeps its connection open (no FIN, no RST): D's pings notice it within ~1 s,
    where nothing else would end an accepted transfer for minutes."""
    _, consumer = decode_side
    peer = PeerProcess("P.other", ["D.test"], num_blocks=NUM_BLOCKS, block_shape=BLOCK_SHAPE, seed=SEED)
    try:
        peer.send(accept=["t-hung"])
        consumer.expect("rq", "t-hung", "P.other", "127.0.0.1", peer.port, [11, 12], 0, 32)
        assert wait_outcomes(consumer, 1, timeout_s=1.5) == []  # P answers pings: alive, nothing fails
        stopped = time.monotonic()
        os.kill(peer.proc.pid, signal.SIGSTOP)
        # Seconds, not the 300 s an accepted transfer may otherwise wait: the unanswered pings ended it.
        [outcome] = wait_outcomes(consumer, 1, timeout_s=10.0)
        latency = time.monotonic() - stopped
        print(f"\nhung peer -> failure outcome in {latency * 1000:.0f} ms: {outcome.reason}")
        assert not outcome.ok and "no answer" in outcome.reason
    finally:
        os.kill(peer.proc.pid, signal.SIGCONT)
        peer.kill()


def test_unmatched_registration_expires(decode_side, producer_proc):
    _, consumer = decode_side
    consumer.expect("rq", "t-never", "P.test", "127.0.0.1", producer_proc.port, [7], 0, 16)
    [outcome] = wait_outcomes(consumer, 1, timeout_s=6.0)
    assert not outcome.ok and "within" in outcome.reason


def _stat_fields(pid: int) -> list[str]:
    """/proc/PID/stat's fields after the command name (the state is the first)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def cpu_seconds(pid: int) -> float:
    fields = _stat_fields(pid)
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wakeups(pid: int) -> int:
    """Context switches of all the process's threads so far: each sleep that ends is one."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            total += sum(int(line.split()[1]) for line in (task / "status").read_text().splitlines()
                         if line.startswith(("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")))
    return total


def test_idle_peer_does_not_spin(decode_side, producer_proc):
    """NIXL's default progress thread would burn a whole core; ours sleeps between rounds, and on
    CPU for long enough that it hardly ever takes the core from the compute thread."""
    pid = producer_proc.proc.pid
    cpu_before, wakeups_before = cpu_seconds(pid), wakeups(pid)
    time.sleep(2.0)
    used, woke = cpu_seconds(pid) - cpu_before, wakeups(pid) - wakeups_before
    print(f"\nidle producer process: {used / 2.0 * 100:.1f}% of a core, {woke / 2.0:.0f} wake-ups/s")
    assert used < 0.4  # < 20% of one core, even on a loaded machine
    assert woke / 2.0 < 100  # 20/s with the CPU default (50 ms); a 100 us pause woke it ~900 times/s


def test_accepted_transfer_outlives_the_no_show_timeout(decode_side):
    """P has the request queued (ACCEPTED): neither side expires it while P is busy."""
    arr, consumer = decode_side
    peer = PeerProcess("P.other", ["D.test"], num_blocks=NUM_BLOCKS, block_shape=BLOCK_SHAPE, seed=SEED, timeout_s=1.0)
    try:
        peer.send(accept=["t-slow"])
        consumer.expect("rq", "t-slow", "P.other", "127.0.0.1", peer.port, [9, 10], 0, 32)
        assert wait_outcomes(consumer, 1, timeout_s=4.0) == []  # D's own timeout is 3 s, P's 1 s
        peer.send(offer=["t-slow", "pr", [1, 2], "D.test"])
        [outcome] = wait_outcomes(consumer, 1)
        assert outcome.ok
        assert np.array_equal(arr[[9, 10]], kv_buffer(NUM_BLOCKS, BLOCK_SHAPE, SEED)[[1, 2]])
    finally:
        peer.kill()


LAYERS, LAYER_SHAPE = 4, (2, 8, 32)  # block-major [blocks, layers, 512 B]: vLLM's BLHNC on a GPU


def test_block_major_layers_go_as_one_descriptor_per_run_made_ahead():
    """The connector's path end to end: D registers, P makes the WRITE before its prefill ends
    (prepare, as the GPU worker does while the forward runs), offer posts it. All layers of a run of
    blocks are one range on both sides, so a run is one descriptor; every layer's bytes arrive."""
    shape = (LAYERS, *LAYER_SHAPE)
    arr = kv_buffer(NUM_BLOCKS, shape, None)
    regions = kv_regions(layer_views(arr, LAYERS), NUM_BLOCKS)
    engine = NixlEngine("D.layers", regions)
    consumer = Consumer(ConsumerConfig("D.layers", 0, identity(arr, layers=LAYERS), frozenset({"P.layers"}), timeout_s=5.0),
                        engine.name, engine.metadata, tuple(regions))
    peer = PeerProcess("P.layers", ["D.layers"], num_blocks=NUM_BLOCKS, block_shape=shape, seed=SEED, layers=LAYERS)
    expected = kv_buffer(NUM_BLOCKS, shape, SEED)
    cases = [("contiguous", list(range(10, 20)), list(range(30, 40)), 1),
             ("two-runs", [1, 2, 3, 20, 21], [5, 6, 7, 40, 41], 2),
             ("scattered", [50, 8, 60], [2, 12, 22], 3)]
    try:
        for tid, src, dst, runs in cases:
            arr[dst] = 0
            consumer.expect("rq", tid, "P.layers", "127.0.0.1", peer.port, dst, 0, 16 * len(dst))
            peer.wait_registered(tid)
            peer.send(prepare=[tid, src, "D.layers"])
            assert json.loads(peer.proc.stdout.readline())["prepared"], tid
            peer.send(offer=[tid, "pr", src, "D.layers"])
            [outcome] = wait_outcomes(consumer, 1)
            assert outcome.ok, outcome.reason
            assert np.array_equal(arr[dst], expected[src]), tid
            [record] = peer.status()["records"]
            assert record["ok"] and record["prepared_ahead"], record
            assert record["num_descriptors"] == runs, (tid, record["num_descriptors"])
            assert record["num_bytes"] == len(src) * LAYERS * int(np.prod(LAYER_SHAPE))
    finally:
        peer.kill()
        consumer.close()
        engine.close()


def test_waiting_for_an_outcome_wakes_when_the_write_lands(decode_side, producer_proc):
    """Decode's idle step sleeps in wait_for_outcome: P's DONE must end that sleep, not its timeout."""
    arr, consumer = decode_side
    consumer.take()  # what earlier tests left (fences they ended): the worker takes it every step
    consumer.wait_for_outcome(5.0)  # nothing pending: returns at once
    consumer.expect("rq", "t-wake", "P.test", "127.0.0.1", producer_proc.port, [9, 10], 0, 32)
    time.sleep(0.05)
    producer_proc.send(offer=["t-wake", "pr-wake", [1, 2], "D.test"])
    started = time.monotonic()
    consumer.wait_for_outcome(5.0)
    woke_after = time.monotonic() - started
    [outcome] = consumer.take_outcomes()
    assert outcome.ok and outcome.pending.transfer_id == "t-wake" and woke_after < 2.5


def test_streamed_write_lands_layer_by_layer_and_d_hears_of_it_first():
    """P on CPU with stream_writes: D hears STREAMING before any byte, one LANDED per layer, then
    DONE; a wait for a layer's regions returns; every layer's bytes arrive exactly."""
    layer_shape = (2, 8, 32)
    arr = layer_major_buffer(NUM_BLOCKS, LAYERS, layer_shape, None)
    regions = kv_regions([view_of(layer) for layer in arr], NUM_BLOCKS)
    engine = NixlEngine("D.stream", regions)
    consumer = Consumer(ConsumerConfig("D.stream", 0, identity(arr, layers=LAYERS), frozenset({"P.stream"}), timeout_s=5.0),
                        engine.name, engine.metadata, tuple(regions))
    peer = PeerProcess("P.stream", ["D.stream"], num_blocks=NUM_BLOCKS, block_shape=layer_shape, seed=SEED,
                       layers=LAYERS, layer_major=True, stream_writes=True, stream_drive_s=30.0)
    expected = layer_major_buffer(NUM_BLOCKS, LAYERS, layer_shape, SEED)
    src, dst = [3, 4, 5, 40, 41], [20, 21, 22, 9, 10]
    try:
        consumer.expect("rq", "t-stream", "P.stream", "127.0.0.1", peer.port, dst, 0, 16 * len(dst))
        peer.wait_registered("t-stream")  # registered before the prefill ends, as in push mode
        peer.send(offer=["t-stream", "pr", src, "D.stream"])
        consumer.wait_landed(["t-stream"], (LAYERS - 1,), timeout_s=5.0)
        [outcome] = wait_outcomes(consumer, 1)
        assert outcome.ok, outcome.reason
        [started], _, _ = consumer.take()
        assert started.transfer_id == "t-stream" and consumer.counters["landed_parts"] == LAYERS
        assert np.array_equal(arr[:, dst], expected[:, src])
        [record] = peer.status()["records"]
        assert record["ok"] and record["num_descriptors"] == 2 * LAYERS  # two runs per layer
        assert record["num_bytes"] == outcome.num_bytes == len(src) * LAYERS * int(np.prod(layer_shape))
    finally:
        peer.kill()
        consumer.close()
        engine.close()


def test_a_wait_for_landing_kv_ends_when_the_peer_dies_mid_stream(decode_side):
    """A stand-in P that announces a streamed WRITE and then dies: D's compute thread, waiting for a
    layer, is released by the lost connection and the transfer fails; nothing waits out a timeout."""
    _, consumer = decode_side
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]

    def fake_prefill():
        conn, _ = server.accept()
        reader = wire.FrameReader()
        while True:
            messages = [wire.decode(body) for body in reader.feed(conn.recv(65536))]
            if any(isinstance(m, wire.Register) for m in messages):
                break
        conn.sendall(wire.encode(wire.Welcome("P.other")) + wire.encode(wire.Streaming("t-mid")))
        time.sleep(0.3)
        conn.close()

    thread = threading.Thread(target=fake_prefill, daemon=True)
    thread.start()
    try:
        consumer.expect("rq", "t-mid", "P.other", "127.0.0.1", port, [13, 14], 0, 32)
        deadline = time.monotonic() + 3.0
        while not (started := consumer.take()[0]) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [p.transfer_id for p in started] == ["t-mid"]
        began = time.monotonic()
        consumer.wait_landed(["t-mid"], (0,), timeout_s=30.0)
        waited = time.monotonic() - began
        [outcome] = wait_outcomes(consumer, 1)
        assert not outcome.ok and "lost" in outcome.reason and waited < 2.0
    finally:
        thread.join(timeout=5)
        server.close()


def test_an_authenticated_side_channel_pushes_byte_exact_and_refuses_a_decode_without_the_key():
    """The deployment's key on both sides: the push lands byte-exact; a decode holding another key
    never gets a NIXL peer on prefill, and its transfer fails at the handshake."""
    key, wrong = "ab" * 32, "cd" * 32
    peer = PeerProcess("P.auth", ["D.auth", "D.wrong"], num_blocks=NUM_BLOCKS, block_shape=BLOCK_SHAPE, seed=SEED,
                       side_channel_key=key)
    expected = kv_buffer(NUM_BLOCKS, BLOCK_SHAPE, SEED)
    sides = []
    try:
        for engine_id, k in (("D.auth", key), ("D.wrong", wrong)):
            arr = kv_buffer(NUM_BLOCKS, BLOCK_SHAPE, None)
            regions = kv_regions([view_of(arr)], NUM_BLOCKS)
            engine = NixlEngine(engine_id, regions)
            consumer = Consumer(ConsumerConfig(engine_id, 0, identity(arr), frozenset({"P.auth"}), timeout_s=5.0,
                                               side_channel_key=bytes.fromhex(k)),
                                engine.name, engine.metadata, tuple(regions))
            sides.append((engine_id, arr, engine, consumer))
        (_, arr, _, good), (_, _, _, bad) = sides[0], sides[1]
        good.expect("rq", "t-auth", "P.auth", "127.0.0.1", peer.port, [3, 4, 5], 0, 48)
        bad.expect("rq", "t-wrong", "P.auth", "127.0.0.1", peer.port, [6], 0, 16)
        peer.wait_registered("t-auth")
        peer.send(offer=["t-auth", "pr", [10, 11, 12], "D.auth"])
        [outcome] = wait_outcomes(good, 1)
        assert outcome.ok and np.array_equal(arr[[3, 4, 5]], expected[[10, 11, 12]])
        [refused] = wait_outcomes(bad, 1)
        assert not refused.ok and "closed during its handshake" in refused.reason, refused.reason
        assert bad.counters["failed_auth"] == 1  # prefill's proof, made with the other key, fails on decode first
        assert peer.status()["counters"].get("sent") == 1  # nothing went to the decode without the key
    finally:
        peer.kill()
        for _, _, engine, consumer in sides:
            consumer.close()
            engine.close()
