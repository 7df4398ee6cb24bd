"""Batches and several samples through the router, against fake vLLM instances that, like the
real connectors, fail a request of several sequences carrying transfer parameters."""
from __future__ import annotations

import json

import pytest
from router_harness import MODEL, deployment, eventually

from kvpush.router.dispatch import DECODE_COMPUTED_HEADER
from router_helpers import run, sample



def stream_events(raw: bytes) -> list:
    return [json.loads(e[6:]) if e != "data: [DONE]" else "DONE" for e in raw.decode().split("\n\n") if e]


def legs(fake, with_params: bool | None = None) -> list[dict]:
    bodies = [r.body for r in fake.received if r.path.startswith("/v1/")]
    if with_params is None:
        return bodies
    return [b for b in bodies if ("kv_transfer_params" in b) == with_params]


BATCH = {"model": MODEL, "prompt": ["a", "b", "c"], "max_tokens": 2}


@pytest.mark.parametrize("protocol", ["kvpush", "nixl-push", "nixl-pull"])
def test_a_batch_is_one_transfer_per_prompt_merged_in_prompt_order(protocol):
    async def scenario():
        async with deployment(protocol, n_decode=2) as dep:
            for fake in dep.decode:
                fake.behavior.label_answers = True
            status, raw = await dep.post("/v1/completions", BATCH, {"X-Request-Id": "batch-1"})
            assert status == 200, raw
            answer = json.loads(raw)
            assert [(c["index"], c["text"]) for c in answer["choices"]] == [
                (0, "[a#0] t0 t1"), (1, "[b#0] t0 t1"), (2, "[c#0] t0 t1")]
            assert answer["usage"] == {"prompt_tokens": 12, "completion_tokens": 6, "total_tokens": 18}
            assert answer["id"] == "cmpl-batch-1" and answer["kv_transfer_params"] is None
            prefill_prompts = sorted(b["prompt"] for b in legs(dep.prefill[0]))
            assert prefill_prompts == ["a", "b", "c"]  # one prefill leg per prompt
            decode_legs = legs(dep.decode[0]) + legs(dep.decode[1])
            assert sorted(b["prompt"] for b in decode_legs) == ["a", "b", "c"]
            assert len({b["kv_transfer_params"].get("transfer_id") or b["kv_transfer_params"].get("remote_request_id")
                        or json.dumps(b["kv_transfer_params"]) for b in decode_legs}) == 3  # its own transfer each
            assert len(legs(dep.decode[0])) and len(legs(dep.decode[1]))  # pairs chosen per prompt

    run(scenario())


