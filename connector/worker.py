"""Worker-side half of the connector: owns the NIXL engine and the push service of its role.

P: `save()` (from wait_for_save, right after the forward pass in which prefills complete was
launched) offers the finished blocks: the Producer posts their WRITE at once or when D's
registration comes. On CPU the forward is done by then. On a GPU its kernels are still running:
save() hands the step to a SaveQueue (save_order.py) with a mark of where the forward ends on its
stream, which a thread of its own records (step_marks.py); the queue's thread makes the WRITEs
meanwhile and offers the blocks once the forward is done. The compute thread launches nothing
for a push in wait_for_save; `bind()`, before the next forward pass, records the marks the
recorder has not got to yet (`StepMarks.settle`), so that no WRITE waits for a later forward.
D: `bind()` registers newly allocated blocks with P at once. A WRITE that P streams layer by layer
is reported received as it starts; every forward pass until it is over waits, layer by layer
(`wait_for_layer_load`), for that layer's bytes of every such WRITE. One that fails then has its
blocks reported as load errors in the step that first computes its request.
D hands an ended request's blocks back to vLLM (reports it received once more) only once nothing
can write into them: at once for a transfer that ended with P's word, else when its fence ends
(fences.py: P's word that its WRITEs ended, P's death, or the backstop).
"""
from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

from .cache_layout import layout_cost_note
from .consumer import Consumer, ConsumerConfig
from .hugepages import back_with_huge_pages
from .kv_digest import HostMemory, TorchMemory
from .kv_digest_check import MISMATCH, VERIFIED
from .layout import TensorView, head_layout, kv_regions, region_spans, regions_of
from .metadata import PushMetadata
from .producer import Producer, ProducerConfig
from .regions import HeadLayout, LayoutIdentity, Region
from .save_order import SaveQueue
from .settings import Settings, side_channel_key
from .sharding import HeadSharding
from .siblings import exit_handles, sibling_ranks, yield_cores
from .state import Outcome, Pending
from .stats import PushStats
from .step_marks import CudaStreamMarks, StepMarks
from .transfer import NixlEngine

log = logging.getLogger(__name__)


