"""One attempt at one part of a request, on one chosen pair: the legs its way to decode needs
(fanout.py), up to decode's head (legs.DecodeHead). Everything here happens before the client
sees a byte, so any LegFailure may be retried by the dispatcher on another pair.

Invariant: a failing leg cancels (closes the connection of) the other legs of the same attempt,
so no instance keeps blocks reserved for a request nobody waits for.

Blame: a decode leg of a transfer that vLLM finished with an error (vllm_errors.py: how a failed
KV load shows) may have failed because of prefill: kvpush's connector fails a transfer whose
prefill died or went silent, and vLLM's answer does not say which side failed. The next attempt
then avoids both instances; neither is ejected for it (their health probes decide).
"""
from __future__ import annotations

import asyncio
import functools
import logging
from typing import Any

from . import metrics as M
from .config import RouterConfig
from .fanout import LOCAL, SAMPLES, Part
from .legs import GENERATION_ERROR, DecodeHead, LegFailure, LegRunner, OtherLegFailed, UpstreamClientError
from .pool import Instance, Pool
from .protocols import (
    CONCURRENT_PROTOCOLS,
    concurrent_legs,
    new_transfer_id,
    prefill_only,
    pull_decode_leg,
    pull_prefill_leg,
)
from .upstream_http import UpstreamResponse

log = logging.getLogger("kvpush.router")


def _blame_transfer(exc: BaseException, prefill: Instance) -> None:
    """A decode leg whose KV load failed names prefill too."""
    if isinstance(exc, LegFailure) and exc.role == "decode" and exc.reason == GENERATION_ERROR:
        exc.also_avoid.append(("prefill", prefill.name))


def _fail_if_failed(resp: UpstreamResponse, task: asyncio.Task) -> None:
    """Done callback of a leg's task: its failure ends the wait on the other leg's answer `resp`."""
    if not task.cancelled() and task.exception() is not None:
        resp.fail(OtherLegFailed())


