"""The router in front of real vLLM on CPU (tiny local model): kvpush's push connector, vLLM's NIXL
connectors, and colocated instances.

Per protocol (kvpush, nixl-pull, nixl-push: 1P1D; colocated: one instance) the session's pooled
deployment (tests/pool_topologies.py), brought up by `kvpush up` as a user's is: deployment secret,
instance key, the router as `up` runs it. A test that kills an instance leaves it killed: the next
test that asks the pool for that deployment has `up` revive it. The session's plain vLLM server
(tests/reference_server.py: decode's model and settings, no connector) gives the reference answers:
greedy texts for random prompts, and the outcome of every request of the OpenAI conformance matrix
(tests/openai_conformance.py). Heavy: run under `flock /tmp/kvpush-heavy.lock`.
"""
from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest

from kvpush.common.vllm_metrics import PROMPT_TOKENS_BY_SOURCE, metric_sum
from completions import answer_text, complete, get
from openai_conformance import MATRIX, run_case
from random_prompts import full_length_prompts, random_prompts

MAX_TOKENS = 12
BLOCK_TOKENS = 128  # vLLM's CPU KV block
# Decode caches prefixes (several samples of one prompt share one transfer through that cache),
# so every request here has prompts of its own: a prompt sent twice would be a local cache hit the
# second time, not a transfer. Prefill does not cache. float32, as in the connector's e2e harness:
# greedy answers then do not depend on decode's batch shape.
PROMPTS = {False: random_prompts(27, 900, seed=0), True: random_prompts(27, 900, seed=1)}  # by `stream`
PROTOCOLS = ["kvpush", "nixl-pull", "nixl-push", "colocated"]


@dataclass
class Reference:
    answers: dict[bool, list[str]]  # greedy texts of PROMPTS, by `stream`
    matrix: list[tuple]  # run_case's outcome of each request of MATRIX


@pytest.fixture(scope="module")
def reference(pool, reference_server) -> Reference:
    """What the plain server answers; its settings are checked to be decode's, minus the connector."""
    url = reference_server.url_for(pool.get("pool-nixl-pull").plan.process("decode-0"))
    answers = {stream: [answer_text(*complete(url, p, stream=False, max_tokens=MAX_TOKENS), stream=False) for p in prompts]
               for stream, prompts in PROMPTS.items()}
    return Reference(answers, [run_case(url, case) for case in MATRIX])


class Deployment:
    """A pooled deployment as these tests see it: its protocol, instances and router."""

    def __init__(self, protocol: str, pooled):
        self.protocol = protocol
        self.prefill = None if protocol == "colocated" else pooled["prefill-0"]
        self.decode, self.router = pooled["decode-0"], pooled.router

    def decode_tokens(self, source: str) -> float:
        return metric_sum(get(self.decode.url + "/metrics")[1], PROMPT_TOKENS_BY_SOURCE, source=source) or 0.0

    def router_metric(self, name: str, **labels: str) -> float:
        return metric_sum(get(self.router.url + "/metrics")[1], name, **labels) or 0.0


@pytest.fixture(scope="module", params=PROTOCOLS)
def protocol(request, reference) -> str:
    return request.param


@pytest.fixture
def deployment(pool, protocol) -> Deployment:
    """The protocol's pooled deployment, healthy, with every instance in the router's rotation (`up`
    waits for that before its proof)."""
    deployment = Deployment(protocol, pool.ready(f"pool-{protocol}"))
    # The router ejects an instance it could not reach and probes it back in: a test after one that
    # killed an instance waits until `up`'s revived one is in rotation again.
    instances = 1 if protocol == "colocated" else 2
    deadline = time.monotonic() + 60
    while deployment.router_metric("kvpush_router_instance_in_rotation") < instances:
        assert time.monotonic() < deadline, "the router never put every instance back in rotation"
        time.sleep(0.2)
    return deployment


@pytest.fixture
def own_deployment(request, protocol):
    """The deployment, for a test that kills part of it (the next test's `up` revives it). A test
    asks for it only for the protocols it runs with (`runs_with`), so no deployment is started for
    a test that skips."""
    runs_with = request.node.get_closest_marker("runs_with")
    if protocol not in runs_with.args:
        pytest.skip(f"{protocol}: {runs_with.kwargs['otherwise']}")
    return request.getfixturevalue("deployment")