class PushWorker:
    def __init__(self, settings: Settings, num_blocks: int, tp_rank: int):
        self.settings = settings
        self.num_blocks = num_blocks
        self.tp_rank = tp_rank
        self.engine: NixlEngine | None = None
        self.producer: Producer | None = None
        self.consumer: Consumer | None = None
        # P: requests offered, finished in the scheduler, and pushed (any outcome)
        self._offered: set[str] = set()
        self._sched_finished: set[str] = set()
        self._pushed: set[str] = set()
        # D
        self._silent: set[str] = set()  # transfer ids vLLM is not waiting for
        self._load_errors: set[int] = set()
        # transfer id -> "its request has ended": a streamed WRITE reported received at its start,
        # without an outcome yet. An ended one is reported again at the outcome (vLLM frees it then).
        self._landing: dict[str, bool] = {}
        self._failed_early: dict[str, tuple[int, ...]] = {}  # req id -> blocks: streamed WRITE failed
        # req id -> (transfer, blocks): a streamed WRITE given up on while P may still write into
        # them; reported every step until vLLM hands the request back (see `_streamed_failure`)
        self._failed_late: dict[str, tuple[str, tuple[int, ...]]] = {}
        self._cancelled: set[str] = set()  # transfers whose request ended while vLLM waited for them
        self._evict: set[int] = set()  # blocks vLLM cached for a streamed WRITE that then failed
        self._echo: set[str] = set()  # ended requests to report received again (vLLM frees them)
        # Transfers whose outcome is out but whose blocks P may still write into (fenced), and
        # ended requests held back until their transfer's fence ends (request -> transfer)
        self._fenced: set[str] = set()
        self._held: dict[str, str] = {}
        self._loading_now: set[str] = set()
        self._layer_wait_s: float | None = None  # this forward pass's waits for streamed layers
        # vLLM called wait_for_layer_load at least once: only then may a WRITE still landing be
        # reported received (an attention backend without that hook would compute on it)
        self._layer_hook_seen = False
        self._layer_regions: dict[str, tuple[int, ...]] = {}
        self._all_regions: tuple[int, ...] = ()
        self._idle_step = False
        self._stats = PushStats()
        # P on CUDA: where each step's forward pass ends on its stream; the queue offers after it
        self._step_marks: StepMarks | None = None
        self._saves: SaveQueue | None = None

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        s = self.settings
        tensors = list(kv_caches.values())
        regions = kv_regions((TensorView.of(t) for t in tensors), self.num_blocks)
        self._layer_regions = _regions_by_layer(kv_caches, regions, self.num_blocks)
        self._all_regions = tuple(range(len(regions)))  # for a layer name vLLM did not register
        identity = LayoutIdentity(s.model, str(tensors[0].dtype).removeprefix("torch."), s.block_size,
                                  tuple(sorted(kv_caches)), s.kv_heads)
        sharding = HeadSharding(s.kv_heads, s.tp_size)
        key = side_channel_key(s)
        head_layouts = _head_layouts(kv_caches, regions, self.num_blocks, sharding.heads_per_rank)
        on_gpu = bool(tensors[0].is_cuda)
        mem_type = "VRAM" if on_gpu else "DRAM"
        device_id = (tensors[0].device.index or 0) if on_gpu else 0
        kv_memory = None if not s.verify_kv else TorchMemory(tensors) if on_gpu else HostMemory()
        if on_gpu and s.is_producer:
            self._step_marks = StepMarks(CudaStreamMarks(tensors[0].device), f"kvpush-mark-tp{self.tp_rank}")
        note = layout_cost_note(s.kv_cache_layout, regions, on_gpu)
        if note is not None:
            (log.warning if on_gpu else log.info)(note)
        if not on_gpu and s.huge_pages:
            log.info(
                "kvpush: putting the CPU KV cache on huge pages (connector extra config huge_pages: false skips this)"
            )
            huge = back_with_huge_pages(region_spans(regions))
            if huge.requested_bytes or huge.error:
                log.info("kvpush: %s", huge.describe())
        name = f"{s.engine_id}.tp{self.tp_rank}.{os.getpid()}"
        self.engine = NixlEngine(
            name,
            regions,
            backend=s.backend,
            mem_type=mem_type,
            device_id=device_id,
            progress_delay_us=s.progress_delay_us,
            thread_cores=None if on_gpu else _instance_cores(),
        )
        log.info("kvpush: %s registered %d KV regions (%d blocks x %s bytes) with NIXL %s", name, len(regions),
                 self.num_blocks, sorted({r.block_len for r in regions}), s.backend)
        if s.is_producer:
            port = s.side_channel_port + self.tp_rank
            try:
                self.producer = Producer(
                    ProducerConfig(
                        s.engine_id,
                        identity,
                        s.allowed_engines,
                        s.side_channel_host,
                        port,
                        s.transfer_timeout_s,
                        tp_rank=self.tp_rank,
                        sharding=sharding,
                        head_layouts=head_layouts,
                        side_channel_key=key,
                        drive_writes=not on_gpu,
                        stream_writes=s.stream_writes,
                        verify_kv=kv_memory,
                    ),
                    self.engine,
                )
            except OSError as exc:
                raise RuntimeError(
                    f"kvpush: prefill {s.engine_id} cannot listen on {s.side_channel_host}:{port} for its "
                    f"side channel ({exc}); stop the process holding that port or change side_channel_port"
                ) from None
            log.info("kvpush: prefill %s side channel on %s:%d", s.engine_id, s.side_channel_host, port)
            self._watch_siblings()
        else:
            self.consumer = Consumer(ConsumerConfig(s.engine_id, self.tp_rank, identity, s.allowed_engines,
                                                    s.transfer_timeout_s, peer_silence_s=s.peer_silence_s,
                                                    accepted_timeout_s=s.accepted_timeout_s, sharding=sharding,
                                                    head_layouts=head_layouts, side_channel_key=key,
                                                    peers=s.peer_side_channels, late_write_hold_s=s.late_write_hold_s,
                                                    verify_kv=kv_memory),
                                     name, self.engine.metadata, tuple(regions), device_id)

    def _watch_siblings(self) -> None:
        """P: hear at once when another rank of this instance ends (siblings.py). Only where what
        looks like its ranks on this host are exactly as many as run here: a stranger taken for a
        rank would, by ending, stop a healthy instance."""
        assert self.producer is not None
        others = self.settings.local_ranks - 1
        if others <= 0:
            return
        siblings = sibling_ranks()
        if len(siblings) != others:
            log.warning(
                "kvpush: prefill rank %d found %d process(es) titled as this instance's ranks on this host where "
                "%d run, so it watches none (another executor, setproctitle missing, or /proc mounted with "
                "hidepid); decode hears of a lost rank only once vLLM ends this one",
                self.tp_rank,
                len(siblings),
                others,
            )
            return
        handles, gone = exit_handles(siblings)
        self.producer.watch_siblings(handles, gone, on_lost=self._yield_cores)
        if len(handles) + len(gone) < others:
            log.warning(
                "kvpush: prefill rank %d watches %d of its %d sibling rank process(es): no pidfd could be opened for "
                "the "
                "others (a kernel before Linux 5.3, or out of file descriptors)",
                self.tp_rank,
                len(handles) + len(gone),
                others,
            )
        else:
            log.info("kvpush: prefill rank %d watches its %d sibling rank process(es)", self.tp_rank, others)

    def _yield_cores(self) -> None:
        """P, its instance lost a rank (the producer's transfer thread): its side-channel threads
        keep answering decode."""
        assert self.producer is not None
        moved = yield_cores(keep_threads={threading.get_native_id(), *self.producer.side_channel_threads()})
        log.info(
            "kvpush: prefill rank %d put %d thread(s) under SCHED_IDLE until vLLM ends this process",
            self.tp_rank,
            moved,
        )

    # ---- before the forward pass (mostly D) ------------------------------------------------------
    def bind(self, meta: PushMetadata) -> None:
        if self._step_marks is not None:  # P on a GPU: the next forward pass is launched after this
            late = self._step_marks.settle()
            if late:
                self._stats.record_marks_on_compute_thread(late)
        self._idle_step = meta.idle
        if self.producer is not None and meta.accepts:
            self.producer.accept(meta.accepts)
        if self.consumer is None:
            return
        self._loading_now = set(meta.loading)
        for req_id, tid in meta.releases:
            self._failed_early.pop(req_id, None)
            self._failed_late.pop(req_id, None)
            if tid in self._landing:
                self._landing[tid] = True
            elif tid in self._fenced:
                self._held[req_id] = tid
            else:
                self._echo.add(req_id)
        for r in meta.recvs:
            if not r.report:
                self._silent.add(r.transfer_id)
            self.consumer.expect(r.req_id, r.transfer_id, r.peer_engine, r.peer_host, r.peer_port,
                                 list(r.block_ids), r.first_block, r.num_tokens, r.peer_tp_size, r.prompt, r.refused)
        for tid in meta.cancels:
            if self.consumer.cancel(tid):  # else its outcome is in: nothing more to wait for
                self._cancelled.add(tid)

    def wait_for_layer(self, layer_name: str) -> None:
        """Before a layer's attention: that layer's bytes of every streamed WRITE still landing."""
        if self.consumer is None:
            return
        if not self._layer_hook_seen:
            self._layer_hook_seen = True
            log.info("kvpush: vLLM calls wait_for_layer_load here: streamed KV is waited for layer by layer")
        if self._landing:
            regions = self._layer_regions.get(layer_name) or self._all_regions
            started = time.monotonic()
            self.consumer.wait_landed(list(self._landing), regions, self.settings.transfer_timeout_s)
            self._layer_wait_s = (self._layer_wait_s or 0.0) + time.monotonic() - started

    # ---- P ------------------------------------------------------------------------------------
    def save(self, meta: PushMetadata) -> None:
        if self.producer is None:
            return
        for s in meta.sends:
            self._offered.add(s.req_id)
        if self._step_marks is not None:
            # the forward's kernels are still running: the queue's thread makes the WRITEs meanwhile
            # and offers the blocks once the KV is written; aborts go behind them, so that this
            # thread never waits on the Producer's lock
            if meta.sends or meta.aborts:
                self.save_queue().submit(self._step_marks.mark() if meta.sends else None, meta.sends, meta.aborts)
            return
        for s in meta.sends:
            self.producer.offer(s.transfer_id, s.req_id, list(s.block_ids), s.peer_engine, s.peer_tp_size)
        for tid, reason, peer_tp_size in meta.aborts:
            self.producer.abort(tid, reason, peer_tp_size)

    def save_queue(self) -> SaveQueue:
        assert self.producer is not None
        if self._saves is None:
            self._saves = SaveQueue(self.producer, f"kvpush-save-tp{self.tp_rank}")
        return self._saves

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self.producer is not None:
            self._sched_finished |= finished_req_ids & self._offered
            self._pushed.update(self.producer.take_freed())
            for rec in self.producer.take_records():
                self._stats.record_send(rec)
            ready = self._pushed & self._sched_finished
            self._pushed -= ready
            self._sched_finished -= ready
            self._offered -= ready
            return (ready or None), None
        if self.consumer is not None:
            if self._layer_wait_s is not None:
                self._stats.record_layer_wait(self._layer_wait_s)
                self._layer_wait_s = None
            recving, self._echo = self._echo, set()
            if self._idle_step and not recving:
                # decode's idle wait: vLLM steps only for our outcomes (or held blocks) now, so sleep
                # until one comes (or a new request may be waiting at the engine: hence the bound)
                self.consumer.wait_for_outcome(self.settings.idle_wait_ms / 1000, even_if_none_pending=bool(self._held))
            started, outcomes, unfenced = self.consumer.take()
            for p in started if self._layer_hook_seen else ():  # else: its outcome reports it, as unstreamed
                ended = p.transfer_id in self._cancelled  # vLLM frees a finished request's blocks when told
                self._landing[p.transfer_id] = ended
                if not ended:
                    recving.add(p.req_id)
            for o in outcomes:
                tid, req_id = o.pending.transfer_id, o.pending.req_id
                self._cancelled.discard(tid)
                if tid in self._silent:
                    self._silent.discard(tid)
                    continue
                self._stats.record_recv(o)
                late = self._note_fenced(o)
                request_ended = self._landing.pop(tid, None)
                if request_ended is not None:  # already reported received
                    if request_ended:
                        self._report_or_hold(req_id, tid, late, recving)
                        if not o.ok:  # vLLM may have cached them as loaded; freed now, not recomputed
                            self._evict.update(o.pending.block_ids)
                    elif not o.ok:
                        self._streamed_failure(o.pending, late)
                    continue
                # a request still waiting is failed by vLLM on the load errors, which keeps its blocks
                # until it is reported received: that waits for the hold too
                self._report_or_hold(req_id, tid, late, recving)
                if not o.ok:
                    self._load_errors.update(o.pending.block_ids)
            for tid in unfenced:
                recving |= self._unfenced(tid)
            return None, (recving or None)
        return None, None

    def _note_fenced(self, outcome: Outcome) -> bool:
        """A failure while P may still write into the blocks: they stay out of vLLM's hands until
        the consumer says the transfer's fence ended."""
        if not outcome.may_still_land:
            return False
        self._fenced.add(outcome.pending.transfer_id)
        log.warning("kvpush: holding the %d blocks of transfer %s (request %s): prefill %s may still write into them "
                    "(%s); they come back once it says its WRITEs ended or its process is gone (or after "
                    "late_write_hold_s, %g s, when decode drops its connection)", len(outcome.pending.block_ids),
                    outcome.pending.transfer_id, outcome.pending.req_id, outcome.pending.peer_engine, outcome.reason,
                    self.settings.late_write_hold_s)
        return True

    def _report_or_hold(self, req_id: str, tid: str, fenced: bool, recving: set[str]) -> None:
        """Report a request received (vLLM frees an ended request's blocks then), or hold it."""
        if fenced:
            self._held[req_id] = tid
        else:
            recving.add(req_id)

    def _unfenced(self, tid: str) -> set[str]:
        """Nothing writes into the transfer's blocks any more: the ended requests held for it, to
        report received. A running request given up on gets its blocks reported as load errors
        once more (a late WRITE may have landed after it last computed them), then no more."""
        self._fenced.discard(tid)
        due = {req_id for req_id, t in self._held.items() if t == tid}
        for req_id in due:
            del self._held[req_id]
        for req_id in [r for r, (t, _) in self._failed_late.items() if t == tid]:
            self._load_errors.update(self._failed_late.pop(req_id)[1])
        return due

    def _streamed_failure(self, pending: Pending, late: bool) -> None:
        """vLLM took this request's blocks for loaded (and may have cached them) when the WRITE
        began. Report them for the step that first computes the request, and at once for any
        running request that found them in the prefix cache; drop them from that cache.

        If P may still write into them (`late`), they are reported in every step until vLLM ends
        the request: vLLM fails a request only for blocks it had computed before the step, and in
        its first step that excludes the prompt's last block, which P writes whole, past the
        prompt, over the slots this request fills with what it generates."""
        self._failed_early[pending.req_id] = pending.block_ids
        if late:
            self._failed_late[pending.req_id] = (pending.transfer_id, pending.block_ids)
        self._load_errors.update(pending.block_ids)
        self._evict.update(pending.block_ids)

    def take_evictions(self) -> set[int]:
        evict, self._evict = self._evict, set()
        return evict

    def load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        for req_id in self._loading_now & self._failed_early.keys():
            errors.update(self._failed_early.pop(req_id))
        for _, blocks in self._failed_late.values():
            errors.update(blocks)
        return errors

    def take_stats(self) -> PushStats | None:
        for service in (self.producer, self.consumer):
            if service is not None:
                counts = service.take_counts()
                self._stats.record_late_write_backstops(counts.pop("late_write_backstop", 0))
                self._stats.record_kv_digest_mismatches(counts.pop(MISMATCH, 0))
                self._stats.record_kv_digests_verified(counts.pop(VERIFIED, 0))
                self._stats.record_dropped(counts)
        if self._stats.is_empty():
            return None
        stats, self._stats = self._stats, PushStats()
        return stats

    def shutdown(self) -> None:
        if self._step_marks is not None:  # first: the queue's waits for marks end then
            self._step_marks.close()
        if self._saves is not None:
            self._saves.close()
        for service in (self.producer, self.consumer):
            if service is not None:
                service.close()
        if self.engine is not None:
            self.engine.close()