class Attempts:
    def __init__(self, config: RouterConfig, prefill: Pool, decode: Pool, metrics: M.RouterMetrics, legs: LegRunner):
        self.config = config
        self.prefill = prefill
        self.decode = decode
        self.metrics = metrics
        self.legs = legs
        self._detached: set[asyncio.Task] = set()

    async def run(self, endpoint: str, chat: bool, stream: bool, part: Part, way: str, why_local: str | None,
                  client_request_id: str | None, prefill: Instance | None, decode: Instance) -> DecodeHead:
        if way == LOCAL:
            # colocated keeps the client's request id; a disaggregated instance gets a dispatch's own
            request_id = client_request_id if why_local is None else new_transfer_id(client_request_id)
            leg, resp = self.legs.send(self.decode, decode, endpoint, part.data(), self.legs.headers(request_id),
                                       self.config.timeouts.decode_s)
            return await self.legs.decode_head(leg, resp, stream)
        assert prefill is not None
        transfer_id = new_transfer_id(client_request_id)
        self.prefill.transfer_started(prefill)  # until decode's head: a draining prefill is stopped only after
        try:
            if way == SAMPLES:
                # one transfer into decode's prefix cache (the one-token leg's whole answer), then the
                # samples from there
                await self._transfer(endpoint, chat, False, part.body, prefill, decode, transfer_id,
                                     decode_body=prefill_only(part.body, chat))
                self.prefill.transfer_ended(prefill)
                prefill = None
                leg, resp = self.legs.send(self.decode, decode, endpoint, part.data(),
                                           self.legs.headers(new_transfer_id(client_request_id)),
                                           self.config.timeouts.decode_s)
                return await self.legs.decode_head(leg, resp, stream)
            return await self._transfer(endpoint, chat, stream, part.body, prefill, decode, transfer_id)
        finally:
            if prefill is not None:
                self.prefill.transfer_ended(prefill)

    async def _transfer(self, endpoint: str, chat: bool, stream: bool, body: dict, prefill: Instance,
                        decode: Instance, transfer_id: str, decode_body: dict | None = None) -> DecodeHead:
        headers = self.legs.headers(transfer_id)
        timeouts = self.config.timeouts
        protocol = self.config.protocol
        if protocol in CONCURRENT_PROTOCOLS:
            legs = concurrent_legs(protocol, body, chat, transfer_id, prefill.upstream, decode.upstream, decode_body)
            release = concurrent_legs(protocol, body, chat, transfer_id, prefill.upstream, decode.upstream,
                                      prefill_only(body, chat)).decode
            return await self._concurrent(
                endpoint, stream, prefill, legs.prefill, decode, legs.decode, headers, release
            )
        prefill_leg, prefill_resp = self.legs.send(self.prefill, prefill, endpoint, pull_prefill_leg(body, chat),
                                                   headers, timeouts.prefill_s)
        answer, answered_at = await self.legs.json_answer(prefill_leg, prefill_resp, timeouts.prefill_s)
        decode_leg_body = pull_decode_leg(body if decode_body is None else decode_body, answer)
        if decode_leg_body is None:
            self.prefill.failed(prefill, "no_kv_transfer_params")
            raise LegFailure("prefill", prefill.name, "no_kv_transfer_params",
                             "answer carried no kv_transfer_params (is the instance started with NixlConnector?)")
        leg, resp = self.legs.send(self.decode, decode, endpoint, decode_leg_body, headers, timeouts.decode_s)
        try:
            head = await self.legs.decode_head(leg, resp, stream)
        except UpstreamClientError:
            release_body = pull_decode_leg(prefill_only(body, chat), answer)
            assert release_body is not None
            self._release(endpoint, decode, release_body, headers)
            raise
        except LegFailure as exc:  # decode reads the KV from prefill: the failure may be prefill's
            _blame_transfer(exc, prefill)
            raise
        self.metrics.handoff_gap.observe(max(0.0, head.first_token_at - answered_at))
        return head

    def _release(self, endpoint: str, decode: Instance, release_body: dict, headers: dict) -> None:
        """Decode refused a request (a 4xx) whose prompt prefill computes or computed: prefill would
        hold its blocks until a decode takes them or a timeout (vLLM's pull: minutes), so a client
        could pin prefill's KV with requests decode refuses. A one-token leg of the same transfer,
        with the body prefill accepted, takes them."""
        try:
            leg, resp = self.legs.send(
                self.decode, decode, endpoint, release_body, headers, self.config.timeouts.decode_s
            )
        except LegFailure:
            return
        self._detach(self._leg_task(self.legs.json_answer(leg, resp, self.config.timeouts.decode_s), leg, resp))

    async def _concurrent(self, endpoint: str, stream: bool, prefill: Instance, prefill_body: dict,
                          decode: Instance, decode_body: dict, headers: dict, release_body: dict) -> DecodeHead:
        """Both legs at once. Both are written to their instances before this coroutine yields
        (decode's first: its first token is what the client waits for), and decode's answer is read
        right here, as colocated reads its one leg: every task step in between (a leg's own, then the
        wake-up of whoever waits for it) waits behind all callbacks already queued, ~1 ms at 64
        streams. Prefill's answer is read by a task; its failure ends the wait for decode's first
        token at once (decode is cancelled, and the attempt fails with prefill's failure). Decode
        refusing the request (a 4xx) leaves prefill running, its KV going to a release leg."""
        timeouts = self.config.timeouts
        decode_leg, decode_resp = self.legs.send(self.decode, decode, endpoint, decode_body, headers, timeouts.decode_s)
        try:
            prefill_leg, prefill_resp = self.legs.send(self.prefill, prefill, endpoint, prefill_body, headers,
                                                       timeouts.prefill_s)
        except LegFailure:  # decode's leg is out already: it must not hold its blocks for nothing
            decode_leg.end(cancelled=True)
            decode_resp.close()
            raise
        prefill_task = self._leg_task(self.legs.json_answer(prefill_leg, prefill_resp, timeouts.prefill_s),
                                      prefill_leg, prefill_resp)
        end_decode_wait = functools.partial(_fail_if_failed, decode_resp)
        prefill_task.add_done_callback(end_decode_wait)
        try:
            head = await self.legs.decode_head(decode_leg, decode_resp, stream)
            if prefill_task.done():
                _, answered_at = prefill_task.result()  # a prefill failure wins over the token that came with it
                self.metrics.handoff_gap.observe(max(0.0, head.first_token_at - answered_at))
                return head
        except UpstreamClientError:
            prefill_task.remove_done_callback(end_decode_wait)
            if prefill_task.done() and (prefill_task.cancelled() or prefill_task.exception() is not None):
                raise  # prefill failed too: it holds nothing
            self._release(endpoint, decode, release_body, headers)
            self._detach(prefill_task)
            raise
        except BaseException as exc:
            decode_leg.end(cancelled=True)  # a no-op where decode's own failure ended it
            decode_resp.close()
            prefill_task.cancel()
            await self._settle(prefill_task)
            if isinstance(exc, OtherLegFailed):
                failure = prefill_task.exception()
                assert failure is not None, "OtherLegFailed comes only of prefill's task raising"
                raise failure from None
            _blame_transfer(exc, prefill)
            raise
        # Decode's first token came before prefill's HTTP answer (the KV already arrived): let the
        # prefill leg finish on its own; it frees nothing the client waits for.
        prefill_task.remove_done_callback(end_decode_wait)
        self.metrics.handoff_gap.observe(0.0)
        self._detach(prefill_task)
        return head

    async def _settle(self, *tasks: asyncio.Task) -> None:
        """Wait for cancelled legs to close their connections; their own outcome is already recorded."""
        pending = [t for t in tasks if t not in self._detached]
        for task in pending:
            if not task.done():
                try:
                    await asyncio.wait({task})
                except asyncio.CancelledError:
                    for t in pending:
                        t.cancel()
                    raise
            if not task.cancelled():
                task.exception()  # mark retrieved

    @staticmethod
    def _leg_task(coro: Any, leg: Any, resp: Any) -> asyncio.Task:
        """A task for a leg already counted and sent: one cancelled before its first step never
        runs its own clean-up, so the leg is ended and its answer closed here."""
        task = asyncio.ensure_future(coro)

        def cleanup(t: asyncio.Task) -> None:
            if t.cancelled():
                leg.end(cancelled=True)
                resp.close()

        task.add_done_callback(cleanup)
        return task

    def _detach(self, task: asyncio.Task) -> None:
        self._detached.add(task)

        def forget(t: asyncio.Task) -> None:
            self._detached.discard(t)
            if not t.cancelled() and t.exception() is not None:
                log.info("detached leg ended with %s", t.exception())

        task.add_done_callback(forget)

    async def close(self) -> None:
        for task in list(self._detached):
            task.cancel()
        if self._detached:
            await asyncio.wait(list(self._detached), timeout=5)