@pytest.mark.timeout(900)
@pytest.mark.parametrize("stream", [False, True])
def test_answers_equal_a_single_server_and_kv_came_by_transfer(deployment, reference, stream):
    if deployment.protocol == "colocated":
        pytest.skip("colocated instances transfer nothing (the conformance test covers their answers)")
    prompts = PROMPTS[stream]
    # the pooled router's counters are since its start: earlier tests (faults) add to them
    counts_before = {name: deployment.router_metric(name) for name in
                     ("kvpush_router_fallbacks_total", "kvpush_router_retries_total")}
    success_before = deployment.router_metric("kvpush_router_requests_total", outcome="success")
    external_before = deployment.decode_tokens("external_kv_transfer")
    local_before = deployment.decode_tokens("local_compute")
    with ThreadPoolExecutor(4) as pool:
        try:
            results = list(pool.map(lambda p: complete(deployment.router.url, p, stream, MAX_TOKENS), prompts))
        except TimeoutError:
            pytest.fail(f"{deployment.protocol}: a request timed out; router log:\n{deployment.router.tail(30)}\n"
                        f"decode log:\n{deployment.decode.tail(30)}\nprefill log:\n{deployment.prefill.tail(30)}")
    texts = [answer_text(status, raw, stream) for status, raw in results]
    mismatched = [i for i, (got, want) in enumerate(zip(texts, reference.answers[stream])) if got != want]
    assert not mismatched, f"{deployment.protocol}: prompts {mismatched} differ from the single server"
    external = deployment.decode_tokens("external_kv_transfer") - external_before
    local = deployment.decode_tokens("local_compute") - local_before
    prompt_tokens = sum(len(p) for p in prompts)
    # vLLM may recompute the last prompt token on decode; everything else must have come by transfer.
    assert external >= prompt_tokens - len(prompts), (external, prompt_tokens)
    assert local <= len(prompts), (local, prompt_tokens)
    assert deployment.router_metric("kvpush_router_requests_total", outcome="success") - success_before >= len(prompts)
    assert deployment.router_metric("kvpush_router_fallbacks_total") == counts_before["kvpush_router_fallbacks_total"]
    retried = [line for line in deployment.router.tail(400).splitlines() if "retrying" in line]
    assert deployment.router_metric("kvpush_router_retries_total") == counts_before["kvpush_router_retries_total"], retried


@pytest.mark.timeout(900)
def test_the_openai_api_through_the_router_answers_as_one_vllm_server(deployment, reference):
    """Every request of the conformance matrix: the same outcome as from the plain server (same
    answers and choice counts, or the same 4xx), no 5xx, nothing ejected; where the prompt's KV
    moves, decode's own counters show one transfer per prompt, however many samples."""
    moved = {}
    mismatched = []
    # the pooled router's counters are since its start: earlier tests (faults) add to them
    unanswered_before = {o: deployment.router_metric("kvpush_router_requests_total", outcome=o)
                         for o in ("failed", "failed_mid_stream", "unavailable")}
    for case, expected in zip(MATRIX, reference.matrix):
        before = {s: deployment.decode_tokens(s) for s in ("external_kv_transfer", "local_compute", "local_cache_hit")}
        got = run_case(deployment.router.url, case)
        moved[case.name] = {s: deployment.decode_tokens(s) - v for s, v in before.items()}
        if got != expected:
            mismatched.append(f"{case.name}:\n  router    {got}\n  reference {expected}")
        assert got[0] == "answer" or got[1] < 500, f"{case.name}: {got}"
    assert not mismatched, f"{deployment.protocol}:\n" + "\n".join(mismatched) + f"\nrouter log:\n{deployment.router.tail(20)}"
    refused = [f"{c.name} ({o[1]})" for c, o in zip(MATRIX, reference.matrix) if o[0] == "error"]
    print(f"\n{deployment.protocol}: {len(MATRIX)} requests as from one vLLM server, {len(refused)} of them 4xx: "
          f"{', '.join(refused)}; decode's prompt tokens by source per checked request: "
          + "; ".join(f"{c.name}: {moved[c.name]}" for c in MATRIX if c.transfer_check))
    if deployment.protocol != "colocated":
        for case in MATRIX:
            if case.transfer_check is None:
                continue
            tokens, samples = case.transfer_check
            external, local = moved[case.name]["external_kv_transfer"], moved[case.name]["local_compute"]
            prompts = len(case.args["prompt"]) if isinstance(case.args["prompt"][0], list) else 1
            # once per prompt (vLLM may recompute a prompt's last token), not once per sample
            assert tokens - prompts <= external <= tokens, (case.name, moved[case.name])
            # each sample computes at most the partial last block its prefix-cache hit leaves over
            assert local <= samples * BLOCK_TOKENS + prompts, (case.name, moved[case.name])
            if samples > 1:  # the samples read the transferred prompt from decode's prefix cache
                assert moved[case.name]["local_cache_hit"] >= samples * (tokens - BLOCK_TOKENS), (case.name, moved[case.name])
    for outcome in ("failed", "failed_mid_stream", "unavailable"):
        assert deployment.router_metric("kvpush_router_requests_total", outcome=outcome) == unanswered_before[outcome], outcome
    # no instance holds KV blocks for a request that ended, rejected ones included
    for instance in (deployment.prefill, deployment.decode):
        if instance is not None:
            deadline = time.monotonic() + 15
            while (usage := instance.metric("vllm:kv_cache_usage_perc")) and time.monotonic() < deadline:
                time.sleep(0.2)
            assert usage == 0, f"{instance.name} still holds KV blocks: usage {usage}"
    status, raw = complete(deployment.router.url, PROMPTS[False][-1], stream=False, max_tokens=MAX_TOKENS)
    assert status == 200, raw  # a plain request after the matrix: nothing was ejected
    in_rotation = deployment.router_metric("kvpush_router_instance_in_rotation")
    assert in_rotation == (1 if deployment.protocol == "colocated" else 2)


