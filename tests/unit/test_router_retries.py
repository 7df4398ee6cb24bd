"""The router's retries against in-process fake vLLM instances: until a request's first token, a
failed attempt goes to another pair, then to decode alone, within retry_deadline_s; a 502/503/504
only once no instance can answer, naming why; a request's own 4xx is never retried."""
from __future__ import annotations

import asyncio
import json

import pytest
from router_harness import MODEL, deployment

from router_helpers import run, sample

COMPLETION = {"model": MODEL, "prompt": "hello", "max_tokens": 4}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
ANSWER = " t0 t1 t2 t3"  # what the fakes answer for max_tokens 4
COMPUTED = "X-Kvpush-Decode-Computed-Prompt"


def text_of(raw: bytes, stream: bool) -> str:
    """The answer's text (completion or chat), streamed or not; fails on an error event."""
    if not stream:
        choice = json.loads(raw)["choices"][0]
        return choice.get("text") or choice["message"]["content"]
    text = ""
    for event in raw.decode().split("\n\n"):
        if not event.startswith("data: ") or event == "data: [DONE]":
            continue
        obj = json.loads(event[6:])
        assert "error" not in obj, event
        for choice in obj["choices"]:
            text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
    return text


async def post(dep, path: str, body: dict) -> tuple[int, bytes, str | None]:
    async with dep.session.post(dep.url + path, json=body) as resp:
        return resp.status, await resp.read(), resp.headers.get(COMPUTED)


ENDPOINTS = [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)]


# --- another pair ---------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path,body", ENDPOINTS)
def test_a_failed_kv_load_is_retried_on_another_prefill_and_decode_with_a_fresh_transfer(path, body, stream):
    async def scenario():
        async with deployment("kvpush", n_prefill=2, n_decode=2, eject_after_failures=100) as dep:
            dep.decode[0].behavior.transfer_error = True  # e.g. p0 went silent: d0's connector failed the transfer
            status, raw, computed = await post(dep, path, {**body, "stream": stream})  # round robin: p0, d0 first
            assert status == 200 and text_of(raw, stream) == ANSWER and computed is None
            assert [len(f.received) for f in dep.prefill + dep.decode] == [1, 1, 1, 1]
            first, retry = dep.decode[0].received[0].body, dep.decode[1].received[0].body
            assert first["kv_transfer_params"]["transfer_id"] != retry["kv_transfer_params"]["transfer_id"]
            assert retry["kv_transfer_params"]["peer_engine_id"] == "test.p1"
            m = await dep.metrics()
            assert sample(m, "kvpush_router_leg_failures_total", instance="d0", reason="generation_error") == 1
            assert sample(m, "kvpush_router_retries_total", reason="generation_error") == 1
            assert sample(m, "kvpush_router_fallbacks_total") == 0
            assert all(i.in_rotation for i in dep.router.prefill.instances + dep.router.decode.instances)

    run(scenario())


def test_a_decode_connection_failure_is_decodes_own_and_its_retry_goes_through_prefill_again():
    async def scenario():
        async with deployment("kvpush", n_decode=2, eject_after_failures=100) as dep:
            dep.decode[0].behavior.die_after_tokens = 0  # the connection drops before any token
            status, raw, _ = await post(dep, "/v1/completions", {**COMPLETION, "stream": True})
            assert status == 200 and text_of(raw, True) == ANSWER
            assert len(dep.prefill[0].received) == 2 and len(dep.decode[1].received) == 1
            assert "kv_transfer_params" in dep.decode[1].received[0].body

    run(scenario())


# --- decode alone ---------------------------------------------------------------------------------


@pytest.mark.parametrize("protocol", ["kvpush", "nixl-push", "nixl-pull"])
def test_a_single_pairs_failed_transfer_is_retried_with_decode_computing_the_prompt(protocol):
    async def scenario():
        async with deployment(protocol) as dep:
            dep.decode[0].behavior.fail_status = 503
            dep.decode[0].behavior.fail_times = 1
            status, raw, computed = await post(dep, "/v1/completions", {**COMPLETION, "stream": True})
            assert status == 200 and text_of(raw, True) == ANSWER and computed == "transfers_failed"
            # the one pair failed: the retry is decode alone
            assert len(dep.decode[0].received) == 2 and len(dep.prefill[0].received) == 1
            assert "kv_transfer_params" not in dep.decode[0].received[1].body
            m = await dep.metrics()
            assert sample(m, "kvpush_router_fallbacks_total", reason="transfers_failed") == 1
            assert sample(m, "kvpush_router_fallbacks_total", reason="no_prefill_in_rotation") == 0
            assert sample(m, "kvpush_router_decode_computed_prompts_total") == 0  # a fallback, not by design
            assert dep.router.prefill.instances[0].in_rotation and dep.router.decode.instances[0].in_rotation

    run(scenario())


