"""Scheduler-side half of the connector: decides what the worker pushes (P) or registers (D).

P: a producer request whose prefill completes in this step goes into this step's metadata, so
the worker pushes it right after this very forward pass; its blocks stay held until the worker
reports the push finished. D: a consumer request's prompt KV is loaded asynchronously; its blocks
are registered with P as soon as they are allocated, and go back to vLLM only when the worker says
nothing can write into them any more (every finished request with a transfer is handed to the
worker for that). Pure bookkeeping: no sockets, no NIXL.
"""
from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

from kvpush.common.kv_params import MALFORMED, ParamsError, PromptIdentity, PushParams, prompt_digest

from .admission import ThrottledWarnings
from .metadata import PushMetadata, RecvSpec, SendSpec

log = logging.getLogger(__name__)


def prompt_identity(request: Any, ids_digest: str) -> PromptIdentity:
    """What prefill and decode compare before KV moves: the prompt's token ids (`ids_digest`, their
    prompt_digest) and what else makes equal ids cache differently in vLLM (cache salt, LoRA
    adapter, multimodal inputs)."""
    lora = getattr(request, "lora_request", None)
    extra = [
        str(getattr(f, "identifier", None) or getattr(f, "mm_hash", ""))
        for f in getattr(request, "mm_features", None) or ()
    ]
    return PromptIdentity.from_ids_digest(
        len(request.prompt_token_ids or ()),
        ids_digest,
        getattr(request, "cache_salt", None),
        getattr(lora, "lora_name", None),
        extra,
    )


@dataclass(frozen=True)
class Refused:
    """A request whose kvpush params this instance refused, and why (kv_params' reason constants)."""

    reason: str
    params: PushParams | None  # as parsed (unchecked), None if malformed


@dataclass
class _Producing:
    request: Any
    params: PushParams


