"""Killing one TP rank of prefill mid-push (vLLM on CPU, prefill TP 2 -> decode TP 2 of the session's
pooled TP deployment, brought up by `kvpush up`): every affected
request ends on decode, answered or with a clear error, within 2 s of the kill; a request after it
is served (by kvpush's router); and decode gets every block of every rank back.

The requests under way at the kill are sent as the router would, both legs at once, but by the
test itself: what ends within 2 s is decode's side of each transfer, without the router's retries."""
from __future__ import annotations

import os
import signal
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvpush.common.kv_params import PushParams
from completions import complete
from fault_helpers import instance_pids
from random_prompts import full_length_prompts

POOLED = "pool-tp"  # tests/pool_topologies.py: its p2 (TP 2) pushes to its d2 (TP 2); transfer_timeout_s 20,
# late_write_hold_s 3. Run after tests/e2e/test_tp_real_vllm.py (tests/e2e/conftest.py): the next
# user of the deployment has `up` revive p2.


def rank_worker(instance, rank: int) -> int:
    """The PID of the instance's TP worker of this rank: vLLM titles them VLLM::Worker_TP<rank>, which
    the kernel's 15-character comm cuts before the rank, so the title is read from the command line."""
    for pid in instance_pids(instance.pid):
        try:
            if open(f"/proc/{pid}/cmdline").read().split("\0")[0].strip() == f"VLLM::Worker_TP{rank}":
                return pid
        except OSError:
            continue
    raise AssertionError(f"no TP{rank} worker under {instance.name}")


@pytest.mark.timeout(900)
def test_killing_one_prefill_rank_mid_push_ends_every_request_and_frees_every_block(pool):
    deployment = pool.ready(POOLED)
    plan, headers = deployment.plan, deployment.keys.headers("decode")
    prefill, decode, router = deployment["p2"], deployment["d2"], deployment.router
    p_port = plan.process("p2").side_channel_ports[0]
    d_port = next(spec.side_channel_port for spec in deployment.topo.decode if spec.name == "d2")

    def post(url: str, prompt: list[int], timeout_s: float = 120, max_tokens: int = 8, **extra) -> tuple[int, str]:
        return complete(url, prompt, max_tokens=max_tokens, timeout_s=timeout_s, headers=headers, **extra)

    def both_legs(prompt: list[int]) -> tuple[int, str, float]:
        tid = uuid.uuid4().hex
        producer = deployment.signed_leg(PushParams("producer", tid, f"{POOLED}.d2", "127.0.0.1", d_port, 2), "p2", prompt)
        consumer = deployment.signed_leg(PushParams("consumer", tid, f"{POOLED}.p2", "127.0.0.1", p_port, 2), "d2", prompt)
        executor.submit(post, prefill.url, prompt, 60, max_tokens=1, kv_transfer_params=producer)
        status, raw = post(decode.url, prompt, 60, kv_transfer_params=consumer)
        return status, raw, time.monotonic()

    prompts = full_length_prompts(16, 1500, seed=2)
    with ThreadPoolExecutor(2 * len(prompts)) as executor:
        status, raw, _ = both_legs(full_length_prompts(1, 300, seed=1)[0])
        assert status == 200, raw  # warm: both ranks of each side connected and a transfer went through
        futures = [executor.submit(both_legs, p) for p in prompts]
        # until prefill has requests queued and decode holds blocks for them: the kill then hits
        # transfers registered on both decode ranks that prefill has not yet (fully) written
        deadline = time.monotonic() + 60
        while prefill.metric("vllm:num_requests_waiting") < 1 or decode.metric("vllm:kv_cache_usage_perc") <= 0:
            assert time.monotonic() < deadline, "prefill never had requests queued behind registered transfers"
            time.sleep(0.02)
        victim = rank_worker(prefill, 1)
        killed = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        results = [f.result() for f in futures]
    last = max(ended for _, _, ended in results) - killed
    outcomes = [status for status, _, _ in results]
    print(f"\nkilled prefill's TP1 worker with {len(prompts)} requests under way: statuses {outcomes}; "
          f"the last ended {last:.2f} s after the kill")
    assert last < 5.0, f"a request ended {last:.1f} s after the kill"  # not at a transfer timeout
    for status, raw, _ in results:
        assert status == 200 or (status >= 500 and "error" in raw), (status, raw[:300])

    status, raw = complete(router.url, full_length_prompts(1, 200, seed=3)[0], max_tokens=8)
    assert status == 200, raw  # served after the kill (by another prefill, or by decode alone)

    deadline = time.monotonic() + 30  # the blocks of transfers given up on come back after the hold
    while (usage := decode.metric("vllm:kv_cache_usage_perc")) > 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    failed = decode.metric("vllm:kvpush_failed_transfers_total")
    print(f"decode after the kill: KV cache usage {usage}, failed transfers {failed:.0f}")
    assert usage == 0, f"decode still holds KV blocks of {usage:.1%} of its cache"
