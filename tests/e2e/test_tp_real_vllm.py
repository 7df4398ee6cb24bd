"""Tensor-parallel instances for real, through kvpush's router and connector (vLLM on CPU): prefill
TP 2 -> decode TP 2, prefill TP 2 -> decode TP 1 and prefill TP 1 -> decode TP 2, each pair behind a
router of its own over the four instances of the session's pooled TP deployment
(tests/pool_topologies.py `pool-tp`, brought up by `kvpush up`) on this 2-core machine (cores
shared, as the topology asks with share_cores).

Every answer equals what its decode instance answers by itself for the same prompt (decode caches no
prefixes here, so asking it first is a plain server's answer with the same model, dtype and TP), for
prompts of 1 to ~1,500 tokens, block edges included, one after the other and 16 at once; decode's
own counters show the prompts' KV came by transfer. float32: greedy answers then do not depend on
the order TP reduces in, nor on decode's batch shape."""
from __future__ import annotations

import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest

from kvpush.common.vllm_metrics import PROMPT_TOKENS_BY_SOURCE, metric_sum
from kvpush.deploy.plan.plan import router_config
from completions import answer_text, complete
from random_prompts import full_length_prompts, random_prompts
from server_process import ServerProcess

POOLED = "pool-tp"  # tests/pool_topologies.py: p2, p1 -> d2, d1 (shared with the TP rank-kill test)
ROUTER_PORTS = {("p2", "d2"): 19030, ("p2", "d1"): 19031, ("p1", "d2"): 19032}
MAX_TOKENS = 10
EDGES = [1, 2, 127, 128, 129, 255, 256, 257, 1500]  # around vLLM's 128-token CPU blocks, and the longest
PAIRS = list(ROUTER_PORTS)


def text_of(url: str, prompt: list[int], headers: dict[str, str] | None = None, logs=lambda: "") -> str:
    status, raw = complete(url, prompt, max_tokens=MAX_TOKENS, headers=headers)
    assert status == 200, f"{len(prompt)}-token prompt: {raw[:500]}\n{logs()}"
    return answer_text(status, raw)


@dataclass
class Deployment:
    instances: dict  # name -> tests/deployment_pool.py Member
    routers: dict[tuple[str, str], ServerProcess]
    instance_headers: dict[str, str]  # the instance key, for asking decode by itself

    def external_kv_tokens(self, decode: str) -> float:
        return metric_sum(self.instances[decode].metrics(), PROMPT_TOKENS_BY_SOURCE, source="external_kv_transfer") or 0.0


@pytest.fixture(scope="module")
def deployment(pool, tmp_path_factory):
    """The pooled TP deployment (`up`), and a router per pair: the deployment's own router
    configuration (instance key included) with that pair's instances alone, on a port of its own."""
    pooled = pool.ready(POOLED)
    workdir = tmp_path_factory.mktemp("tp-routers")
    routers: dict[tuple[str, str], ServerProcess] = {}
    try:
        full = router_config(pooled.topo)
        for (p, d), port in ROUTER_PORTS.items():
            # this module is about the KV's path, not about ejection: a healthy instance starved of CPU
            # for a while must stay in rotation, or the router sends its requests around it
            config = full.model_copy(update={"port": port, "eject_after_failures": 5,
                                             "prefill": [u for u in full.prefill if u.name == p],
                                             "decode": [u for u in full.decode if u.name == d]})
            path = workdir / f"router-{p}-{d}.json"
            path.write_text(config.model_dump_json())
            routers[(p, d)] = ServerProcess(f"router-{p}-{d}", [sys.executable, "-m", "kvpush.router", "--config", str(path)],
                                            {}, f"http://127.0.0.1:{port}", workdir)
        for server in routers.values():
            server.wait_healthy(timeout_s=120)
        dep = Deployment({n: pooled[n] for n in ("p2", "p1", "d2", "d1")}, routers, pooled.keys.headers("decode"))
        for router in routers.values():  # the routers probe instances from their start: wait until both are in
            deadline = time.monotonic() + 60
            while metric_sum(router.metrics(), "kvpush_router_instance_in_rotation") != 2:
                assert time.monotonic() < deadline, f"{router.name} never had both instances in rotation"
                time.sleep(0.2)
        for router in routers.values():
            # as `kvpush up` does: one request per pair connects every prefill rank to the decode
            # ranks it writes into. A rank's first WRITE completes only once the decode process has
            # run, which 8 pinned processes on 2 cores can delay past decode's patience; the router
            # then has decode compute the prompt, which the tests below count as a failure.
            text_of(router.url, full_length_prompts(1, 300, seed=99)[0])
        yield dep
    finally:
        for server in routers.values():
            server.kill()


def check_answers(deployment: Deployment, pair: tuple[str, str], prompts: list[list[int]], concurrency: int) -> None:
    p, d = pair
    decode = deployment.instances[d].url
    expected = [text_of(decode, prompt, deployment.instance_headers) for prompt in prompts]  # decode by itself: no cache
    before = deployment.external_kv_tokens(d)
    router = deployment.routers[pair]
    fallbacks_before = metric_sum(router.metrics(), "kvpush_router_fallbacks_total")

    def logs() -> str:  # what the instances and the router said, for a failed request
        return "\n".join(f"--- {server.name}\n{server.tail(30)}" for server in (deployment.instances[p], deployment.instances[d], router))

    with ThreadPoolExecutor(concurrency) as pool:
        got = list(pool.map(lambda prompt: text_of(router.url, prompt, logs=logs), prompts))
    moved = deployment.external_kv_tokens(d) - before
    wrong = [(len(prompts[i]), got[i], expected[i]) for i in range(len(prompts)) if got[i] != expected[i]]
    assert not wrong, f"P {p} -> D {d}: (prompt tokens, through the router, decode alone) differ: {wrong}"
    assert metric_sum(router.metrics(), "kvpush_router_fallbacks_total") == fallbacks_before, logs()
    tokens = sum(len(prompt) for prompt in prompts)
    # vLLM may recompute each prompt's last token on decode; every other prompt token came by transfer
    assert tokens - len(prompts) <= moved <= tokens, f"P {p} -> D {d}: {moved:g} of {tokens} prompt tokens came by transfer\n{logs()}"


@pytest.mark.timeout(900)
@pytest.mark.parametrize("pair", PAIRS, ids=lambda pair: f"P-{pair[0]}-to-D-{pair[1]}")
def test_answers_equal_decode_alone_for_prompts_at_block_edges_one_at_a_time(deployment, pair):
    seed = PAIRS.index(pair)
    prompts = [full_length_prompts(1, length, seed=100 * seed + i)[0] for i, length in enumerate(EDGES)]
    prompts += random_prompts(12 + 4, 1500, seed=20 + seed)[12:]  # and a few lengths at random
    check_answers(deployment, pair, prompts, concurrency=1)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("pair", PAIRS, ids=lambda pair: f"P-{pair[0]}-to-D-{pair[1]}")
def test_sixteen_at_once(deployment, pair):
    prompts = random_prompts(16 + 12, 1500, seed=30 + PAIRS.index(pair))[12:]  # random lengths up to 1,500
    check_answers(deployment, pair, prompts, concurrency=16)
