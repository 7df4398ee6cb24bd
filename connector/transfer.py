"""The transfer engine over NIXL: one agent, registered KV regions, a coalescing plan per peer
(made at handshake), one WRITE per request. vLLM-free, so tests and benchmarks use it with plain
buffers.

A request's WRITE is made by `prepare_write` (descriptors: one per run of blocks adjacent on both
sides, per segment of regions adjacent on both sides; see coalesce.py) and started by `post`, so a
caller that knows both block lists early makes it ahead and only posts it when the prefill ends.
`write` is the uncoalesced baseline (one descriptor per block and region, through per-block lists
NIXL prepares on first use); the connector does not use it, benchmarks compare against it.

All agent calls go through one lock: the worker's compute thread posts WRITEs and the side
channel's thread polls them.
"""
from __future__ import annotations

import os
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np

from .coalesce import Plan, Segment
from .cuda_context import bind_device_context
from .layout import descriptor_indices, descriptor_table, region_spans
from .regions import Region

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")  # NIXL's Python logger prints INFO to stdout

# NIXL's UCX progress thread sleeps in poll() on its workers' event descriptors with this delay as
# the timeout (rounded up to whole milliseconds); the timeout only paces a sweep over everything,
# while wire-up and notification events wake the thread at once, and kvpush drives its WRITEs
# itself. On CPU a short timeout costs the compute thread beside it: 100 us woke the thread ~900
# times a second (benchmarks/notes/cpu-ttft-against-pull.md, run 16), and an idle instance used
# 0.02-0.03 cores with the long timeout against 0.040-0.050 before (benchmarks/notes/
# cpu-kv-heavy-handoff.md, "The streamed WRITE"). GPU keeps the value its transfers were measured
# with (benchmarks/notes/gpu-transfer-path.md, the runs with --progress-delay-us).
PROGRESS_DELAY_US = {"DRAM": 50_000, "VRAM": 100}  # by NIXL memory type
_create_lock = threading.Lock()


class TransferError(RuntimeError):
    """A NIXL operation failed (backend creation, registration, peer metadata, WRITE)."""


@contextmanager
def progress_thread_delay(delay_us: int) -> Iterator[None]:
    """While inside, every NIXL agent created in this process gets a progress thread that sleeps
    `delay_us` between rounds.

    nixl_agent() hard-codes the delay to 0, i.e. a progress thread spinning a whole core. The
    delay is a field of the binding's config object, which nixl_agent builds internally, so the
    config class is swapped for one whose delay setter keeps our value, only while inside.
    """
    from nixl import _api

    binding = _api.nixlBind
    base = binding.nixlAgentConfig

    class DelayedProgressConfig(base):  # type: ignore[misc, valid-type]
        @property
        def pthrDelay(self):  # noqa: N802 (binding's name)
            return base.pthrDelay.__get__(self)

        @pthrDelay.setter
        def pthrDelay(self, _ignored):  # noqa: N802
            base.pthrDelay.__set__(self, delay_us)

    with _create_lock:
        binding.nixlAgentConfig = DelayedProgressConfig
        try:
            yield
        finally:
            binding.nixlAgentConfig = base


@contextmanager
def threads_started_on(cores: set[int] | None) -> Iterator[None]:
    """Threads started inside (NIXL's progress thread, UCX's) may run on any of `cores`, whatever
    core the calling thread is pinned to; the caller's own affinity is restored after."""
    if not cores or not hasattr(os, "sched_setaffinity"):
        yield
        return
    before = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, cores)
    except OSError:
        yield
        return
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def _create_agent(name: str, backend: str, progress_delay_us: int, thread_cores: set[int] | None = None):
    from nixl import _api

    with progress_thread_delay(progress_delay_us), threads_started_on(thread_cores):
        try:
            return _api.nixl_agent(name, _api.nixl_agent_config(backends=[backend]))
        except Exception as exc:
            raise TransferError(f"cannot create NIXL agent {name!r} with backend {backend}: {exc}") from exc


@dataclass
class Peer:
    agent_name: str
    regions: tuple[Region, ...]
    device_id: int
    plan: Plan  # coalescing of this engine's regions against the peer's, made at handshake
    dlist: object = None  # per-block remote descriptor list, prepared on the first `write`


@dataclass
class Write:
    handle: object
    num_bytes: int
    num_descriptors: int


