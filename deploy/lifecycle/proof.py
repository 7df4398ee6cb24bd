"""Proof that a deployment works: one real completion through the router that moved KV."""
from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass

from kvpush.common.errors import KvpushError
from kvpush.common.vllm_metrics import external_kv_tokens
from kvpush.deploy.plan.plan_model import Plan
from kvpush.deploy.runners import Runner

from .client import COMPLETIONS_PATH, completion_body
from .router_ready import wait_router_ready
from .secrets import AccessKeys

ROUTER_ROTATION_WAIT_S = 60.0


@dataclass
class Proof:
    answer: str
    latency_s: float
    external_kv_tokens: float


def _decode_kv_tokens(runners: dict[str, Runner], plan: Plan, keys: AccessKeys) -> float:
    total = 0.0
    for proc in plan.processes():
        if proc.role == "decode":
            url = proc.base_url + "/metrics"
            total += external_kv_tokens(
                runners[proc.host].http("GET", url, timeout=10, headers=keys.headers(proc.role)).text()
            )
    return total


def _proof_body(model: str) -> bytes:
    rng = random.Random()
    # Fresh words every time: a prefix-cache hit on decode would hide the transfer.
    prompt = " ".join(
        rng.choice(["kv", "push", "block", "cache", "token", "layer", "remote", "write"]) + str(rng.randint(0, 999))
        for _ in range(200)
    )
    return completion_body(model, prompt, max_tokens=8)


def prove_kv_transfer(runners: dict[str, Runner], plan: Plan, timeout_s: float = 120.0,
                      keys: AccessKeys = AccessKeys()) -> Proof:
    """One real completion through the router, once it is ready; decode must report prompt tokens
    received by KV transfer."""
    router = next(p for p in plan.processes() if p.role == "router")
    runner = runners[router.host]
    url = plan.router_url + COMPLETIONS_PATH
    give_up = time.monotonic() + ROUTER_ROTATION_WAIT_S
    while True:
        wait_router_ready(runner, plan.router_url, max(0.0, give_up - time.monotonic()), keys,
                          instances=plan.instance_names())
        before = _decode_kv_tokens(runners, plan, keys)
        started = time.monotonic()
        try:
            response = runner.http("POST", url, _proof_body(plan.served_model_name), timeout=timeout_s,
                                   headers=keys.headers("router"))
        except OSError as exc:
            raise KvpushError(f"proof request to the router {url} failed: {exc}; see `kvpush logs router`") from None
        latency = time.monotonic() - started
        if response.status != 200:
            raise KvpushError(
                f"proof request to the router {url} answered HTTP {response.status}: {response.text()[:200]}; see "
                "`kvpush logs`"
            )
        try:
            answer = json.loads(response.body)["choices"][0]["text"]
        except (ValueError, KeyError, IndexError):
            raise KvpushError(
                f"proof request to the router {url} answered no completion: {response.text()[:200]}"
            ) from None
        moved = _decode_kv_tokens(runners, plan, keys) - before
        if moved > 0:
            return Proof(answer, latency, moved)
        # A probe that began while an instance was still loading can take it out of rotation just
        # after the router looked ready; decode then computed the prompt itself. Look again.
        if time.monotonic() >= give_up:
            raise KvpushError(
                "the proof request was answered, but no decode instance received prompt tokens by KV transfer "
                '(vllm:prompt_tokens_by_source_total{source="external_kv_transfer"} did not grow); '
                "check the connector settings and `kvpush logs`"
            )
        time.sleep(1.0)