def test_a_streamed_batch_interleaves_by_index_and_ends_with_one_usage_chunk_and_done():
    async def scenario():
        async with deployment("kvpush", n_decode=3) as dep:
            for fake in dep.decode:
                fake.behavior.label_answers = True
                fake.behavior.token_delay_s = 0.02
            body = {**BATCH, "max_tokens": 3, "n": 2, "stream": True, "stream_options": {"include_usage": True}}
            status, raw = await dep.post("/v1/completions", body)
            assert status == 200
            evs = stream_events(raw)
            assert evs[-1] == "DONE" and evs[-2]["choices"] == []
            assert evs[-2]["usage"] == {"prompt_tokens": 12, "completion_tokens": 18, "total_tokens": 30}
            chunks = evs[:-2]
            assert len({e["id"] for e in evs[:-1]}) == 1
            texts: dict[int, str] = {}
            for e in chunks:
                for c in e["choices"]:
                    texts[c["index"]] = texts.get(c["index"], "") + c["text"]
            assert texts == {p * 2 + i: f"[{label}#{i}] t0 t1 t2" for p, label in enumerate("abc") for i in range(2)}
            order = [c["index"] // 2 for e in chunks for c in e["choices"]]
            assert order != sorted(order)  # the prompts' streams were interleaved, not concatenated

    run(scenario())


def test_one_prompts_4xx_rejects_the_batch_and_cancels_the_others():
    async def scenario():
        async with deployment("kvpush", n_decode=2) as dep:
            dep.decode[1].behavior.fail_status = 400
            dep.decode[0].behavior.first_token_delay_s = 5
            status, raw = await dep.post("/v1/completions", {**BATCH, "prompt": ["a", "b"], "stream": True})
            assert status == 400 and json.loads(raw)["error"]["message"] == "fake failure"
            await eventually(lambda: dep.decode[0].abandoned == 1)
            await eventually(lambda: all(i.inflight == 0 for i in dep.router.decode.instances + dep.router.prefill.instances))
            assert sample(await dep.metrics(), "kvpush_router_requests_total", outcome="client_error") == 1

    run(scenario())


def test_each_prompt_of_a_batch_is_retried_on_its_own():
    async def scenario():
        async with deployment("kvpush", n_decode=2) as dep:
            dep.decode[1].behavior.fail_status = 500
            dep.decode[1].behavior.fail_times = 1
            status, raw = await dep.post("/v1/completions", {**BATCH, "prompt": ["a", "b"]})
            assert status == 200 and len(json.loads(raw)["choices"]) == 2
            assert sample(await dep.metrics(), "kvpush_router_retries_total", reason="http_500") == 1
            assert sorted(b["prompt"] for d in dep.decode for b in legs(d)) == ["a", "b", "b"]  # b again, a once

    run(scenario())


def test_a_part_failing_mid_stream_ends_the_merged_stream_with_an_error_and_done():
    async def scenario():
        async with deployment("kvpush", n_decode=2) as dep:
            dep.decode[1].behavior.die_after_tokens = 1
            for fake in dep.decode:
                fake.behavior.token_delay_s = 0.02
            status, raw = await dep.post("/v1/completions", {**BATCH, "prompt": ["a", "b"], "max_tokens": 6,
                                                             "stream": True})
            assert status == 200
            evs = stream_events(raw)
            assert evs[-1] == "DONE" and "failed mid-stream" in evs[-2]["error"]["message"]
            assert sample(await dep.metrics(), "kvpush_router_requests_total", outcome="failed_mid_stream") == 1

    run(scenario())


def test_colocated_instances_get_a_batch_as_it_is():
    async def scenario():
        async with deployment("colocated") as dep:
            status, raw = await dep.post("/v1/completions", {**BATCH, "n": 2})
            assert status == 200 and len(json.loads(raw)["choices"]) == 6
            assert [b["prompt"] for b in legs(dep.decode[0])] == [["a", "b", "c"]]

    run(scenario())


# --- several samples of one prompt ---------------------------------------------------------------


@pytest.mark.parametrize("protocol", ["kvpush", "nixl-push", "nixl-pull"])
@pytest.mark.parametrize("stream", [False, True])
def test_n_samples_take_one_prefill_and_one_transfer_then_decode_samples_from_its_cache(protocol, stream):
    async def scenario():
        async with deployment(protocol, n_decode=2) as dep:
            body = {"model": MODEL, "prompt": "p", "n": 3, "max_tokens": 2, "seed": 11, "stream": stream}
            status, raw = await dep.post("/v1/completions", body)
            assert status == 200, raw
            if stream:
                indices = {c["index"] for e in stream_events(raw)[:-1] for c in e["choices"]}
            else:
                indices = {c["index"] for c in json.loads(raw)["choices"]}
            assert indices == {0, 1, 2}
            [prefill] = legs(dep.prefill[0])
            assert "n" not in prefill and prefill["max_tokens"] == 1 and prefill["stream"] is False
            served_by = [f for f in dep.decode if legs(f)]
            assert len(served_by) == 1  # the samples went where the prompt was loaded
            loading, sampling = legs(served_by[0])
            assert "kv_transfer_params" in loading and "n" not in loading and loading["max_tokens"] == 1
            assert "kv_transfer_params" not in sampling and sampling["n"] == 3 and sampling["seed"] == 11
            assert sampling["stream"] is stream and sampling["max_tokens"] == 2

    run(scenario())


def test_samples_on_a_decode_without_prefix_caching_are_computed_there_and_say_so():
    async def scenario():
        async with deployment("kvpush", probe_interval_s=0.05) as dep:
            dep.decode[0].prefix_caching = False
            d0 = dep.router.decode.instances[0]
            dep.router.decode.failed(d0, "health")
            dep.router.decode.failed(d0, "health")
            dep.router.decode.failed(d0, "health")  # out, and back in with its cache config read again
            await eventually(lambda: d0.in_rotation and d0.prefix_caching is False)
            async with dep.session.post(dep.url + "/v1/completions", json={"prompt": "p", "n": 2}) as resp:
                assert resp.status == 200 and resp.headers[DECODE_COMPUTED_HEADER] == "samples_without_prefix_caching"
            assert not legs(dep.prefill[0])  # no transfer nobody could use
            assert [("kv_transfer_params" in b, b["n"]) for b in legs(dep.decode[0])] == [(False, 2)]
            m = await dep.metrics()
            assert sample(m, "kvpush_router_decode_computed_prompts_total", reason="samples_without_prefix_caching") == 1

    run(scenario())


def test_prompt_logprobs_are_computed_by_decode_alone():
    async def scenario():
        async with deployment("nixl-pull") as dep:
            for body in ({"prompt": "p", "prompt_logprobs": 1}, {"prompt": "p", "echo": True, "logprobs": 1}):
                async with dep.session.post(dep.url + "/v1/completions", json=body) as resp:
                    assert resp.status == 200 and resp.headers[DECODE_COMPUTED_HEADER] == "prompt_logprobs"
            assert not legs(dep.prefill[0]) and not legs(dep.decode[0], with_params=True)
            assert sample(await dep.metrics(), "kvpush_router_decode_computed_prompts_total", reason="prompt_logprobs") == 2
            async with dep.session.post(dep.url + "/v1/completions", json={"prompt": "p"}) as resp:
                assert DECODE_COMPUTED_HEADER not in resp.headers  # a transfer says nothing

    run(scenario())


@pytest.mark.parametrize("protocol", ["kvpush", "nixl-push"])
def test_push_decode_rejecting_a_request_lets_prefill_push_to_a_one_token_leg(protocol):
    async def scenario():
        async with deployment(protocol) as dep:
            dep.decode[0].behavior.fail_status = 400  # e.g. stream_options without stream: prefill's leg has neither
            dep.decode[0].behavior.fail_times = 1
            dep.prefill[0].behavior.first_token_delay_s = 0.1  # still computing when decode refuses
            status, _ = await dep.post("/v1/completions", {"model": MODEL, "prompt": "p", "stream_options": {}})
            assert status == 400
            await eventually(lambda: len(legs(dep.decode[0])) == 2 and len(legs(dep.prefill[0])) == 1)
            rejected, release = legs(dep.decode[0])
            assert release["kv_transfer_params"] == rejected["kv_transfer_params"]  # the same transfer
            assert release["max_tokens"] == 1 and "stream_options" not in release
            await eventually(lambda: dep.router.prefill.instances[0].inflight == 0)
            assert dep.prefill[0].abandoned == 0  # prefill was left to finish, not cut off holding KV

    run(scenario())


def test_pull_decode_rejecting_a_request_still_reads_what_prefill_holds_for_it():
    async def scenario():
        async with deployment("nixl-pull") as dep:
            dep.decode[0].behavior.fail_status = 400  # e.g. max_tokens over the model length
            dep.decode[0].behavior.fail_times = 1
            status, raw = await dep.post("/v1/completions", {"model": MODEL, "prompt": "p", "max_tokens": 99999,
                                                             "logprobs": 2, "stream": True})
            assert status == 400 and json.loads(raw)["error"]["message"] == "fake failure"
            await eventually(lambda: len(legs(dep.decode[0])) == 2)
            rejected, release = legs(dep.decode[0])
            assert release["kv_transfer_params"] == rejected["kv_transfer_params"]  # prefill's blocks, read once
            assert release["max_tokens"] == 1 and release["stream"] is False
            await eventually(lambda: dep.router.decode.instances[0].inflight == 0)
            assert dep.router.decode.instances[0].consecutive_failures == 0

    run(scenario())
