"""kvpush's connector in real vLLM (CPU, tiny local model): the session's pooled kvpush 1P1D
(tests/pool_topologies.py `pool-kvpush`, brought up by `kvpush up`: instance key, deployment
secret) and the session's plain reference server (tests/reference_server.py: decode's model and
settings, no connector). Legs are sent straight to the instances as the router contract says.
The 54 sequential requests are sent once (`sequential_run`) and asserted on by the tests that need
them; the last test kills prefill, which the next user of the deployment has `up` revive.
Heavy: run under `flock /tmp/kvpush-heavy.lock python -m pytest ...`."""
from __future__ import annotations

import json
import os
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
from tokenizers import Tokenizer

from kvpush.connector.liveness import DEFAULT_SILENCE_S

sys.path.insert(0, str(Path(__file__).parent))
from harness import Legs, completion_body, grep_log, kv_usage, push_request, wait_until_queued_on_prefill  # noqa: E402
from completions import complete  # noqa: E402
from fault_helpers import instance_pids  # noqa: E402
from pool_topologies import LATE_WRITE_HOLD_S  # noqa: E402
from random_prompts import full_length_prompts, random_prompts  # noqa: E402

MAX_TOKENS = 8
pytestmark = pytest.mark.timeout(1800)
PROMPTS = {"sequential": random_prompts(54, 900, seed=1), "concurrent": random_prompts(32, 900, seed=2)}


@pytest.fixture(scope="module")
def expected(pool, reference_server) -> dict[str, list[str]]:
    """The reference's answers to PROMPTS; it loads beside the pooled deployment."""
    reference_server.start()
    deployment = pool.get("pool-kvpush")
    pool.ready("pool-kvpush")
    reference = reference_server.url_for(deployment.plan.process("decode-0"))
    answers = {}
    with ThreadPoolExecutor(4) as executor:
        for name, batch in PROMPTS.items():
            got = list(executor.map(lambda pr: complete(reference, pr, max_tokens=MAX_TOKENS), batch))
            assert all(status == 200 for status, _ in got), got
            answers[name] = [json.loads(raw)["choices"][0]["text"] for _, raw in got]
    return answers


@pytest.fixture
def cluster(pool, expected) -> dict:
    """The pooled deployment (revived by `up` if a test broke it) and what these tests send it."""
    deployment = pool.ready("pool-kvpush")
    return {"deployment": deployment, "plan": deployment.plan, "prompts": PROMPTS, "expected": expected,
            "prefill": deployment["prefill-0"], "decode": deployment["decode-0"]}


@pytest.fixture(scope="module")
def pool_of_threads():
    with ThreadPoolExecutor(128) as executor:
        yield executor


@dataclass
class SequentialRun:
    legs: list[Legs]  # of each of the 54 sequential prompts
    external_before: float  # decode's prompt tokens by source, before the run
    local_before: float
    received_before: float  # decode's kvpush pushes received, before the run


@pytest.fixture(scope="module")
def sequential_run(pool, expected, pool_of_threads) -> SequentialRun:
    """The 54 sequential P/D requests, sent once, with decode's counters before them."""
    deployment = pool.ready("pool-kvpush")
    d = deployment["decode-0"]
    before = (d.metric("vllm:prompt_tokens_by_source_total", source="external_kv_transfer"),
              d.metric("vllm:prompt_tokens_by_source_total", source="local_compute"),
              d.metric("vllm:kvpush_pushes_received_total"))
    legs = [push_request(deployment, completion_body(prompt, MAX_TOKENS), pool_of_threads) for prompt in PROMPTS["sequential"]]
    return SequentialRun(legs, *before)


def wait_kv_usage_zero(server, timeout_s: float = 10.0) -> float:
    deadline = time.monotonic() + timeout_s
    usage = kv_usage(server)
    while usage > 0 and time.monotonic() < deadline:
        time.sleep(0.2)
        usage = kv_usage(server)
    return usage