class NixlEngine:
    def __init__(self, name: str, regions: Sequence[Region], *, backend: str = "UCX",
                 mem_type: str = "DRAM", device_id: int = 0,
                 progress_delay_us: int | None = None, thread_cores: set[int] | None = None):
        self.name = name
        self.regions = tuple(regions)
        self.mem_type = mem_type
        self.device_id = device_id
        self._lock = threading.Lock()
        if progress_delay_us is None:
            progress_delay_us = PROGRESS_DELAY_US[mem_type]
        self._agent = _create_agent(name, backend, progress_delay_us, thread_cores)
        spans = [(base, size, device_id, "") for base, size in region_spans(self.regions)]
        try:
            self._registered = self._agent.register_memory(spans, mem_type)
        except Exception as exc:
            raise TransferError(f"cannot register {len(spans)} KV regions with NIXL: {exc}") from exc
        self._local_dlist = None  # per-block, prepared on the first `write`
        self.metadata: bytes = self._agent.get_agent_metadata()
        self._peers: dict[str, Peer] = {}

    def add_peer(self, agent_metadata: bytes, regions: Sequence[Region], device_id: int = 0,
                 segments: Sequence[Segment] | None = None) -> Peer:
        """Load a peer's metadata, pair its regions with ours and connect (once per peer).
        `device_id` is the GPU the peer's regions live on (0 for DRAM); `segments` say what of
        each block goes where (coalesce.slice_segments), default: whole blocks, region i to i."""
        try:
            plan = (Plan(segments, self.device_id, device_id) if segments is not None
                    else Plan.pair(self.regions, regions, self.device_id, device_id))
        except ValueError as exc:
            raise TransferError(f"cannot pair KV regions with the peer's: {exc}") from exc
        self._bind_thread()  # UCX unpacks the peer's memory keys here (cuda_context.py)
        with self._lock:
            try:
                name = self._agent.add_remote_agent(agent_metadata)
                if name in self._peers:  # a restarted peer reuses its name with new memory
                    self._drop(name, keep_metadata=True)
                self._agent.make_connection(name)  # wire-up now, not inside the first request's WRITE
            except Exception as exc:
                raise TransferError(f"cannot load peer metadata: {exc}") from exc
            peer = Peer(name, tuple(regions), device_id, plan)
            self._peers[name] = peer
            return peer

    def _bind_thread(self) -> None:
        """GPU memory: the calling thread gets the device's CUDA context, without which UCX
        takes the peer's GPU memory as out of CUDA IPC's reach (cuda_context.py)."""
        if self.mem_type == "VRAM":
            bind_device_context(self.device_id)

    def _drop(self, agent_name: str, keep_metadata: bool) -> None:
        peer = self._peers.pop(agent_name, None)
        if peer is not None and peer.dlist is not None:
            self._agent.release_dlist_handle(peer.dlist)
        if not keep_metadata:
            try:
                self._agent.remove_remote_agent(agent_name)
            except Exception:  # already gone: nothing to release
                pass

    def write(self, peer: Peer, src_blocks: Sequence[int], dst_blocks: Sequence[int]) -> Write:
        """Post one uncoalesced WRITE of src_blocks (here) into dst_blocks (peer): one descriptor per
        block and region, from per-block lists prepared on first use (the baseline benchmarks
        compare prepare_write against)."""
        if len(src_blocks) != len(dst_blocks):
            raise TransferError(f"{len(src_blocks)} source blocks vs {len(dst_blocks)} destination blocks")
        local = descriptor_indices(self.regions, src_blocks)
        remote = descriptor_indices(peer.regions, dst_blocks)
        num_bytes = len(src_blocks) * sum(r.block_len for r in self.regions)
        with self._lock:
            try:
                if self._local_dlist is None:
                    self._local_dlist = self._agent.prep_xfer_dlist(
                        "NIXL_INIT_AGENT", descriptor_table(self.regions, self.device_id), self.mem_type)
                if peer.dlist is None:
                    peer.dlist = self._agent.prep_xfer_dlist(
                        peer.agent_name, descriptor_table(peer.regions, peer.device_id), self.mem_type)
                handle = self._agent.make_prepped_xfer("WRITE", self._local_dlist, local, peer.dlist, remote)
                state = self._agent.transfer(handle)
            except Exception as exc:
                raise TransferError(f"WRITE to {peer.agent_name} could not be posted: {exc}") from exc
            if state == "ERR":
                self._agent.release_xfer_handle(handle)
                raise TransferError(f"WRITE to {peer.agent_name} failed when posted")
        return Write(handle, num_bytes, len(local))

    def write_coalesced(self, peer: Peer, src_blocks: Sequence[int], dst_blocks: Sequence[int],
                        notif: bytes = b"") -> Write:
        """Post one WRITE of src_blocks (here) into dst_blocks (peer) with descriptors built for this
        request: one per run of blocks adjacent on both sides, regions adjacent on both sides merged
        (see coalesce.py). `notif` reaches the peer's agent once every byte has landed."""
        write = self.prepare_write(peer, src_blocks, dst_blocks, notif)
        self.post(write, peer.agent_name)
        return write

    def prepare_write(self, peer: Peer, src_blocks: Sequence[int], dst_blocks: Sequence[int],
                      notif: bytes = b"") -> Write:
        """The coalesced WRITE, made but not posted: build it as soon as both block lists are known
        (P allocates its blocks when it schedules the prefill) so that only `post` remains when the
        prefill finishes. Release it with `release` if it is never posted."""
        src, dst = self._checked_blocks(peer, src_blocks, dst_blocks)
        try:
            local, remote = peer.plan.descriptors(src, dst)
        except ValueError as exc:
            raise TransferError(f"WRITE to {peer.agent_name}: {exc}") from exc
        return Write(self._make(peer, local, remote, notif), len(src) * peer.plan.bytes_per_block, len(local))

    def prepare_parts(self, peer: Peer, src_blocks: Sequence[int],
                      dst_blocks: Sequence[int]) -> list[tuple[Write, tuple[int, ...]]]:
        """The coalesced WRITE as one WRITE per segment (per layer in a layer-major cache), in
        address order, each with the indices of the regions it fills (coalesce.Plan.parts)."""
        src, dst = self._checked_blocks(peer, src_blocks, dst_blocks)
        try:
            parts = peer.plan.parts(src, dst)
        except ValueError as exc:
            raise TransferError(f"WRITE to {peer.agent_name}: {exc}") from exc
        made: list[tuple[Write, tuple[int, ...]]] = []
        try:
            for local, remote, regions in parts:
                num_bytes = int(local[:, 1].sum())
                made.append((Write(self._make(peer, local, remote, b""), num_bytes, len(local)), regions))
        except TransferError:
            for write, _ in made:
                self.release(write)
            raise
        return made

    def _checked_blocks(self, peer: Peer, src_blocks: Sequence[int],
                        dst_blocks: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        src = np.asarray(src_blocks, dtype=np.int64)
        dst = np.asarray(dst_blocks, dtype=np.int64)
        _check_block_ids(src, self.regions[0].num_blocks, "source")
        _check_block_ids(dst, peer.regions[0].num_blocks, "destination")
        return src, dst

    def _make(self, peer: Peer, local: np.ndarray, remote: np.ndarray, notif: bytes) -> object:
        self._bind_thread()
        with self._lock:
            try:
                return self._agent.initialize_xfer(
                    "WRITE", self._agent.get_xfer_descs(local, self.mem_type),
                    self._agent.get_xfer_descs(remote, self.mem_type), peer.agent_name, notif)
            except Exception as exc:
                raise TransferError(f"WRITE to {peer.agent_name} could not be made: {exc}") from exc

    def post(self, write: Write, agent_name: str = "peer") -> None:
        """Start a WRITE from prepare_write; on failure its handle is released."""
        self._bind_thread()
        with self._lock:
            try:
                state = self._agent.transfer(write.handle)
            except Exception as exc:
                state, error = "ERR", f": {exc}"
            else:
                error = ""
            if state == "ERR":
                self._agent.release_xfer_handle(write.handle)
                raise TransferError(f"WRITE to {agent_name} could not be posted{error}")

    def state(self, write: Write) -> str:
        """'DONE', 'PROC' or 'ERR' (a peer that died shows as ERR within milliseconds)."""
        with self._lock:
            try:
                return self._agent.check_xfer_state(write.handle)
            except Exception:
                return "ERR"

    def release(self, write: Write) -> None:
        with self._lock:
            try:
                self._agent.release_xfer_handle(write.handle)
            except Exception:  # a handle NIXL cannot cancel stays with the agent until shutdown
                pass

    def close(self) -> None:
        with self._lock:
            for name in list(self._peers):
                self._drop(name, keep_metadata=False)
            try:
                if self._local_dlist is not None:
                    self._agent.release_dlist_handle(self._local_dlist)
                self._agent.deregister_memory(self._registered)
            except Exception:
                pass


def _check_block_ids(ids: np.ndarray, num_blocks: int, side: str) -> None:
    """A block id out of range would address other registered memory, not fail."""
    if ids.size and (ids.min() < 0 or ids.max() >= num_blocks):
        raise TransferError(f"{side} block ids span {ids.min()}..{ids.max()}, outside 0..{num_blocks - 1}")
