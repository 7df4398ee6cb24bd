"""One leg: a request the router sends to one instance, its bookkeeping, and reading its answer
up to the point the client may see it.

A leg's failure is a LegFailure (another attempt may fix it) or an UpstreamClientError (the
instance rejected the request itself: the client gets that answer). Each failure is counted per
instance and reason; only a failure of the instance itself (pool.EJECTING_REASONS) brings it
closer to ejection.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import time
from dataclasses import dataclass
from typing import Iterator

from aiohttp import web

from . import metrics as M
from .config import RouterConfig
from .legs_signing import LegSigner, read_signing_key
from .pool import Instance, LeftRotation, Pool
from .upstream_http import UpstreamClient, UpstreamError, UpstreamResponse, answer_head
from .vllm_errors import (
    CLIENT,
    GENERATION,
    classify_event,
    client_fault,
    error_message,
    event_failure_kind,
    failure_kind,
)

GENERATION_ERROR = "generation_error"  # vLLM finished the request with an error: on a leg loading KV, the load failed


class LegFailure(Exception):
    """A leg failed in a way another attempt may fix (connection, 5xx, timeout, transfer)."""

    def __init__(self, role: str, instance: str, reason: str, detail: str):
        super().__init__(f"{role} leg on instance {instance} failed: {detail}")
        self.role, self.instance, self.reason = role, instance, reason
        self.also_avoid: list[tuple[str, str]] = []  # (role, instance) the next attempt should avoid too


class OtherLegFailed(Exception):
    """What a leg's answer is failed with when the other leg of its attempt failed first."""


class UpstreamClientError(Exception):
    """The instance rejected the request itself (4xx): the client gets that answer verbatim."""

    def __init__(self, status: int, body: bytes, content_type: str):
        super().__init__(f"upstream answered {status}")
        self.status, self.body, self.content_type = status, body, content_type

    def response(self) -> web.Response:
        return web.Response(status=self.status, body=self.body, headers={"Content-Type": self.content_type})


class Leg:
    """Bookkeeping of one leg on one instance: in-flight count, latency, health verdict."""

    def __init__(self, pool: Pool, inst: Instance, metrics: M.RouterMetrics):
        self.pool, self.inst, self.metrics = pool, inst, metrics
        self.started = time.perf_counter()
        self._ended = False
        self._waiting_for: UpstreamResponse | None = None
        pool.leg_started(inst)

    def wait_for(self, resp: UpstreamResponse) -> None:
        """Until answered(): `resp` fails with LeftRotation if the instance leaves rotation."""
        self._waiting_for = resp
        self.inst.waiting.add(resp)

    def answered(self) -> None:
        """The instance answered (what the client may see first): it no longer waits on its rotation.
        Raises LeftRotation if the instance left rotation before that, also where the answer's head
        or first token had already arrived: the attempt then fails and is retried elsewhere before
        the client has seen any of it, instead of failing later on the rest of the answer."""
        resp = self._waiting_for
        self._stop_waiting()
        if resp is not None and isinstance(resp.error, LeftRotation):
            raise resp.error

    def _stop_waiting(self) -> None:
        if self._waiting_for is not None:
            self.inst.waiting.discard(self._waiting_for)
            self._waiting_for = None

    @property
    def role(self) -> str:
        return self.pool.role

    @property
    def name(self) -> str:
        return self.inst.name

    @property
    def ended(self) -> bool:
        return self._ended

    def end(self, failure: str | None = None, cancelled: bool = False) -> None:
        if self._ended:
            return
        self._ended = True
        self._stop_waiting()
        self.pool.leg_ended(self.inst)
        if cancelled:
            return
        if failure is None:
            self.pool.succeeded(self.inst)
            self.pool.leg_latency.observe(time.perf_counter() - self.started)
        else:
            self.pool.failed(self.inst, failure)


@dataclass
class DecodeHead:
    """The decode leg up to what the client may see first: a stream up to its first token, a
    non-streamed answer up to its status line (its body is read after the retryable phase)."""

    leg: Leg
    resp: UpstreamResponse | None  # None once fully read
    held: bytes
    content_type: str
    first_token_at: float

    def abandon(self) -> None:
        """Given up on by the router (another part of the request failed, the client left)."""
        self.leg.end(cancelled=True)
        if self.resp is not None:
            self.resp.close()