def test_greedy_outputs_equal_single_server(cluster, sequential_run):
    c = cluster
    mismatches, seconds = [], []
    for prompt, want, legs in zip(c["prompts"]["sequential"], c["expected"]["sequential"], sequential_run.legs):
        assert legs.prefill_status == 200 and legs.decode_status == 200, (legs.prefill, legs.decode)
        seconds.append(legs.seconds)
        if legs.text != want:
            mismatches.append((len(prompt), legs.text, want))
    seconds.sort()
    print(f"\n54 sequential P/D requests: latency p50 {seconds[len(seconds) // 2] * 1000:.0f} ms, max {seconds[-1] * 1000:.0f} ms")
    assert not mismatches, mismatches


def test_decode_metrics_show_external_kv(cluster, sequential_run):
    d = cluster["decode"]
    external = d.metric("vllm:prompt_tokens_by_source_total", source="external_kv_transfer") - sequential_run.external_before
    local = d.metric("vllm:prompt_tokens_by_source_total", source="local_compute") - sequential_run.local_before
    total = sum(len(p) for p in cluster["prompts"]["sequential"])
    print(f"\ndecode prompt tokens: external {external:.0f}, local {local:.0f} (of {total})")
    assert external >= 0.95 * total
    assert local <= len(cluster["prompts"]["sequential"])  # at most the one recomputed last token per request


def test_decode_computes_streamed_kv_layer_by_layer(cluster, sequential_run):
    """Prefill streams its WRITEs (CPU default). Decode reports a request received while its KV
    still lands only once vLLM has called wait_for_layer_load, the hook where each layer is waited
    for; the connector logs when it first sees that call. (With this small model a WRITE is
    usually over before decode looks, so few forward passes actually wait.)"""
    d = cluster["decode"]
    assert "vLLM calls wait_for_layer_load here" in d.log_path.read_text(errors="replace")
    deadline = time.monotonic() + 20  # connector stats reach /metrics once per stats interval
    sent = len(cluster["prompts"]["sequential"])
    while (received := d.metric("vllm:kvpush_pushes_received_total") - sequential_run.received_before) < sent \
            and time.monotonic() < deadline:
        time.sleep(1)
    waits = d.metric("vllm:kvpush_layer_wait_seconds_count")
    print(f"\ndecode: {received:.0f} pushes received, {waits:.0f} forward passes waited for streamed layers")
    assert received >= sent


def process_names_under(pid: int) -> list[str]:
    names = []
    for p in instance_pids(pid):
        try:
            if psutil.Process(p).status() != psutil.STATUS_ZOMBIE:
                names.append(psutil.Process(p).name())
        except psutil.Error:
            pass
    return names


def test_each_instance_runs_its_worker_inside_the_engine_process(cluster):
    """The plan's CPU default: no worker process behind a spinning shared-memory queue."""
    for role in ("prefill", "decode"):
        names = process_names_under(cluster[role].pid)
        assert len([n for n in names if n.startswith("VLLM::EngineCor")]) == 1, (role, names)
        assert not [n for n in names if n.startswith("VLLM::Worker")], (role, names)


def test_32_concurrent_requests_all_correct(cluster, pool_of_threads, model_dir):
    c = cluster
    started = time.monotonic()
    futures = [pool_of_threads.submit(push_request, c["deployment"], completion_body(p, MAX_TOKENS), pool_of_threads)
               for p in c["prompts"]["concurrent"]]
    results = [f.result() for f in futures]
    assert all(r.decode_status == 200 for r in results), [r.decode for r in results if r.decode_status != 200][:3]
    # In float32 (harness.TOPOLOGY) decode's batch of 32 picks the same greedy tokens as the
    # reference did in smaller batches. The first token is the one that depends on the transferred
    # KV alone; it is counted apart so that a failure says which kind of difference it was.
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    first = [tokenizer.encode(r.text).ids[:1] == tokenizer.encode(w).ids[:1]
             for r, w in zip(results, c["expected"]["concurrent"])]
    exact = sum(r.text == w for r, w in zip(results, c["expected"]["concurrent"]))
    print(f"\n32 concurrent P/D requests in {time.monotonic() - started:.1f} s: {exact}/32 identical to the "
          f"reference, {sum(first)}/32 with the identical first token")
    assert all(first) and exact == 32


