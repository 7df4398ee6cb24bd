"""The router end to end against in-process fake vLLM instances: protocols, streaming, failures."""
from __future__ import annotations

import asyncio
import json

import pytest
from router_harness import MODEL, deployment, eventually

from kvpush.router.config import Timeouts
from router_helpers import run, sample

COMPLETION = {"model": MODEL, "prompt": "hello", "max_tokens": 4}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}


def events(raw: bytes) -> list[str]:
    return [e for e in raw.decode().split("\n\n") if e]


# --- protocols ---------------------------------------------------------------------------------


@pytest.mark.parametrize("protocol", ["kvpush", "nixl-push", "nixl-pull", "colocated"])
@pytest.mark.parametrize("path,body", [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)])
def test_each_protocol_answers_streaming_and_not(protocol, path, body):
    async def scenario():
        async with deployment(protocol) as dep:
            status, raw = await dep.post(path, body)
            assert status == 200
            answer = json.loads(raw)
            text = answer["choices"][0].get("text") or answer["choices"][0]["message"]["content"]
            assert text == " t0 t1 t2 t3"
            status, raw = await dep.post(path, {**body, "stream": True})
            assert status == 200
            evs = events(raw)
            assert evs[-1] == "data: [DONE]" and len(evs) >= 5
            decode_legs = dep.decode[0].received
            assert len(decode_legs) == 2
            if protocol != "colocated":
                assert len(dep.prefill[0].received) == 2
                assert all(r.body["max_tokens"] == 1 and r.body["stream"] is False for r in dep.prefill[0].received)

    run(scenario())


@pytest.mark.parametrize("protocol", ["kvpush", "nixl-push", "nixl-pull"])
def test_both_legs_carry_one_request_id_that_starts_with_the_clients(protocol):
    """The instances' request ids (their logs, their traces) join a request's two legs and name the client's id."""
    async def scenario():
        async with deployment(protocol) as dep:
            status, _ = await dep.post("/v1/completions", COMPLETION, {"X-Request-Id": "bench-run1-7"})
            assert status == 200
            [p], [d] = dep.prefill[0].received, dep.decode[0].received
            assert p.headers["x-request-id"] == d.headers["x-request-id"]
            assert p.headers["x-request-id"].startswith("bench-run1-7-")

    run(scenario())