def _instance_cores() -> set[int] | None:
    """The cores of the whole instance, not of this rank: vLLM pins a CPU rank's process to its
    own core list, and NIXL's progress thread, started here, would inherit that. It busy-polls
    while a connection to a peer is being set up; pinned beside this rank's compute thread it took
    that core (91% of it, the compute thread ~0%) from a rank whose TP partners then waited in a
    collective, so the peer never answered and neither side progressed. The engine process that
    started this worker runs on the instance's cores."""
    try:
        parent = os.sched_getaffinity(os.getppid())
        return parent | os.sched_getaffinity(0)
    except OSError:
        return None


def _head_layouts(
    kv_caches: dict[str, Any], regions: list[Region], num_blocks: int, heads: int
) -> tuple[HeadLayout, ...]:
    """Per region (kv_regions over the same tensors), where this rank's heads lie in its blocks."""
    by_base: dict[int, HeadLayout] = {}
    for tensor in kv_caches.values():
        view = TensorView.of(tensor)
        layout = head_layout(view, num_blocks, heads)
        for r in regions_of(view, num_blocks):
            by_base.setdefault(r.base, layout)
    return tuple(by_base[r.base] for r in regions)


def _regions_by_layer(kv_caches: dict[str, Any], regions: list[Region], num_blocks: int) -> dict[str, tuple[int, ...]]:
    """Layer name -> indices into `regions` (kv_regions over the same tensors) of its regions."""
    index = {r.base: i for i, r in enumerate(regions)}
    return {name: tuple(index[r.base] for r in regions_of(TensorView.of(tensor), num_blocks))
            for name, tensor in kv_caches.items()}