def test_kv_usage_returns_to_zero(cluster, sequential_run):
    """After the sequential requests, neither side holds a block."""
    assert wait_kv_usage_zero(cluster["prefill"]) == 0
    assert wait_kv_usage_zero(cluster["decode"]) == 0


def test_a_stalled_prefill_fails_decode_fast_and_its_blocks_come_back_after_the_hold(cluster, pool_of_threads):
    """Prefill stopped (SIGSTOP) with requests in flight: decode gives up on it within
    peer_silence_s (its pings go unanswered) and fails those requests, but keeps their blocks from
    reuse, since a prefill that resumes may finish a copy it had begun. With prefill stopped for good neither its
    word nor its death comes, so the backstop (late_write_hold_s) drops its connection and lets
    the blocks go; once it resumes, its own are freed too and decode reconnects."""
    c = cluster
    prompts = full_length_prompts(16, 900, seed=4)
    futures = [pool_of_threads.submit(push_request, c["deployment"], completion_body(p, MAX_TOKENS), pool_of_threads)
               for p in prompts]
    wait_until_queued_on_prefill(c["prefill"], c["decode"])
    stopped_pids = instance_pids(c["prefill"].pid)  # the API server and its engine core, as a hung machine
    for pid in stopped_pids:
        os.kill(pid, signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        held = []
        while time.monotonic() < stopped + DEFAULT_SILENCE_S + 10 and not held:
            held = grep_log(c["decode"], "kvpush: holding the .* blocks of transfer")
            time.sleep(0.1)
        assert held, "decode held back no blocks: the stop hit nothing in flight"
        assert kv_usage(c["decode"]) > 0  # held, while decode has nothing else to do
        time.sleep(LATE_WRITE_HOLD_S)
        assert wait_kv_usage_zero(c["decode"], timeout_s=5) == 0  # back, with prefill still stopped
        print(f"\nprefill stopped: decode held the blocks of {len(held)} transfer(s), back to zero "
              f"{time.monotonic() - stopped:.1f} s after the stop")
    finally:
        for pid in stopped_pids:
            os.kill(pid, signal.SIGCONT)
    results = [f.result(timeout=60) for f in futures]
    failed = [r for r in results if r.decode_status != 200]
    # Seconds (unanswered pings), where an accepted transfer would otherwise wait minutes.
    assert failed and max(r.decode_done_at - stopped for r in failed) < DEFAULT_SILENCE_S + 5.0
    assert wait_kv_usage_zero(c["prefill"]) == 0
    after = push_request(c["deployment"], completion_body(prompts[0], MAX_TOKENS), pool_of_threads)
    assert after.decode_status == 200  # decode reconnects to the resumed prefill


def test_killing_prefill_fails_decode_requests_fast(cluster, pool_of_threads):
    """Kills prefill; the next user of the deployment has `up` revive it."""
    c = cluster
    prompts = full_length_prompts(16, 900, seed=3)
    futures = [pool_of_threads.submit(push_request, c["deployment"], completion_body(p, MAX_TOKENS), pool_of_threads)
               for p in prompts]
    wait_until_queued_on_prefill(c["prefill"], c["decode"])
    killed = time.monotonic()
    c["prefill"].kill()
    results = [f.result(timeout=30) for f in futures]
    failed = [r for r in results if r.decode_status != 200]
    assert failed, "killing P failed no request; the test did not hit in-flight transfers"
    slowest = max(r.decode_done_at - killed for r in failed)
    print(f"\nkilled P with {len(prompts)} requests sent: {len(failed)} failed, {len(results) - len(failed)} completed "
          f"before the kill; last failure reached the client {slowest * 1000:.0f} ms after the kill")
    assert slowest < 5.0  # the closed connection, not decode's 30 s no-show timeout
    assert wait_kv_usage_zero(c["decode"]) == 0