def test_streaming_passes_upstream_bytes_through_unchanged():
    async def scenario():
        async with deployment("colocated") as dep:
            for path, body in (("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)):
                streamed = {**body, "stream": True, "stream_options": {"include_usage": True}}
                headers = {"X-Request-Id": "fixed-id"}
                _, via_router = await dep.post(path, streamed, headers)
                async with dep.session.post(dep.decode[0].url + path, json=streamed, headers=headers) as resp:
                    direct = await resp.read()
                assert via_router == direct

    run(scenario())


def test_long_streams_reach_http11_and_http10_clients_whole():
    """After the first token the stream is written straight into the client's socket: framed as
    chunks for HTTP/1.1, unframed (until close) for HTTP/1.0, and byte-identical either way."""

    async def raw_request(url: str, version: str, body: bytes) -> tuple[bytes, bytes]:
        host, port = url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(f"POST /v1/completions HTTP/{version}\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(body)}\r\nX-Request-Id: fixed-id\r\nConnection: close\r\n\r\n".encode() + body)
        answer = await reader.read(-1)
        writer.close()
        head, _, rest = answer.partition(b"\r\n\r\n")
        return head, rest

    def unchunk(data: bytes) -> bytes:
        out = b""
        while True:
            size_line, _, data = data.partition(b"\r\n")
            size = int(size_line, 16)
            if not size:
                return out
            out, data = out + data[:size], data[size + 2:]

    async def scenario():
        async with deployment("colocated") as dep:
            body = json.dumps({**COMPLETION, "max_tokens": 300, "stream": True}).encode()
            async with dep.session.post(dep.decode[0].url + "/v1/completions", data=body,
                                        headers={"X-Request-Id": "fixed-id"}) as resp:
                direct = await resp.read()
            head11, rest11 = await raw_request(dep.url, "1.1", body)
            head10, rest10 = await raw_request(dep.url, "1.0", body)
            assert b"transfer-encoding: chunked" in head11.lower() and unchunk(rest11) == direct
            assert b"transfer-encoding" not in head10.lower() and rest10 == direct
            assert len(events(direct)) == 301

    run(scenario())


def test_push_protocols_send_both_legs_before_prefill_answers():
    async def scenario():
        async with deployment("kvpush") as dep:
            prefill_s = 1.0
            dep.prefill[0].behavior.first_token_delay_s = prefill_s
            status, _ = await dep.post("/v1/completions", COMPLETION)
            assert status == 200
            p, d = dep.prefill[0].received[0], dep.decode[0].received[0]
            # decode had its leg before prefill could have answered: a router that waited for
            # prefill's answer could not send it until prefill_s after prefill's leg
            assert d.at < p.at + prefill_s
            tid = p.body["kv_transfer_params"]["transfer_id"]
            assert d.body["kv_transfer_params"]["transfer_id"] == tid
            assert p.headers["x-request-id"] == d.headers["x-request-id"] == tid

    run(scenario())


def test_pull_sends_decode_after_prefill_with_its_params():
    async def scenario():
        async with deployment("nixl-pull") as dep:
            dep.prefill[0].behavior.first_token_delay_s = 0.2
            await dep.post("/v1/completions", COMPLETION)
            p, d = dep.prefill[0].received[0], dep.decode[0].received[0]
            assert d.at - p.at >= 0.2
            assert d.body["kv_transfer_params"]["remote_engine_id"] == "fake-engine"
            assert sample(await dep.metrics(), "kvpush_router_handoff_gap_seconds_count") == 1

    run(scenario())


def test_openai_client_works_unchanged():
    import openai  # a dev dependency (pyproject's [dev]); missing, it should fail, not skip

    async def scenario():
        async with deployment("kvpush") as dep:
            client = openai.AsyncOpenAI(base_url=dep.url + "/v1", api_key="unused", max_retries=0)
            done = await client.completions.create(model=MODEL, prompt="hi", max_tokens=3)
            assert done.choices[0].text == " t0 t1 t2"
            stream = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                          max_tokens=3, stream=True)
            parts = [c.choices[0].delta.content async for c in stream if c.choices and c.choices[0].delta.content]
            assert "".join(parts) == " t0 t1 t2"
            models = await client.models.list()
            assert [m.id for m in models.data] == [MODEL]
            with pytest.raises(openai.NotFoundError):
                await client.completions.create(model="nope", prompt="hi", max_tokens=3)
            await client.close()

    run(scenario())


def test_models_and_utilities_come_from_a_decode_instance():
    async def scenario():
        async with deployment("kvpush") as dep:
            async with dep.session.get(dep.url + "/v1/models") as resp:
                assert (await resp.json())["data"][0]["max_model_len"] == 2048  # vLLM's own card, not ours
            await dep.decode[0].stop()
            async with dep.session.get(dep.url + "/v1/models") as resp:  # none answers: built locally
                assert resp.status == 200 and (await resp.json())["data"][0]["id"] == MODEL
            async with dep.session.post(dep.url + "/tokenize", json={"prompt": "x"}) as resp:
                assert resp.status == 503 and "error" in await resp.json()

    run(scenario())


# --- selection ---------------------------------------------------------------------------------


def test_round_robin_spreads_over_xpyd():
    async def scenario():
        async with deployment("kvpush", n_prefill=2, n_decode=3, policy="round-robin") as dep:
            for _ in range(6):
                assert (await dep.post("/v1/completions", COMPLETION))[0] == 200
            assert [len(f.received) for f in dep.prefill] == [3, 3]
            assert [len(f.received) for f in dep.decode] == [2, 2, 2]

    run(scenario())


def test_least_loaded_avoids_an_instance_its_metrics_call_busy():
    async def scenario():
        async with deployment("kvpush", n_decode=2, policy="least-loaded", metrics_refresh_s=0.05) as dep:
            dep.decode[0].metrics_text = 'vllm:num_requests_running{engine="0"} 7.0\nvllm:num_requests_waiting{engine="0"} 3.0\n'
            await eventually(lambda: dep.router.decode.instances[0].load is not None
                             and dep.router.decode.instances[0].load.running == 7.0)
            for _ in range(4):
                await dep.post("/v1/completions", COMPLETION)
            assert [len(f.received) for f in dep.decode] == [0, 4]

    run(scenario())


def test_prefix_aware_by_default_keeps_a_chat_on_one_pair_while_other_requests_spread():
    async def scenario():
        async with deployment("kvpush", n_prefill=2, n_decode=2) as dep:
            messages = [{"role": "system", "content": "You answer in one line. " * 20}]
            for turn in range(4):
                messages = messages + [{"role": "user", "content": f"turn {turn}: tell me more " * 10}]
                assert (await dep.post("/v1/chat/completions", {**CHAT, "messages": messages}))[0] == 200
                assert (await dep.post("/v1/completions", {**COMPLETION, "prompt": f"other {turn} " * 60}))[0] == 200
                messages = messages + [{"role": "assistant", "content": f"answer {turn} " * 8}]
            chat_legs = [[r for r in f.received if "messages" in r.body] for f in dep.decode + dep.prefill]
            assert sorted(len(legs) for legs in chat_legs) == [0, 0, 4, 4]  # one prefill and one decode took every turn
            assert [len(f.received) for f in dep.decode] == [4, 4]  # the others went to the other decode
            m = await dep.metrics()
            assert sample(m, "kvpush_router_prefix_hit_length_count", role="decode", unit="chars") == 8
            assert sample(m, "kvpush_router_prompt_to_move_total", unit="chars") < sample(
                m, "kvpush_router_prompt_length_total", unit="chars")

    run(scenario())


# --- failures ----------------------------------------------------------------------------------


def test_failed_decode_is_retried_once_on_another_pair():
    async def scenario():
        async with deployment("kvpush", n_prefill=2, n_decode=2) as dep:
            dep.decode[0].behavior.fail_status = 500
            for _ in range(2):
                status, raw = await dep.post("/v1/completions", COMPLETION)
                assert status == 200, raw
            m = await dep.metrics()
            assert sample(m, "kvpush_router_retries_total", reason="http_500") == 2  # round robin: d0 first each time
            assert sample(m, "kvpush_router_leg_failures_total", instance="d0", reason="http_500") == 2
            assert sample(m, "kvpush_router_requests_total", outcome="success") == 2
            # the retry got a fresh transfer id
            first, retry = dep.decode[0].received[0], dep.decode[1].received[0]
            assert first.body["kv_transfer_params"]["transfer_id"] != retry.body["kv_transfer_params"]["transfer_id"]

    run(scenario())


def test_failing_prefill_cancels_its_decode_leg():
    async def scenario():
        async with deployment("kvpush") as dep:
            dep.prefill[0].behavior.fail_status = 500
            dep.prefill[0].behavior.first_token_delay_s = 0  # fails at once
            dep.decode[0].behavior.kv_wait_s = 5  # would wait for KV
            status, raw = await dep.post("/v1/completions", COMPLETION)
            assert status == 200  # computed by decode alone: the only prefill failed it
            await eventually(lambda: dep.decode[0].abandoned == 1)
            assert dep.router.decode.instances[0].inflight == 0

    run(scenario())


def test_failing_decode_cancels_its_prefill_leg():
    async def scenario():
        async with deployment("nixl-push") as dep:
            dep.prefill[0].behavior.first_token_delay_s = 5
            dep.decode[0].behavior.fail_status = 500  # the transfer, then decode alone
            status, _ = await dep.post("/v1/completions", COMPLETION)
            assert status == 502
            await eventually(lambda: dep.prefill[0].abandoned == 1)
            assert dep.router.prefill.instances[0].inflight == 0

    run(scenario())


@pytest.mark.parametrize("stream", [False, True])
def test_client_disconnect_cancels_both_legs(stream):
    async def scenario():
        async with deployment("kvpush") as dep:
            dep.prefill[0].behavior.first_token_delay_s = 5
            dep.decode[0].behavior.first_token_delay_s = 5
            request = asyncio.ensure_future(dep.post("/v1/completions", {**COMPLETION, "stream": stream}))
            await eventually(lambda: dep.prefill[0].received and dep.decode[0].received)
            request.cancel()
            await eventually(lambda: dep.prefill[0].abandoned == 1 and dep.decode[0].abandoned == 1)
            await eventually(lambda: "cancelled" in _outcomes(dep))
            assert dep.router.prefill.instances[0].inflight == dep.router.decode.instances[0].inflight == 0
            assert dep.router.decode.instances[0].consecutive_failures == 0  # not the instance's fault

    run(scenario())


def _outcomes(dep) -> str:
    return " ".join(s.labels["outcome"] for metric in dep.router.metrics.requests.collect()
                    for s in metric.samples if s.value > 0 and s.name.endswith("_total"))


def test_leg_timeout_gives_504():
    async def scenario():
        async with deployment("kvpush", timeouts=Timeouts(connect_s=1, prefill_s=5, decode_s=0.3)) as dep:
            dep.decode[0].behavior.hang = True
            status, raw = await dep.post("/v1/completions", COMPLETION)
            assert status == 504 and json.loads(raw)["error"]["code"] == 504
            assert sample(await dep.metrics(), "kvpush_router_retries_total", reason="timeout") == 1

    run(scenario())


def test_connection_refused_is_retried_on_the_other_decode():
    async def scenario():
        async with deployment("kvpush", n_decode=2) as dep:
            await dep.decode[0].stop()
            for _ in range(3):
                assert (await dep.post("/v1/completions", {**COMPLETION, "stream": True}))[0] == 200
            assert sample(await dep.metrics(), "kvpush_router_leg_failures_total", instance="d0", reason="connect") >= 1

    run(scenario())


def test_decode_dying_mid_stream_ends_with_an_error_event():
    async def scenario():
        async with deployment("kvpush") as dep:
            dep.decode[0].behavior.die_after_tokens = 2
            status, raw = await dep.post("/v1/completions", {**COMPLETION, "stream": True})
            assert status == 200
            evs = events(raw)
            assert evs[-1] == "data: [DONE]"
            error = json.loads(evs[-2][len("data: "):])["error"]
            assert "failed mid-stream" in error["message"] and error["code"] == 502
            assert " t1" in evs[1]  # the tokens that came before are delivered
            m = await dep.metrics()
            assert sample(m, "kvpush_router_requests_total", outcome="failed_mid_stream") == 1

    run(scenario())


def test_an_instance_answering_5xx_stays_in_rotation_and_only_failed_health_checks_take_it_out():
    async def scenario():
        async with deployment("kvpush", n_decode=2, eject_after_failures=2, probe_interval_s=0.05) as dep:
            dep.decode[0].behavior.fail_status = 500  # every generation fails, /health stays green
            for _ in range(6):
                assert (await dep.post("/v1/completions", COMPLETION))[0] == 200  # retried on d1
            d0 = dep.router.decode.instances[0]
            assert d0.in_rotation and d0.consecutive_failures == 0
            m = await dep.metrics()
            assert sample(m, "kvpush_router_leg_failures_total", instance="d0", reason="http_500") == 6  # d0 first each time
            dep.decode[0].behavior.unhealthy = True
            await eventually(lambda: not d0.in_rotation)  # two failed probes in a row
            assert sample(await dep.metrics(), "kvpush_router_instance_in_rotation", instance="d0") == 0
            before = len(dep.decode[0].received)
            for _ in range(4):
                await dep.post("/v1/completions", COMPLETION)
            assert len(dep.decode[0].received) == before  # no legs while out
            dep.decode[0].behavior = type(dep.decode[0].behavior)()  # healthy again
            await eventually(lambda: d0.in_rotation)  # /health answers 200 -> back
            for _ in range(4):
                await dep.post("/v1/completions", COMPLETION)
            assert len(dep.decode[0].received) > before

    run(scenario())


def test_an_idle_instance_whose_health_fails_leaves_rotation():
    async def scenario():
        async with deployment("kvpush", n_decode=2, eject_after_failures=2, probe_interval_s=0.05) as dep:
            dep.decode[1].behavior.unhealthy = True
            d1 = dep.router.decode.instances[1]
            await eventually(lambda: not d1.in_rotation)
            for _ in range(3):
                assert (await dep.post("/v1/completions", COMPLETION))[0] == 200
            assert not dep.decode[1].received
            dep.decode[1].behavior.unhealthy = False
            await eventually(lambda: d1.in_rotation)

    run(scenario())


def test_no_decode_in_rotation_gives_503_and_unhealthy():
    async def scenario():
        async with deployment("kvpush", eject_after_failures=1, probe_interval_s=30) as dep:
            await dep.decode[0].stop()
            status, raw = await dep.post("/v1/completions", COMPLETION)  # d0 refused, left rotation: nothing to retry on
            assert status == 503 and "Cannot connect" in json.loads(raw)["error"]["message"]
            status, raw = await dep.post("/v1/completions", COMPLETION)
            assert status == 503 and json.loads(raw)["error"]["code"] == 503
            async with dep.session.get(dep.url + "/health") as resp:
                assert resp.status == 503

    run(scenario())


def test_no_prefill_in_rotation_falls_back_to_decode_alone():
    async def scenario():
        async with deployment("kvpush", eject_after_failures=1, probe_interval_s=30) as dep:
            await dep.prefill[0].stop()
            dep.decode[0].behavior.first_token_delay_s = 0.1  # a consumer waits for its KV first
            # the first attempt's prefill leg is refused and p0 leaves rotation; the retry has no prefill
            for _ in range(2):
                assert (await dep.post("/v1/completions", COMPLETION))[0] == 200
            assert "kv_transfer_params" not in dep.decode[0].received[-1].body
            assert sample(await dep.metrics(), "kvpush_router_fallbacks_total") == 2
            async with dep.session.get(dep.url + "/health") as resp:  # serving, but degraded: not healthy
                assert resp.status == 503 and "prefill" in await resp.text()

    run(scenario())


def test_instance_loading_at_router_start_joins_rotation_once_healthy():
    async def scenario():
        async with deployment("kvpush", probe_interval_s=0.05) as dep:
            # a router started while decode was still loading: out of rotation, /health 503
            dep.decode[0].behavior.unhealthy = True
            d0 = dep.router.decode.instances[0]
            dep.router.decode.failed(d0, "health")
            dep.router.decode.failed(d0, "health")
            dep.router.decode.failed(d0, "health")
            await eventually(lambda: not d0.in_rotation)
            async with dep.session.get(dep.url + "/health") as resp:
                assert resp.status == 503 and "decode" in await resp.text()
            dep.decode[0].behavior.unhealthy = False
            await eventually(lambda: d0.in_rotation)
            async with dep.session.get(dep.url + "/health") as resp:
                assert resp.status == 200

    run(scenario())


# --- who may talk, and what is rejected ----------------------------------------------------------


def test_api_key_enforced_and_forwarded():
    async def scenario():
        async with deployment("kvpush", api_key="s3cret") as dep:
            status, raw = await dep.post("/v1/completions", COMPLETION)
            assert status == 401 and json.loads(raw) == {"error": "Unauthorized"}
            status, _ = await dep.post("/v1/completions", COMPLETION, {"Authorization": "Bearer wrong"})
            assert status == 401
            status, _ = await dep.post("/v1/completions", COMPLETION, {"Authorization": "Bearer s3cret"})
            assert status == 200
            assert dep.prefill[0].received[0].headers["authorization"] == "Bearer s3cret"
            assert dep.decode[0].received[0].headers["authorization"] == "Bearer s3cret"
            async with dep.session.get(dep.url + "/health") as resp:
                assert resp.status == 200
            async with dep.session.get(dep.url + "/v1/models") as resp:
                assert resp.status == 401

    run(scenario())


def test_bad_requests_get_openai_4xx_and_reach_no_instance():
    async def scenario():
        async with deployment("kvpush", max_prompt_chars=50) as dep:
            async with dep.session.post(dep.url + "/v1/completions", data=b"{oops") as resp:
                assert resp.status == 400
                assert (await resp.json())["error"]["type"] == "BadRequestError"
            status, raw = await dep.post("/v1/completions", {**COMPLETION, "model": "gpt-4"})
            assert status == 404 and json.loads(raw)["error"] == {
                "message": f"The model `gpt-4` does not exist. Valid aliases: {MODEL}.",
                "type": "NotFoundError", "param": "model", "code": 404}
            status, raw = await dep.post("/v1/completions", {**COMPLETION, "prompt": "x" * 51})
            assert status == 400 and "too long" in json.loads(raw)["error"]["message"]
            status, raw = await dep.post("/v1/chat/completions", {"model": MODEL})
            assert status == 400
            async with dep.session.get(dep.url + "/v1/embeddings") as resp:
                assert resp.status in (404, 405) and "error" in await resp.json()
            assert not dep.prefill[0].received and not dep.decode[0].received
            assert sample(await dep.metrics(), "kvpush_router_requests_total", outcome="client_error") == 4

    run(scenario())


def test_upstream_4xx_reaches_the_client_verbatim_without_retry():
    async def scenario():
        async with deployment("kvpush", n_decode=2) as dep:
            for fake in dep.decode:
                fake.behavior.fail_status = 400
            status, raw = await dep.post("/v1/completions", COMPLETION)
            assert status == 400 and json.loads(raw)["error"]["message"] == "fake failure"
            await eventually(lambda: dep.router.prefill.instances[0].inflight == 0)
            generating = [r for f in dep.decode for r in f.received if r.body["max_tokens"] == 4]
            assert len(generating) == 1  # not retried (the other leg is the one-token release of prefill's KV)
            assert all(i.consecutive_failures == 0 for i in dep.router.decode.instances)

    run(scenario())


def test_metrics_exposition_covers_the_request_path():
    async def scenario():
        async with deployment("kvpush") as dep:
            await dep.post("/v1/completions", {**COMPLETION, "stream": True})
            await dep.post("/v1/chat/completions", CHAT)
            async with dep.session.get(dep.url + "/metrics") as resp:
                assert resp.status == 200 and resp.content_type == "text/plain"
                m = await resp.text()
            assert sample(m, "kvpush_router_requests_total", endpoint="/v1/completions", outcome="success") == 1
            assert sample(m, "kvpush_router_requests_total", endpoint="/v1/chat/completions", outcome="success") == 1
            assert sample(m, "kvpush_router_ttft_seconds_count") == 1
            assert sample(m, "kvpush_router_own_latency_seconds_count") == 1
            assert 0 < sample(m, "kvpush_router_own_latency_seconds_sum") <= sample(m, "kvpush_router_ttft_seconds_sum")
            assert sample(m, "kvpush_router_e2e_latency_seconds_count") == 2
            assert sample(m, "kvpush_router_leg_seconds_count", leg="prefill") == 2
            assert sample(m, "kvpush_router_leg_seconds_count", leg="decode") == 2
            assert sample(m, "kvpush_router_handoff_gap_seconds_count") == 2
            assert sample(m, "kvpush_router_inflight", instance="d0", role="decode") == 0
            assert sample(m, "kvpush_router_instance_in_rotation", instance="p0", role="prefill") == 1

    run(scenario())


def test_a_leg_task_cancelled_before_its_first_step_ends_its_leg_and_closes_its_answer():
    from kvpush.router.attempts import Attempts

    class Stub:
        def __init__(self):
            self.calls = []

        def end(self, failure=None, cancelled=False):
            self.calls.append(("end", cancelled))

        def close(self):
            self.calls.append(("close",))

    async def scenario():
        leg, sent = Stub(), Stub()
        ran = []

        async def body():
            ran.append(True)

        task = Attempts._leg_task(body(), leg, sent)
        task.cancel()  # before the loop ran its first step: body() never starts
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0)  # done callbacks run on the next loop turn
        assert ran == [] and leg.calls == [("end", True)] and sent.calls == [("close",)]

        finished_leg, finished_sent = Stub(), Stub()
        done = Attempts._leg_task(body(), finished_leg, finished_sent)
        await done
        await asyncio.sleep(0)
        assert finished_leg.calls == [] and finished_sent.calls == []  # a leg that ran cleans up itself

    run(scenario())


