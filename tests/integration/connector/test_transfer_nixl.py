"""The transfer engine with real NIXL (UCX) between two processes on CPU memory: the first WRITE
to a process completes only once that process has run (UCX finishes connecting then), later ones
without it. This is why the connector never spins on a WRITE: on a shared core the spin can keep
the very process it waits for from running."""
from __future__ import annotations

import multiprocessing
import os
import signal
import time

import numpy as np
import pytest

from kvpush.connector.regions import Region
from kvpush.connector.transfer import NixlEngine

os.environ.update({"UCX_MODULES": "^ib", "UCX_MEM_EVENTS": "no", "NIXL_LOG_LEVEL": "WARN"})
BLOCK, BLOCKS = 64 * 1024, 16


def decode_process(to_parent, from_parent) -> None:
    buf = np.zeros((BLOCKS, BLOCK), dtype=np.uint8)
    engine = NixlEngine("decode", [Region(buf.ctypes.data, BLOCK, BLOCK, BLOCKS)])
    to_parent.put((engine.metadata, buf.ctypes.data))
    from_parent.get()  # the parent wrote
    to_parent.put(buf[:4].tobytes())
    from_parent.get()
    engine.close()


@pytest.fixture
def decode():
    ctx = multiprocessing.get_context("spawn")
    to_parent, from_parent = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=decode_process, args=(to_parent, from_parent), daemon=True)
    proc.start()
    try:
        metadata, base = to_parent.get(timeout=60)
        yield proc, metadata, base, to_parent, from_parent
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        from_parent.put(None)
        from_parent.put(None)
        proc.join(10)
        if proc.is_alive():
            proc.kill()


def wait_done(engine: NixlEngine, write, timeout_s: float = 10.0) -> str:
    deadline = time.monotonic() + timeout_s
    while engine.state(write) == "PROC" and time.monotonic() < deadline:
        time.sleep(0.001)
    return engine.state(write)


def test_the_first_write_into_a_process_completes_only_once_it_runs_later_ones_without_it(decode):
    proc, metadata, base, to_parent, from_parent = decode
    src = np.random.default_rng(7).integers(0, 256, size=(BLOCKS, BLOCK), dtype=np.uint8)
    engine = NixlEngine("prefill", [Region(src.ctypes.data, BLOCK, BLOCK, BLOCKS)])
    try:
        peer = engine.add_peer(metadata, [Region(base, BLOCK, BLOCK, BLOCKS)])
        os.kill(proc.pid, signal.SIGSTOP)
        first = engine.write_coalesced(peer, [0, 1], [0, 1])
        stopped_until = time.monotonic() + 1.0
        while time.monotonic() < stopped_until:
            assert engine.state(first) == "PROC"  # decode cannot run: the first WRITE cannot end
            time.sleep(0.005)
        os.kill(proc.pid, signal.SIGCONT)
        assert wait_done(engine, first) == "DONE"
        engine.release(first)

        os.kill(proc.pid, signal.SIGSTOP)
        second = engine.write_coalesced(peer, [2, 3], [2, 3])
        assert wait_done(engine, second) == "DONE"  # connected: decode need not run
        engine.release(second)
        os.kill(proc.pid, signal.SIGCONT)
        from_parent.put("written")
        assert to_parent.get(timeout=10) == src[:4].tobytes()
    finally:
        engine.close()
