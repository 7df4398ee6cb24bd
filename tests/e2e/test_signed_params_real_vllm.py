"""Signed kv_transfer_params against real vLLM on CPU (the pooled kvpush 1P1D, `pool-kvpush`, brought
up by `kvpush up` with its deployment secret; tests/pool_topologies.py).

Someone holding the instance key sends legs straight to the instances to make decode cache the KV
of one prompt (B) under the prefix hashes of another of the same length (A, the victim's):
- params the router never signed (unsigned, or signed with another key) are refused on both instances;
- a decode leg carrying the params the router signed for prompt B (token ids bound) is refused for A;
- legs signed without a bound prompt (as the router signs text prompts) pass the signature check,
  and prefill refuses to write B's KV into the blocks decode registered for A (their prompts' digests
  differ): decode's load fails, nothing is cached.
Each refusal is counted (vllm:kvpush_refused_transfer_params_total{reason} on the instance,
vllm:kvpush_dropped_messages_total{reason="prompt_mismatch"} on prefill). Afterwards A and B, and
other prompts, text and token ids, answer through the router exactly as the plain vLLM server does
(decode's prefix cache holds no foreign KV), and the router's own traffic is refused nothing.
Heavy: run under `flock /tmp/kvpush-heavy.lock`.
"""
from __future__ import annotations

import os
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

from completions import answer_text, complete
from kvpush.common.kv_params import CONSUMER, PRODUCER, PushParams
from random_prompts import full_length_prompts

POOLED = "pool-kvpush"
MAX_TOKENS = 8
LENGTH = 300  # over two of vLLM's CPU blocks (128 tokens): decode would cache two full blocks of A
A, B, C, D = full_length_prompts(4, LENGTH, seed=4040)
TEXTS = ["Signed parameters keep one prompt's KV from landing under another's prefix.",
         "The quick brown fox jumps over the lazy dog, again and again, until the cache is warm."]
REFUSED = "vllm:kvpush_refused_transfer_params_total"
DROPPED = "vllm:kvpush_dropped_messages_total"


@pytest.fixture(scope="module")
def deployment(pool):
    return pool.ready(POOLED)


@pytest.fixture(scope="module")
def reference(deployment, reference_server):
    url = reference_server.url_for(deployment.plan.process("decode-0"))
    return {tuple(p) if isinstance(p, list) else p: answer_text(*complete(url, p, max_tokens=MAX_TOKENS))
            for p in [A, B, C, D, *TEXTS]}


def legs(deployment, tid: str, sign) -> tuple[dict, dict]:
    """The prefill and decode params of one transfer, each made by `sign(params, instance)`."""
    p, d = deployment.plan.process("prefill-0"), deployment.plan.process("decode-0")
    producer = PushParams(PRODUCER, tid, f"{POOLED}.decode-0", "127.0.0.1", deployment.topo.decode[0].side_channel_port)
    consumer = PushParams(CONSUMER, tid, f"{POOLED}.prefill-0", "127.0.0.1", p.side_channel_ports[0])
    assert d.base_url
    return sign(producer, "prefill-0"), sign(consumer, "decode-0")


def send_pair(deployment, prefill_prompt, prefill_params, decode_prompt, decode_params) -> tuple[int, int, str]:
    """Both legs at once, straight to the instances with the instance key: (prefill status, decode status, decode body)."""
    headers = deployment.keys.headers("decode")
    p, d = deployment["prefill-0"], deployment["decode-0"]
    with ThreadPoolExecutor(2) as ex:
        fp = ex.submit(complete, p.url, prefill_prompt, False, 1, 120, headers, kv_transfer_params=prefill_params)
        fd = ex.submit(complete, d.url, decode_prompt, False, MAX_TOKENS, 120, headers, kv_transfer_params=decode_params)
        (ps, _), (ds, dbody) = fp.result(), fd.result()
    return ps, ds, dbody


def wait_metric(member, name: str, at_least: float, timeout_s: float = 30, **labels) -> float:
    """The counter once it reached `at_least` (vLLM's stats reach /metrics after the step that made them)."""
    deadline = time.monotonic() + timeout_s
    while (value := member.metric(name, **labels)) < at_least and time.monotonic() < deadline:
        time.sleep(0.2)
    return value