@pytest.mark.timeout(900)
@pytest.mark.runs_with("kvpush", otherwise="push's failure path: decode waits on prefill from the start")
def test_killing_prefill_mid_push_is_seen_at_once_and_every_request_still_ends(own_deployment):
    """Prefill is killed while decode holds blocks for requests whose prefill is queued or
    running. The router sees the prefill leg fail within 2 s; each request cut short is retried
    and then served by decode alone (the router's fallback) or ends with an error, never hangs;
    decode frees every block."""
    deployment = own_deployment
    prompts = full_length_prompts(12, 1500, seed=5)
    served_before = {o: deployment.router_metric("kvpush_router_requests_total", outcome=o)
                     for o in ("success", "failed", "unavailable")}
    fallbacks_before = deployment.router_metric("kvpush_router_fallbacks_total")
    leg_failures_before = deployment.router_metric("kvpush_router_leg_failures_total", instance="prefill-0")

    def one(prompt: list[int]) -> tuple[int, str, float]:
        status, raw = complete(deployment.router.url, prompt, stream=False, max_tokens=4, timeout_s=120)
        return status, raw, time.monotonic()

    with ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(one, p) for p in prompts]
        deadline = time.monotonic() + 120
        while deployment.router_metric("kvpush_router_requests_total", outcome="success") <= served_before["success"] \
                and time.monotonic() < deadline:
            time.sleep(0.02)
        killed = time.monotonic()  # one request is answered, the others are at prefill
        deployment.prefill.kill()
        while deployment.router_metric("kvpush_router_leg_failures_total", instance="prefill-0") < leg_failures_before + 1 \
                and time.monotonic() < killed + 10:
            time.sleep(0.02)
        seen = time.monotonic() - killed
        results = [f.result() for f in futures]
    last = max(ended for _, _, ended in results) - killed
    fallbacks = deployment.router_metric("kvpush_router_fallbacks_total") - fallbacks_before
    served = {o: deployment.router_metric("kvpush_router_requests_total", outcome=o) - before
              for o, before in served_before.items()}
    print(f"\nkilled prefill with {len(prompts)} requests sent: the router saw it after {seen * 1000:.0f} ms; "
          f"{served} ({fallbacks:.0f} by decode alone), the last {last:.1f} s after the kill")
    assert seen < 5.0
    assert last > 0, "every request had ended before the kill"
    assert sum(served.values()) == len(prompts)
    assert fallbacks >= 1 or served["failed"] + served["unavailable"] >= 1, "the kill cut no request short"
    assert all(status == 200 or (status >= 500 and json.loads(raw)["error"]["message"]) for status, raw, _ in results)
    deadline = time.monotonic() + 10
    while (usage := metric_sum(get(deployment.decode.url + "/metrics")[1], "vllm:kv_cache_usage_perc")) \
            and time.monotonic() < deadline:
        time.sleep(0.2)
    assert usage == 0, usage


@pytest.mark.timeout(900)
@pytest.mark.runs_with("nixl-pull", "nixl-push",
                       otherwise="colocated has no legs to cut; kvpush's decode killed under load is "
                                 "tests/e2e/test_faults_real_vllm.py::test_fault_under_load[kill-decode]")
def test_killing_decode_mid_run_ends_every_request_clearly(own_deployment):
    """Decode is killed mid-stream: every request ends with its whole answer or an error."""
    deployment = own_deployment
    prompts = full_length_prompts(6, 600, seed=7)

    def one(prompt: list[int]) -> tuple[int, str]:
        return complete(deployment.router.url, prompt, stream=True, max_tokens=400, timeout_s=120)

    with ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(one, p) for p in prompts]
        deadline = time.monotonic() + 120
        while deployment.router_metric("kvpush_router_ttft_seconds_count") < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        deployment.decode.kill()
        results = [f.result() for f in futures]
    for status, raw in results:
        if status == 200:
            assert raw.endswith("data: [DONE]\n\n"), raw[-300:]
            events = [json.loads(e[6:]) for e in raw.split("\n\n") if e.startswith("data: {")]
            complete_answer = events and events[-1].get("choices") and events[-1]["choices"][0]["finish_reason"] == "length"
            errored = any("error" in e for e in events)
            assert complete_answer or errored, raw[-300:]
        else:
            assert status >= 500 and json.loads(raw)["error"]["message"], raw[:300]
    assert sum(1 for s, raw in results if s != 200 or '"error"' in raw) >= 1  # the kill was noticed
    assert deployment.router.alive()
    status, _ = get(deployment.router.url + "/health")
    assert status in (200, 503)  # the router answers; 503 once decode-0 left rotation
    status, raw = complete(deployment.router.url, prompts[0], stream=False, max_tokens=MAX_TOKENS, timeout_s=60)
    assert status in (502, 503) and json.loads(raw)["error"]["code"] == status
    failed = sum(deployment.router_metric("kvpush_router_requests_total", outcome=o)
                 for o in ("failed", "failed_mid_stream", "unavailable"))
    assert failed >= 2
    assert deployment.router_metric("kvpush_router_leg_failures_total", instance="decode-0") >= 1