class LegRunner:
    """Sends legs and reads their answers, turning every way they can fail into LegFailure or
    UpstreamClientError with the leg ended and counted."""

    def __init__(self, config: RouterConfig, upstream: UpstreamClient, metrics: M.RouterMetrics,
                 instance_key: str | None):
        self.config = config
        self.upstream = upstream
        self.metrics = metrics
        self.instance_key = instance_key
        self.signer = LegSigner(read_signing_key(config.transfer_params_key_file), config.transfer_params_ttl_s)

    def headers(self, request_id: str | None) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        if self.instance_key:
            headers["Authorization"] = f"Bearer {self.instance_key}"
        if request_id:
            headers["X-Request-Id"] = request_id
        return headers

    def send(self, pool: Pool, inst: Instance, path: str, body: dict | bytes, headers: dict,
             timeout_s: float) -> tuple[Leg, UpstreamResponse]:
        """Count the leg and send it: written now on a pooled connection, else once connected."""
        leg = Leg(pool, inst, self.metrics)
        data = body if isinstance(body, bytes) else json.dumps(self.signer.sign(body, inst.upstream)).encode()
        try:
            resp = self.upstream.start("POST", inst.upstream.url, path, headers, data, self.config.timeouts.connect_s,
                                       timeout_s)
        except UpstreamError as exc:  # e.g. an unusable URL: counted and ended like a refused connection
            raise self.fail(leg, "connect", str(exc)) from None
        leg.wait_for(resp)
        return leg, resp

    @staticmethod
    def fail(leg: Leg, reason: str, detail: str) -> LegFailure:
        leg.end(reason)
        return LegFailure(leg.role, leg.name, reason, detail)

    @contextlib.contextmanager
    def _as_leg_failure(self, leg: Leg, timeout_s: float) -> Iterator[None]:
        """An upstream that times out, leaves rotation or drops the connection fails the leg."""
        try:
            yield
        except asyncio.TimeoutError:
            raise self.fail(leg, "timeout", f"no answer within {timeout_s:g} s") from None
        except LeftRotation as exc:
            raise self.fail(leg, "left_rotation", str(exc)) from None
        except UpstreamError as exc:
            raise self.fail(leg, "connect", str(exc)) from None

    async def _answer_head(self, leg: Leg, resp: UpstreamResponse, timeout_s: float) -> UpstreamResponse:
        with self._as_leg_failure(leg, timeout_s):
            return await answer_head(resp)

    async def _read_error(self, leg: Leg, resp: UpstreamResponse) -> Exception:
        """A non-200 answer: 4xx goes to the client verbatim, anything else is a leg failure."""
        try:
            body = await resp.read()
        except (UpstreamError, asyncio.TimeoutError):
            body = b""
        finally:
            resp.close()
        if client_fault(resp.status):
            leg.end()  # the request's fault, not the instance's
            return UpstreamClientError(resp.status, body, resp.header("content-type", "application/json"))
        if failure_kind(resp.status, body) == GENERATION:
            return self.fail(leg, GENERATION_ERROR, f"HTTP {resp.status}: vLLM finished the request with an error "
                                                    "(where the leg loads KV: the KV load failed)")
        return self.fail(leg, f"http_{resp.status}", f"HTTP {resp.status}: {error_message(body)}")

    async def json_answer(self, leg: Leg, resp: UpstreamResponse, timeout_s: float) -> tuple[dict, float]:
        """A non-streamed leg's whole JSON answer (prefill's, or decode's KV-loading leg's), and
        when it came; the leg ends with it."""
        try:
            await self._answer_head(leg, resp, timeout_s)
            if resp.status != 200:
                raise await self._read_error(leg, resp)
            try:
                with self._as_leg_failure(leg, timeout_s):
                    raw = await resp.read()
            finally:
                resp.close()
            answered_at = time.perf_counter()
            try:
                answer = json.loads(raw)
            except ValueError:
                answer = None
            if not isinstance(answer, dict):
                raise self.fail(leg, "bad_answer", f"answer is not a JSON object: {raw[:100]!r}")
            leg.end()
            return answer, answered_at
        except asyncio.CancelledError:
            leg.end(cancelled=True)
            raise

    async def decode_head(self, leg: Leg, resp: UpstreamResponse, stream: bool) -> DecodeHead:
        """Decode's answer up to its first token (streaming), or whole (not streamed: the client
        sees none of it before it is whole); a failure before that is a LegFailure, which another
        attempt may fix. From a stream's first token on, only a silence of stream_idle_s ends it."""
        timeouts = self.config.timeouts
        try:
            await self._answer_head(leg, resp, timeouts.decode_s)
            if resp.status != 200:
                raise await self._read_error(leg, resp)
            content_type = resp.header("content-type", "application/json")
            if not stream:
                with self._as_leg_failure(leg, timeouts.decode_s):
                    whole = await resp.read()
                leg.end()  # a whole answer is kept even if the instance left rotation meanwhile
                return DecodeHead(leg, None, whole, content_type, time.perf_counter())
            held = bytearray()
            scanned = 0
            while True:
                chunk = await resp.readany()
                if not chunk:  # ended before any token: hand over what came, the client sees it as is
                    resp.release()
                    leg.answered()
                    return DecodeHead(leg, None, bytes(held), content_type, time.perf_counter())
                held += chunk
                while (end := held.find(b"\n\n", scanned)) >= 0:
                    event = bytes(held[scanned:end])
                    scanned = end + 2
                    kind = classify_event(event)
                    if kind == "error":
                        failure = event_failure_kind(event)
                        if failure == GENERATION:  # e.g. the KV load failed
                            raise self.fail(
                                leg,
                                GENERATION_ERROR,
                                "vLLM finished the request with an error before the "
                                "first token (where the leg loads KV: the KV load failed)",
                            )
                        if failure != CLIENT:
                            raise self.fail(
                                leg, "stream_error", f"stream error before the first token: {error_message(event)}"
                            )
                        # the request's own fault (vLLM's stream says so with a 4xx code): the client's to see, as is
                    if kind != "other":
                        resp.limit_silence(timeouts.stream_idle_s)
                        leg.answered()
                        return DecodeHead(leg, resp, bytes(held), content_type, time.perf_counter())
        except asyncio.TimeoutError:
            raise self.fail(leg, "timeout", f"no first token within {timeouts.decode_s:g} s") from None
        except LeftRotation as exc:
            raise self.fail(leg, "left_rotation", str(exc)) from None
        except UpstreamError as exc:
            raise self.fail(leg, "connect", str(exc)) from None
        except asyncio.CancelledError:
            leg.end(cancelled=True)
            raise
        finally:
            if leg.ended:
                resp.close()