class PushScheduler:
    def __init__(self, block_size: int, is_producer: bool, engine_id: str,
                 metadata_cls: type[PushMetadata] = PushMetadata, params_key: bytes | None = None,
                 clock: Any = time.time):
        self.metadata_cls = metadata_cls
        # The key signed kv_transfer_params are checked with (None: a deployment without a secret,
        # whose params are taken unsigned) and the wall clock their expiry is read on.
        self.params_key = params_key
        self._clock = clock
        self._checked: dict[str, PushParams | Refused | None] = {}  # req id -> its params, checked once
        self._digests: dict[str, str] = {}  # req id -> prompt_digest of its token ids, hashed once
        self.refused: Counter = Counter()  # reason -> requests refused (taken by take_refused)
        self._warnings = ThrottledWarnings(log)
        self.block_size = block_size
        self.is_producer = is_producer
        self.engine_id = engine_id
        self.kv_cache_manager: Any = None  # bound by the connector once vLLM built it
        self._meta = metadata_cls()
        # P
        self._producing: dict[str, _Producing] = {}
        self._promised: set[str] = set()  # pushed from the worker; blocks held until it reports
        # D
        self._local_hit: dict[str, int] = {}  # req id -> block-aligned local tokens at lookup
        self._handled: set[str] = set()  # consumer requests whose load was planned once already
        self._awaiting: dict[str, str] = {}  # req id -> transfer id, registered with the worker
        # req id -> transfer id: reported received, not yet scheduled. A streamed WRITE may still
        # be landing in its blocks (it is reported as it starts), so they must outlive an abort.
        self._received: dict[str, str] = {}
        self._transfer_of: dict[str, str] = {}  # req id -> transfer id, every consumer request with one

    def params_of(self, request: Any) -> PushParams | None:
        """The request's kvpush params once checked, None if it has none or they were refused."""
        verdict = self.check(request)
        return verdict if isinstance(verdict, PushParams) else None

    def check(self, request: Any) -> PushParams | Refused | None:
        """The request's kvpush params, checked on first sight (its arrival) and remembered until it
        finishes: a refusal is counted and logged once, and its expiry is judged when it arrived."""
        req_id = request.request_id
        if req_id in self._checked:
            return self._checked[req_id]
        verdict: PushParams | Refused | None
        try:
            verdict = PushParams.parse(request.kv_transfer_params)
        except ParamsError as exc:
            verdict = Refused(MALFORMED, None)
            self._refuse(request, MALFORMED, str(exc))
        if isinstance(verdict, PushParams) and self.params_key is not None:
            reason = verdict.refusal(self.params_key, self.engine_id, self._clock(), request.prompt_token_ids,
                                     self._ids_digest(request))
            if reason is not None:
                self._refuse(request, reason, f"{verdict.role} params of transfer {verdict.transfer_id!r} are {reason}")
                verdict = Refused(reason, verdict)
        self._checked[req_id] = verdict
        return verdict

    def _ids_digest(self, request: Any) -> str:
        """The prompt_digest of a kvpush request's token ids, hashed once per request."""
        digest = self._digests.get(request.request_id)
        if digest is None:
            try:
                digest = prompt_digest(request.prompt_token_ids or ())
            except ValueError:  # not token ids (prompt embeddings): matches no prompt the router bound
                digest = ""
            self._digests[request.request_id] = digest
        return digest

    def _refuse(self, request: Any, reason: str, detail: str) -> None:
        self.refused[reason] += 1
        what = ("its KV load fails" if not self.is_producer else "it is computed, nothing of it is sent")
        self._warnings.warn(f"params_{reason}", "kvpush: refused the kv_transfer_params of request %s (%s): %s; %s",
                            request.request_id, reason, detail, what)

    def take_refused(self) -> dict[str, int]:
        """Requests refused for their kv_transfer_params since the last call, by reason."""
        out, self.refused = dict(self.refused), Counter()
        return out

    def on_new_request(self, request: Any) -> None:
        verdict = self.check(request)
        params = verdict if self.is_producer and isinstance(verdict, PushParams) else None
        if params is not None and params.role == "producer":
            # known from arrival on, so an abort while still queued reaches D too
            self._producing[request.request_id] = _Producing(request, params)
            self._meta.accepts.append(
                (params.transfer_id, params.peer_tp_size, prompt_identity(request, self._ids_digest(request)))
            )

    # ---- D ------------------------------------------------------------------------------------
    def _consumer_params(self, request: Any) -> PushParams | None:
        """D: the consumer params of a request, refused ones included (their load is made to fail)."""
        verdict = self.check(request)
        if isinstance(verdict, Refused):
            verdict = verdict.params
        return verdict if verdict is not None and verdict.role == "consumer" else None

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        params = None if self.is_producer else self._consumer_params(request)
        if params is None or request.request_id in self._handled:
            return 0, False
        count = len(request.prompt_token_ids or ()) - num_computed_tokens
        self._local_hit[request.request_id] = num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        req_id = request.request_id
        if self.is_producer:
            params = self.params_of(request)
            if params is not None and params.role == "producer" and req_id not in self._promised:
                self._producing[req_id] = _Producing(request, params)
            return
        params = self._consumer_params(request)
        if params is None or req_id in self._handled:
            return
        verdict = self._checked.get(req_id)
        refusal = verdict.reason if isinstance(verdict, Refused) else ""
        if refusal and num_external_tokens <= 0:  # nothing to load: nothing to refuse, P is not contacted
            self._handled.add(req_id)
            return
        self._handled.add(req_id)
        local = self._local_hit.pop(req_id, 0)
        first_block = local // self.block_size
        if num_external_tokens > 0:
            block_ids = blocks.get_block_ids()[0]
            end = -(-(local + num_external_tokens) // self.block_size)
            spec_blocks, report = tuple(block_ids[first_block:end]), True
            self._awaiting[req_id] = params.transfer_id
            self._transfer_of[req_id] = params.transfer_id
        else:  # everything was local: P only needs to hear that nothing is to be written
            spec_blocks, report = (), False
        self._meta.recvs.append(
            RecvSpec(
                req_id,
                params.transfer_id,
                params.peer_engine_id,
                params.peer_host,
                params.peer_port,
                params.peer_tp_size,
                spec_blocks,
                first_block,
                num_external_tokens,
                report,
                prompt_identity(request, self._ids_digest(request)),
                f"the request's kv_transfer_params are refused ({refusal})" if refusal else "",
            )
        )

    # ---- both ---------------------------------------------------------------------------------
    def build_connector_meta(self, scheduler_output: Any) -> PushMetadata:
        if self.is_producer:
            scheduled = scheduler_output.num_scheduled_tokens
            for req_id, item in list(self._producing.items()):
                n = scheduled.get(req_id)
                if not n or item.request.num_computed_tokens + n < item.request.num_prompt_tokens:
                    continue
                block_ids = tuple(self.kv_cache_manager.get_block_ids(req_id)[0])
                self._meta.sends.append(SendSpec(req_id, item.params.transfer_id, block_ids, item.params.peer_engine_id,
                                                 item.params.peer_tp_size))
                self._promised.add(req_id)
                del self._producing[req_id]
        elif self._received:
            scheduled = scheduler_output.num_scheduled_tokens
            for req_id in [r for r in self._received if scheduled.get(r)]:
                self._meta.loading.append(req_id)
                del self._received[req_id]
        meta, self._meta = self._meta, self.metadata_cls()
        meta.idle = not scheduler_output.total_num_scheduled_tokens
        return meta

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        req_id = request.request_id
        self._checked.pop(req_id, None)
        self._digests.pop(req_id, None)
        if self.is_producer:
            item = self._producing.pop(req_id, None)
            if req_id in self._promised:
                return True, None
            if item is not None:
                self._meta.aborts.append(
                    (
                        item.params.transfer_id,
                        f"prefill request ended before its prefill completed ({request.status.name})",
                        item.params.peer_tp_size,
                    )
                )
            return False, None
        self._handled.discard(req_id)
        self._local_hit.pop(req_id, None)
        transfer_id = self._transfer_of.pop(req_id, None)
        received = self._received.pop(req_id, None)
        if received is not None:
            self._meta.releases.append((req_id, received))
            return True, None
        tid = self._awaiting.pop(req_id, None)
        if tid is None:
            if transfer_id is not None:
                # Whatever it finished with (an error, its length, an abort), a prefill given up on
                # may still be writing into its blocks: the worker reports it received once more
                # when nothing can (at once for a transfer that ended with prefill's word)
                self._meta.releases.append((req_id, transfer_id))
                return True, None
            return False, None
        unsent = [r for r in self._meta.recvs if r.req_id == req_id]
        if unsent:  # the worker never saw it: nothing can be written into these blocks
            self._meta.recvs = [r for r in self._meta.recvs if r.req_id != req_id]
            return False, None
        self._meta.cancels.append(tid)
        return True, None

    def update_connector_output(self, finished_sending: set[str] | None, finished_recving: set[str] | None) -> None:
        for req_id in finished_sending or ():
            self._promised.discard(req_id)
        for req_id in finished_recving or ():
            tid = self._awaiting.pop(req_id, None)
            if tid is not None:
                self._received[req_id] = tid

    def evict(self, blocks: frozenset[int]) -> None:
        """Drop blocks from vLLM's prefix cache: a streamed WRITE into them failed after vLLM had
        cached them as loaded (the blocks stay with their request)."""
        log.warning("kvpush: dropping %d blocks of a failed streamed transfer from the prefix cache", len(blocks))
        self.kv_cache_manager.evict_blocks(set(blocks))

    def has_pending_push_work(self) -> bool:
        return bool(self._promised)