def test_push_legs_on_pooled_connections_are_sent_without_a_connect_step():
    async def scenario():
        async with deployment("kvpush") as dep:
            loop = asyncio.get_running_loop()
            instance_ports = {int(f.url.rsplit(":", 1)[1]) for f in dep.prefill + dep.decode}
            connects = []
            original = loop.create_connection

            async def counting_create_connection(factory, host=None, port=None, **kwargs):
                if port in instance_ports:
                    connects.append(port)
                return await original(factory, host, port, **kwargs)

            loop.create_connection = counting_create_connection
            status, _ = await dep.post("/v1/completions", {**COMPLETION, "stream": True})
            assert status == 200
            await eventually(lambda: len([v for v in dep.router.upstream._idle.values() if v]) == 2)  # one per instance
            connects.clear()
            status, _ = await dep.post("/v1/completions", {**COMPLETION, "stream": True})
            assert status == 200 and connects == []  # both legs went out on pooled connections

    run(scenario())


# --- push protocols: decode's answer read inline, prefill's in a task ----------------------------


def test_failing_prefill_is_retried_and_its_decode_leg_is_cancelled_not_failed():
    async def scenario():
        async with deployment("kvpush", n_prefill=2, eject_after_failures=100) as dep:
            dep.prefill[0].behavior.fail_status = 500
            dep.decode[0].behavior.first_token_delay_s = 0.2  # waits for KV while prefill fails
            status, raw = await dep.post("/v1/completions", {**COMPLETION, "stream": True})
            assert status == 200 and events(raw)[-1] == "data: [DONE]"
            assert len(dep.decode[0].received) == 2 and len(dep.prefill[1].received) == 1  # retried on p1
            await eventually(lambda: dep.decode[0].abandoned == 1)  # the first decode leg was closed
            m = await dep.metrics()
            assert sample(m, "kvpush_router_retries_total", reason="http_500") == 1
            assert sample(m, "kvpush_router_leg_failures_total", instance="p0", reason="http_500") == 1
            assert sample(m, "kvpush_router_leg_failures_total", role="decode") == 0
            assert dep.router.decode.instances[0].consecutive_failures == 0  # not decode's fault
            assert sample(m, "kvpush_router_inflight", role="decode") == 0
            assert sample(m, "kvpush_router_inflight", role="prefill") == 0

    run(scenario())


