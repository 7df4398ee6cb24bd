"""The router's front: who may call what, and what no client input can do to it."""
from __future__ import annotations

import asyncio
import json

import pytest
from router_harness import MODEL, deployment, eventually

from kvpush.router.config import Timeouts

COMPLETION = {"model": MODEL, "prompt": "hello", "max_tokens": 4}
KEY = {"Authorization": "Bearer s3cret"}


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


async def raw_request(url: str, head: bytes, body: bytes = b"") -> bytes:
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(head + b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body)
    answer = await reader.read(-1)
    writer.close()
    return answer


ENDPOINTS = [("POST", "/v1/completions", COMPLETION), ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
             ("GET", "/v1/models", None), ("POST", "/tokenize", {"prompt": "x"}), ("POST", "/detokenize", {"tokens": [120]}),
             ("GET", "/version", None), ("GET", "/metrics", None), ("GET", "/v1/embeddings", None), ("GET", "/nowhere", None)]


def test_the_key_guards_every_endpoint_and_nothing_is_forwarded_without_it():
    async def scenario():
        async with deployment("kvpush", api_key="s3cret") as dep:
            for method, path, body in ENDPOINTS:
                async with dep.session.request(method, dep.url + path, json=body) as resp:
                    assert resp.status == 401 and await resp.json() == {"error": "Unauthorized"}, path
                async with dep.session.request(method, dep.url + path, json=body, headers={"Authorization": "Bearer nope"}) as resp:
                    assert resp.status == 401, path
            assert not dep.decode[0].received and not dep.prefill[0].received
            async with dep.session.get(dep.url + "/health") as resp:
                assert resp.status == 200  # open by default, for load balancers and `kvpush up`
            for method, path, body in ENDPOINTS[:7]:
                async with dep.session.request(method, dep.url + path, json=body, headers=KEY) as resp:
                    assert resp.status == 200, path
            forwarded = [r for r in dep.decode[0].received if r.path in ("/tokenize", "/version")]
            assert forwarded and all(r.headers["authorization"] == "Bearer s3cret" for r in forwarded)

    run(scenario())


def test_metrics_and_health_are_open_only_where_the_config_says():
    async def scenario():
        async with deployment("kvpush", api_key="s3cret", public_paths=["/metrics"]) as dep:
            async with dep.session.get(dep.url + "/metrics") as resp:
                assert resp.status == 200
            async with dep.session.get(dep.url + "/health") as resp:
                assert resp.status == 401

    run(scenario())


def test_the_instances_get_their_own_key_not_the_clients():
    async def scenario():
        from kvpush.router.keys import Keys
        async with deployment("kvpush", api_key="s3cret") as dep:
            dep.router.keys = Keys("s3cret", "instance-key")
            dep.router.dispatcher.legs.instance_key = "instance-key"
            assert (await dep.post("/v1/completions", COMPLETION, KEY))[0] == 200
            async with dep.session.post(dep.url + "/tokenize", json={"prompt": "x"}, headers=KEY) as resp:
                assert resp.status == 200
            seen = {r.headers.get("authorization") for f in dep.decode + dep.prefill for r in f.received}
            assert seen == {"Bearer instance-key"}

    run(scenario())


def test_undecodable_headers_and_deep_bodies_are_4xx_with_a_reason_never_500():
    async def scenario():
        async with deployment("kvpush", api_key="s3cret") as dep:
            body = json.dumps(COMPLETION).encode()
            answer = await raw_request(dep.url, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \xff\xfe\r\n", body)
            assert answer.startswith(b"HTTP/1.1 401")
            answer = await raw_request(dep.url, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer s3cret\r\n"
                                                b"X-Request-Id: \xff\xfe\r\n", body)
            assert answer.startswith(b"HTTP/1.1 400") and b"X-Request-Id must be" in answer
            deep = b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
            async with dep.session.post(dep.url + "/v1/completions", data=deep, headers=KEY) as resp:
                assert resp.status == 400 and "nests deeper" in (await resp.json())["error"]["message"]
            assert not dep.decode[0].received

    run(scenario())


@pytest.mark.parametrize("protocol,setup", [("colocated", None), ("kvpush", None), ("kvpush", "no_prefill"),
                                            ("kvpush", "samples"), ("nixl-pull", None), ("nixl-push", None)])
def test_transfer_parameters_from_a_client_never_reach_an_instance(protocol, setup):
    async def scenario():
        async with deployment(protocol, eject_after_failures=1, probe_interval_s=30) as dep:
            if setup == "no_prefill":
                await dep.prefill[0].stop()
                dep.router.prefill.failed(dep.router.prefill.instances[0], "connect")
            hostile = {"kvpush_role": "consumer", "transfer_id": "t", "peer_engine_id": "x", "peer_host": "10.9.9.9",
                       "peer_port": 1}
            body = {**COMPLETION, "kv_transfer_params": hostile, "vllm_xargs": {"kv_transfer_params": "10.9.9.9"}}
            if setup == "samples":
                body["n"] = 2
            for stream in (False, True):
                assert (await dep.post("/v1/completions", {**body, "stream": stream}))[0] == 200
            for fake in dep.prefill + dep.decode:
                for r in fake.received:
                    assert "10.9.9.9" not in json.dumps(r.body), (fake.url, r.body)
                    if protocol == "colocated" or setup == "no_prefill":
                        assert "kv_transfer_params" not in r.body

    run(scenario())


def test_a_non_streamed_answer_cut_while_read_is_run_again_since_the_client_saw_none_of_it():
    async def scenario():
        async with deployment("kvpush", n_decode=2, eject_after_failures=100) as dep:
            dep.decode[0].behavior.cut_answer_after_bytes = 10
            status, raw = await dep.post("/v1/completions", COMPLETION)
            assert status == 200 and json.loads(raw)["choices"][0]["text"] == " t0 t1 t2 t3"
            assert len(dep.decode[0].received) == len(dep.decode[1].received) == 1
            # the cut was decode's: its prefill was not blamed, the retry used it again
            assert len(dep.prefill[0].received) == 2

    run(scenario())


def test_a_stream_is_bounded_by_its_silences_not_by_its_length():
    async def scenario():
        # bounds far above the gaps between tokens, however late a loaded machine runs the event loop
        timeouts = Timeouts(connect_s=1, prefill_s=5, decode_s=2.0, stream_idle_s=2.0)
        async with deployment("kvpush", timeouts=timeouts) as dep:
            dep.decode[0].behavior.token_delay_s = 0.1  # 25 tokens: 2.5 s, past decode_s and stream_idle_s
            status, raw = await dep.post("/v1/completions", {**COMPLETION, "max_tokens": 25, "stream": True})
            assert status == 200 and raw.endswith(b"data: [DONE]\n\n") and b'"error"' not in raw
            dep.decode[0].behavior.stall_after_tokens = 3
            status, raw = await dep.post("/v1/completions", {**COMPLETION, "max_tokens": 25, "stream": True})
            assert status == 200 and raw.endswith(b"data: [DONE]\n\n")
            assert b"sent nothing for 2 s" in raw and b" t2" in raw
            d0 = dep.router.decode.instances[0]
            assert d0.in_rotation and d0.consecutive_failures == 0  # slow is not gone
            await eventually(lambda: dep.decode[0].abandoned == 1)  # the silent leg was closed

    run(scenario())