def test_a_kv_load_failure_on_the_only_pair_is_answered_by_decode_computing_the_prompt():
    async def scenario():
        async with deployment("kvpush", eject_after_failures=100) as dep:
            dep.decode[0].behavior.transfer_error = True
            for path, body in ENDPOINTS:
                for stream in (False, True):
                    status, raw, computed = await post(dep, path, {**body, "stream": stream})
                    assert status == 200 and text_of(raw, stream) == ANSWER and computed == "transfers_failed"
            m = await dep.metrics()
            assert sample(m, "kvpush_router_leg_failures_total", instance="d0", reason="generation_error") == 4
            assert sample(m, "kvpush_router_fallbacks_total", reason="transfers_failed") == 4
            assert sample(m, "kvpush_router_requests_total", outcome="success") == 4

    run(scenario())


@pytest.mark.parametrize("stream", [False, True])
def test_with_every_prefill_down_decode_computes_the_prompt(stream):
    async def scenario():
        async with deployment("kvpush", n_prefill=2, n_decode=2, eject_after_failures=1, probe_interval_s=30) as dep:
            for fake in dep.prefill:
                await fake.stop()
            for fake in dep.decode:
                fake.behavior.kv_wait_s = 5  # a consumer waits for KV that never comes
            for _ in range(2):
                status, raw, computed = await post(dep, "/v1/completions", {**COMPLETION, "stream": stream})
                assert status == 200 and text_of(raw, stream) == ANSWER
                # the first request's prefill legs were refused and took both out of rotation
                assert computed == "no_prefill_in_rotation"
            assert sum("kv_transfer_params" not in r.body for f in dep.decode for r in f.received) == 2
            assert sample(await dep.metrics(), "kvpush_router_fallbacks_total", reason="no_prefill_in_rotation") == 2

    run(scenario())