def test_prefill_4xx_reaches_the_client_and_cancels_the_waiting_decode_leg():
    async def scenario():
        async with deployment("kvpush") as dep:
            dep.prefill[0].behavior.fail_status = 400
            dep.decode[0].behavior.first_token_delay_s = 5
            status, raw = await dep.post("/v1/completions", {**COMPLETION, "stream": True})
            assert status == 400 and json.loads(raw)["error"]["message"] == "fake failure"
            await eventually(lambda: dep.decode[0].abandoned == 1)
            assert dep.router.decode.instances[0].inflight == 0
            assert dep.router.decode.instances[0].consecutive_failures == 0

    run(scenario())


def test_prefill_failing_after_decodes_first_token_leaves_the_stream_whole():
    async def scenario():
        async with deployment("kvpush", eject_after_failures=100,
                              timeouts=Timeouts(connect_s=1, prefill_s=0.1, decode_s=5)) as dep:
            dep.prefill[0].behavior.hang = True  # times out while decode streams
            dep.decode[0].behavior.token_delay_s = 0.05
            status, raw = await dep.post("/v1/completions", {**COMPLETION, "stream": True})
            assert status == 200
            evs = events(raw)
            assert evs[-1] == "data: [DONE]" and len(evs) == 5 and "error" not in raw.decode()
            m = await dep.metrics()
            assert sample(m, "kvpush_router_requests_total", outcome="success") == 1
            assert sample(m, "kvpush_router_handoff_gap_seconds_sum") == 0  # decode's token came first
            await eventually(lambda: "prefill" in dep.router.metrics.leg_failures.collect()[0].samples[0].labels.values())
            m = await dep.metrics()
            assert sample(m, "kvpush_router_leg_failures_total", instance="p0", reason="timeout") == 1
            assert dep.router.prefill.instances[0].consecutive_failures == 0  # slow is not gone

    run(scenario())