def counts(deployment) -> dict[str, float]:
    p, d = deployment["prefill-0"], deployment["decode-0"]
    return {"p_refused": p.metric(REFUSED), "d_refused": d.metric(REFUSED),
            "mismatch": p.metric(DROPPED, reason="prompt_mismatch")}


@pytest.mark.timeout(900)
def test_forged_and_reused_params_are_refused_and_counted(deployment):
    prefill, decode = deployment["prefill-0"], deployment["decode-0"]
    before = {(m.name, r): m.metric(REFUSED, reason=r) for m in (prefill, decode)
              for r in ("unsigned", "bad_signature", "wrong_prompt")}
    mismatch_before = prefill.metric(DROPPED, reason="prompt_mismatch")
    assert len(A) == len(B)

    # 1. unsigned: what anyone with the instance key could write
    p_params, d_params = legs(deployment, uuid.uuid4().hex, lambda params, _: params.to_dict())
    ps, ds, body = send_pair(deployment, B, p_params, A, d_params)
    assert ps == 200 and ds != 200, body[:300]  # prefill computes and sends nothing; decode's load fails
    for member in (prefill, decode):
        assert wait_metric(member, REFUSED, before[(member.name, "unsigned")] + 1, reason="unsigned") \
            == before[(member.name, "unsigned")] + 1

    # 2. signed with a key that is not the deployment's
    forged_key = os.urandom(32)
    p_params, d_params = legs(deployment, uuid.uuid4().hex,
                              lambda params, inst: params.signed(forged_key, f"{POOLED}.{inst}", int(time.time()) + 60).to_dict())
    ps, ds, body = send_pair(deployment, B, p_params, A, d_params)
    assert ps == 200 and ds != 200, body[:300]
    for member in (prefill, decode):
        assert wait_metric(member, REFUSED, before[(member.name, "bad_signature")] + 1, reason="bad_signature") \
            == before[(member.name, "bad_signature")] + 1

    # 3. the router's genuine params for prompt B (token ids bound), decode's leg reused for prompt A
    p_params, d_params = legs(deployment, uuid.uuid4().hex, lambda params, inst: deployment.signed_leg(params, inst, B))
    ps, ds, body = send_pair(deployment, B, p_params, A, d_params)
    assert ps == 200 and ds != 200, body[:300]
    assert wait_metric(decode, REFUSED, before[("decode-0", "wrong_prompt")] + 1, reason="wrong_prompt") \
        == before[("decode-0", "wrong_prompt")] + 1

    # 4. genuine params with no prompt bound (as for a text prompt): prefill and decode disagree on the prompt
    p_params, d_params = legs(deployment, uuid.uuid4().hex, lambda params, inst: deployment.signed_leg(params, inst))
    ps, ds, body = send_pair(deployment, B, p_params, A, d_params)
    assert ps == 200 and ds != 200, body[:300]
    assert wait_metric(prefill, DROPPED, mismatch_before + 1, reason="prompt_mismatch") == mismatch_before + 1
    assert "is not prefill's" in decode.tail(400)


@pytest.mark.timeout(900)
def test_router_traffic_answers_as_plain_vllm_and_is_refused_nothing(deployment, reference):
    """After the attacks decode's cache holds nothing foreign: A (whose prefix the attacks aimed at)
    and the rest answer through the router as the plain server does, their KV moved and accepted."""
    before = counts(deployment)
    retries_before = deployment.router.metric("kvpush_router_retries_total")
    headers = deployment.keys.headers("router")
    prompts = [A, B, C, D, *TEXTS]
    with ThreadPoolExecutor(3) as ex:
        results = list(ex.map(lambda p: complete(deployment.router_url, p, False, MAX_TOKENS, 180, headers), prompts))
    texts = [answer_text(status, raw) for status, raw in results]
    wrong = [i for i, (p, got) in enumerate(zip(prompts, texts))
             if got != reference[tuple(p) if isinstance(p, list) else p]]
    assert not wrong, f"prompts {wrong} differ from the plain server"
    time.sleep(2)  # any refusal would have been counted by now
    assert counts(deployment) == before
    assert deployment.router.metric("kvpush_router_retries_total") == retries_before