def test_concurrent_requests_survive_a_dead_prefill_and_failed_loads_from_the_other():
    """The case that once failed: prefill-0 killed, its requests retried on prefill-1, whose
    transfers decode then failed (it took the busy prefill-1 for dead); nothing may fail while a
    decode can answer."""
    async def scenario():
        async with deployment("kvpush", n_prefill=2, n_decode=2, policy="least-loaded", eject_after_failures=2,
                              probe_interval_s=30) as dep:
            await dep.prefill[0].stop()
            for fake in dep.decode:
                fake.behavior.transfer_error = True
                fake.behavior.first_token_delay_s = 0.05
            bodies = [{**body, "stream": i % 2 == 1} for i in range(16) for body in [ENDPOINTS[i % 4 // 2][1]]]
            paths = [ENDPOINTS[i % 4 // 2][0] for i in range(16)]
            answers = await asyncio.gather(*(post(dep, p, b) for p, b in zip(paths, bodies)))
            for (status, raw, computed), body in zip(answers, bodies):
                assert status == 200 and text_of(raw, body["stream"]) == ANSWER, raw
                assert computed in ("transfers_failed", "no_prefill_in_rotation")
            m = await dep.metrics()
            assert sample(m, "kvpush_router_requests_total", outcome="success") == 16
            assert sample(m, "kvpush_router_fallbacks_total") == 16

    run(scenario())


@pytest.mark.parametrize("stream", [False, True])
def test_a_part_fails_only_once_every_decode_failed_computing_it_and_the_error_says_so(stream):
    async def scenario():
        async with deployment("kvpush", n_prefill=2, n_decode=2, eject_after_failures=100) as dep:
            for fake in dep.decode:
                fake.behavior.die_after_tokens = 0  # the connection drops before any token...
                fake.behavior.cut_answer_after_bytes = 10  # ...or inside a non-streamed answer
            status, raw, _ = await post(dep, "/v1/completions", {**COMPLETION, "stream": stream})
            assert status == 502, raw
            message = json.loads(raw)["error"]["message"]
            # a decode's own failure names no prefill: each decode once with a prefill, then alone
            assert [len(f.received) for f in dep.prefill] == [1, 1]
            assert [len(f.received) for f in dep.decode] == [2, 2]
            assert message.startswith("gave up after 4 attempts: no instance in rotation is left that has not "
                                      "failed it (failures: decode d0: "), message
            assert sample(await dep.metrics(), "kvpush_router_requests_total", outcome="failed") == 1

    run(scenario())


def test_with_no_decode_left_in_rotation_the_answer_is_503_naming_the_role():
    async def scenario():
        async with deployment("kvpush", n_decode=2, eject_after_failures=1, probe_interval_s=30) as dep:
            for fake in dep.decode:
                await fake.stop()
            status, raw, _ = await post(dep, "/v1/completions", COMPLETION)
            message = json.loads(raw)["error"]["message"]
            assert status == 503 and message.startswith("no decode instance in rotation (d0, d1 failed"), message

    run(scenario())


# --- the deadline ---------------------------------------------------------------------------------


def test_no_attempt_starts_after_the_retry_deadline():
    async def scenario():
        # the first failure comes 0.2 s after the request arrived, past its 0.1 s deadline
        async with deployment("kvpush", n_prefill=2, n_decode=2, eject_after_failures=100,
                              retry_deadline_s=0.1) as dep:
            for fake in dep.decode:
                fake.behavior.transfer_error = True
                fake.behavior.first_token_delay_s = 0.2
            for stream in (False, True):
                status, raw, _ = await post(dep, "/v1/completions", {**COMPLETION, "stream": stream})
                message = json.loads(raw)["error"]["message"]
                assert status == 504 and "gave up after 1 attempt: its retry_deadline_s (0.1 s) passed" in message
                assert "decode leg on instance d" in message
            assert [len(f.received) for f in dep.decode] == [1, 1]
            assert sample(await dep.metrics(), "kvpush_router_retries_total") == 0

    run(scenario())


def test_within_the_retry_deadline_the_same_failures_are_retried_until_decode_answers_alone():
    async def scenario():
        async with deployment("kvpush", n_prefill=2, n_decode=2, eject_after_failures=100) as dep:  # default: 60 s
            for fake in dep.decode:
                fake.behavior.transfer_error = True
                fake.behavior.first_token_delay_s = 0.2
            status, raw, computed = await post(dep, "/v1/completions", COMPLETION)
            assert status == 200 and text_of(raw, False) == ANSWER and computed == "transfers_failed"
            assert sample(await dep.metrics(), "kvpush_router_retries_total", reason="generation_error") == 2

    run(scenario())


# --- the request's own fault ------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("status", [400, 404, 422])
def test_a_decodes_4xx_reaches_the_client_verbatim_and_is_never_retried(status, stream):
    async def scenario():
        async with deployment("kvpush", n_prefill=2, n_decode=2) as dep:
            for fake in dep.decode:
                fake.behavior.fail_status = status
            got, raw, computed = await post(dep, "/v1/completions", {**COMPLETION, "stream": stream})
            assert got == status and json.loads(raw)["error"]["message"] == "fake failure" and computed is None
            generating = [r for f in dep.decode for r in f.received if r.body["max_tokens"] == 4]
            assert len(generating) == 1  # the other leg is the one-token release of prefill's KV
            m = await dep.metrics()
            assert sample(m, "kvpush_router_retries_total") == 0 and sample(m, "kvpush_router_fallbacks_total") == 0

    run(scenario())


def test_a_streams_error_event_with_a_4xx_code_reaches_the_client_as_vllm_sent_it():
    async def scenario():
        async with deployment("kvpush", n_prefill=2, n_decode=2) as dep:
            event = {"error": {"message": "bad value", "type": "BadRequestError", "param": None, "code": 400}}
            for fake in dep.decode:
                fake.behavior.error_event = event
            status, raw, _ = await post(dep, "/v1/completions", {**COMPLETION, "stream": True})
            assert status == 200 and raw == f"data: {json.dumps(event)}\n\ndata: [DONE]\n\n".encode()
            assert sum(len(f.received) for f in dep.decode) == 1
            assert sample(await dep.metrics(), "kvpush_router_retries_total") == 0

    run(scenario())


def test_a_streams_other_error_event_before_the_first_token_is_retried():
    async def scenario():
        async with deployment("kvpush", n_prefill=2, n_decode=2, eject_after_failures=100) as dep:
            dep.decode[0].behavior.error_event = {"error": {"message": "boom", "type": "InternalServerError",
                                                            "param": None, "code": 500}}
            status, raw, _ = await post(dep, "/v1/completions", {**COMPLETION, "stream": True})
            assert status == 200 and text_of(raw, True) == ANSWER
            m = await dep.metrics()
            assert sample(m, "kvpush_router_retries_total", reason="stream_error") == 1
            # decode's own failure: the retry may use the same prefill
            assert sample(m, "kvpush_router_leg_failures_total", role="prefill") == 0

    run(scenario())