def test_decode_failing_before_its_first_token_is_retried_while_prefill_still_runs():
    async def scenario():
        async with deployment("kvpush", n_prefill=2, n_decode=2, eject_after_failures=100) as dep:
            dep.prefill[0].behavior.first_token_delay_s = 0.3
            dep.decode[0].behavior.transfer_error = True  # an error event before any token
            status, raw = await dep.post("/v1/chat/completions", {**CHAT, "stream": True})
            assert status == 200 and events(raw)[-1] == "data: [DONE]"
            assert len(dep.decode[1].received) == 1 and len(dep.prefill[1].received) == 1
            await eventually(lambda: dep.prefill[0].abandoned == 1)  # the first attempt's prefill leg was closed
            m = await dep.metrics()
            assert sample(m, "kvpush_router_retries_total", reason="generation_error") == 1
            assert sample(m, "kvpush_router_leg_failures_total", role="prefill") == 0
            assert sample(m, "kvpush_router_handoff_gap_seconds_count") == 1  # the retry's

    run(scenario())


def test_a_prefill_leg_that_cannot_be_sent_fails_the_attempt_and_cancels_the_decode_leg_already_out():
    async def scenario():
        async with deployment("kvpush") as dep:
            dep.decode[0].behavior.kv_wait_s = 5  # would wait for KV
            prefill = dep.router.prefill.instances[0]
            prefill.upstream = prefill.upstream.model_copy(update={"url": "ftp://p0"})  # past config validation
            async with dep.session.post(dep.url + "/v1/completions", json=COMPLETION) as resp:
                assert resp.status == 200 and resp.headers["X-Kvpush-Decode-Computed-Prompt"] == "transfers_failed"
            await eventually(lambda: dep.decode[0].abandoned == 1)
            assert prefill.inflight == dep.router.decode.instances[0].inflight == 0
            assert sample(await dep.metrics(), "kvpush_router_leg_failures_total", instance="p0", reason="connect") == 1

    run(scenario())
