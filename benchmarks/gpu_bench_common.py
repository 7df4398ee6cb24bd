"""What the GPU transfer benchmarks share (gpu_transfer.py, gpu_tp_fanout.py, gpu_wait_for_save.py):
kvpush's connector importable from this checkout, the device's memory type and synchronisation,
child processes driven over a pipe, the environment line, a plain copy's time, block id patterns,
the layout identity both sides compare, and PASS/MISS.

Importing it makes `kvpush.connector` importable: installed, or straight from this checkout (the
GPU host has no kvpush install: `kvpush` becomes a namespace whose `connector` is the repo's
connector/).
"""
from __future__ import annotations

import os
import statistics
import sys
import time
import traceback
from pathlib import Path

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

import numpy as np  # noqa: E402
import torch  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


def _make_connector_importable() -> None:
    try:
        import kvpush.connector.transfer  # noqa: F401
    except ImportError:
        import types

        for name in [m for m in sys.modules if m == "kvpush" or m.startswith("kvpush.")]:
            del sys.modules[name]
        pkg = types.ModuleType("kvpush")
        pkg.__path__ = [str(REPO)]
        sys.modules["kvpush"] = pkg


_make_connector_importable()
sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_kv_layouts as kvl  # noqa: E402
from kvpush.connector.regions import LayoutIdentity  # noqa: E402


# ---- the device -----------------------------------------------------------------------------------
def mem_type(device: str) -> str:
    return "VRAM" if device.startswith("cuda") else "DRAM"


def device_id(device: str) -> int:
    return torch.device(device).index or 0 if device.startswith("cuda") else 0


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def empty_cache(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def describe_environment(device: str) -> None:
    from importlib import metadata

    versions = []
    for dist in ("nixl", "nixl-cu13", "nixl-cu12"):
        try:
            versions.append(f"{dist} {metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            pass
    where = torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") else "CPU (DRAM)"
    print(f"device: {where}; torch {torch.__version__}; {', '.join(versions) or 'nixl version unknown'}; "
          f"UCX_TLS={os.environ.get('UCX_TLS', '(default)')}", flush=True)


def copy_seconds(device: str, src: torch.Tensor, dst: torch.Tensor, nbytes: int, repeats: int = 5) -> float:
    """Median time of a plain copy of nbytes (the device's own ceiling for moving these bytes)."""
    a, b = src[:nbytes], dst[:nbytes]
    times = []
    for i in range(repeats + 1):
        if device.startswith("cuda"):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            b.copy_(a)
            end.record()
            end.synchronize()
            seconds = start.elapsed_time(end) / 1e3
        else:
            t0 = time.perf_counter()
            b.copy_(a)
            seconds = time.perf_counter() - t0
        if i:  # the first one warms up
            times.append(seconds)
    return statistics.median(times)


# ---- child processes ------------------------------------------------------------------------------
class ChildProcess:
    """A spawned process running `target(conn, *args)`, driven over a pipe: each request is a
    tuple whose first item names it, each answer likewise ("error", traceback) on failure."""

    def __init__(self, name: str, target, *args):
        import multiprocessing as mp

        ctx = mp.get_context("spawn")  # CUDA cannot be used in a forked child
        self.name = name
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=target, args=(child, *args), daemon=True)
        self.proc.start()
        child.close()

    def call(self, *msg, timeout_s: float = 300.0):
        self.send(*msg)
        return self.answer(msg[0], timeout_s)

    def send(self, *msg) -> None:
        self.conn.send(msg)

    def answer(self, what: str, timeout_s: float = 300.0):
        """The answer to the request `what` sent last (raises on an error or no answer in time)."""
        if not self.conn.poll(timeout_s):
            raise RuntimeError(f"{self.name} did not answer {what!r} within {timeout_s:.0f} s")
        reply = self.conn.recv()
        if reply[0] == "error":
            raise RuntimeError(f"{self.name} failed on {what!r}:\n{reply[1]}")
        return reply

    def close(self) -> None:
        try:
            if self.proc.is_alive():
                self.conn.send(("exit",))
        except (BrokenPipeError, OSError):
            pass
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()


def serve(conn, handlers: dict, cleanup) -> None:
    """The child's side of ChildProcess: answer requests until "exit", each with what its handler
    returns for the request's other items (a failure answers ("error", traceback)); then cleanup()."""
    try:
        while True:
            msg = conn.recv()
            if msg[0] == "exit":
                break
            try:
                handler = handlers.get(msg[0])
                conn.send(handler(*msg[1:]) if handler else ("error", f"unknown request {msg[0]!r}"))
            except Exception:
                conn.send(("error", traceback.format_exc()))
    finally:
        cleanup()


# ---- what a push moves ----------------------------------------------------------------------------
def layer_names(num_layers: int) -> list[str]:
    return [f"layer{i}" for i in range(num_layers)]


def layout_identity(shape: "kvl.Shape", model_kv_heads: int = 1) -> LayoutIdentity:
    """What both sides' push services compare at handshake (layer names sorted, as the connector's
    worker lists vLLM's)."""
    return LayoutIdentity("bench-model", str(shape.dtype).removeprefix("torch."), shape.block_size,
                          tuple(sorted(layer_names(shape.num_layers))), model_kv_heads)


def contiguous_ids(rng: np.random.Generator, num_blocks: int, n: int) -> np.ndarray:
    start = int(rng.integers(0, num_blocks - n + 1))
    return np.arange(start, start + n, dtype=np.int64)


def fragmented_ids(rng: np.random.Generator, num_blocks: int, n: int, max_run: int) -> np.ndarray:
    """n distinct ids made of runs of 1..max_run consecutive blocks, in shuffled order, as a block
    pool that has seen many allocations and frees hands them out."""
    cuts, pos = [0], 0
    while pos < num_blocks:
        pos = min(num_blocks, pos + int(rng.integers(1, max_run + 1)))
        cuts.append(pos)
    runs = [np.arange(a, b) for a, b in zip(cuts[:-1], cuts[1:])]
    order = rng.permutation(len(runs))
    ids = np.concatenate([runs[i] for i in order])[:n]
    return ids.astype(np.int64)


def pass_fail(ok: bool) -> str:
    return "PASS" if ok else "MISS"
