"""The router in front of real vLLM 1P1D on CPU (tiny local model), with kvpush's push connector
and vLLM's NIXL connectors.

Per protocol (kvpush, nixl-pull, nixl-push) one deployment is shared by the tests: prefill and decode started
with the argv/env of `build_plan` (prefill on core 0, decode on core 1), the router as
`python -m kvpush.router --config <the plan's router.json>`. A plain vLLM server with the same
settings gives the reference greedy answers. Heavy: run under `flock /tmp/kvpush-vllm.lock`.
"""
from __future__ import annotations

import json
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from kvpush.deploy.plan import build_plan
from kvpush.deploy.tiny_model import make_tiny_model
from kvpush.deploy.topology import TinyModelSpec, parse_topology
from kvpush.common.vllm_metrics import PROMPT_TOKENS_BY_SOURCE, metric_sum
from random_prompts import full_length_prompts, random_prompts
from server_process import ServerProcess

PORTS = {"prefill_http": 18300, "decode_http": 18301, "reference_http": 18302, "router": 18310,
         "prefill_side": 18400, "decode_side": 18410}
TOPOLOGY = """
name: router-e2e
platform: cpu
model: {{path: {model}, served_name: tiny, max_model_len: 2048, enforce_eager: true, dtype: float32,
         extra_args: ["--no-enable-prefix-caching"]}}
connector: {{type: {protocol}, backend: UCX}}
hosts:
  local: {{address: 127.0.0.1, workdir: {workdir}}}
prefill: [{{cpu_cores: "0", kv_cache_gib: 1, http_port: {prefill_http}, side_channel_port: {prefill_side}}}]
decode: [{{cpu_cores: "1", kv_cache_gib: 1, http_port: {decode_http}, side_channel_port: {decode_side}}}]
router: {{port: {router}}}
env: {{UCX_MODULES: "^ib", UCX_MEM_EVENTS: "no"}}
"""
N_PROMPTS = 54
MAX_TOKENS = 12
PROMPTS = random_prompts(N_PROMPTS, 900)
# Prefix caching is off everywhere, so a prompt sent twice is transferred twice. float32, as in the
# connector's e2e harness: greedy answers then do not depend on decode's batch shape.


def get(url: str, timeout_s: float = 10) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")


def complete(url: str, prompt: list[int], stream: bool, max_tokens: int = MAX_TOKENS, timeout_s: float = 180) -> tuple[int, str]:
    """(status, text) for a non-streaming answer; for a stream, text is the raw SSE body."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": stream}
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")


def answer_text(status: int, raw: str, stream: bool) -> str:
    assert status == 200, raw[:500]
    if not stream:
        return json.loads(raw)["choices"][0]["text"]
    events = [e[len("data: "):] for e in raw.split("\n\n") if e.startswith("data: ")]
    assert events[-1] == "[DONE]", raw[-300:]
    chunks = [json.loads(e) for e in events[:-1]]
    assert not [c for c in chunks if "error" in c], raw[-500:]
    return "".join(c["choices"][0]["text"] for c in chunks if c.get("choices"))


def make_plan(protocol: str, model: Path, workdir: Path):
    topo = parse_topology(TOPOLOGY.format(protocol=protocol, model=model, workdir=workdir, **PORTS))
    return build_plan(topo)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("model") / "tiny"
    make_tiny_model(path, TinyModelSpec(seed=0))
    return path


@pytest.fixture(scope="module")
def reference_answers(model_dir, tmp_path_factory) -> list[str]:
    """Greedy answers of one plain server with the decode server's settings, minus the connector."""
    workdir = tmp_path_factory.mktemp("reference")
    decode = make_plan("nixl-pull", model_dir, workdir).process("decode-0")
    argv = list(decode.argv)
    i = argv.index("--kv-transfer-config")
    del argv[i:i + 2]
    argv[argv.index("--port") + 1] = str(PORTS["reference_http"])
    env = {k: v for k, v in decode.env.items() if not k.startswith("VLLM_NIXL")}
    server = ServerProcess("reference", argv, env, f"http://127.0.0.1:{PORTS['reference_http']}", workdir)
    try:
        server.wait_healthy()
        return [answer_text(*complete(server.url, p, stream=False), stream=False) for p in PROMPTS]
    finally:
        server.kill()


class Deployment:
    def __init__(self, protocol: str, prefill: ServerProcess, decode: ServerProcess, router: ServerProcess):
        self.protocol, self.prefill, self.decode, self.router = protocol, prefill, decode, router

    def decode_tokens(self, source: str) -> float:
        return metric_sum(get(self.decode.url + "/metrics")[1], PROMPT_TOKENS_BY_SOURCE, source=source) or 0.0

    def router_metric(self, name: str, **labels: str) -> float:
        return metric_sum(get(self.router.url + "/metrics")[1], name, **labels) or 0.0


@pytest.fixture(scope="module", params=["kvpush", "nixl-pull", "nixl-push"])
def deployment(request, model_dir, reference_answers, tmp_path_factory):
    protocol = request.param
    workdir = tmp_path_factory.mktemp(protocol)
    plan = make_plan(protocol, model_dir, workdir)
    started: list[ServerProcess] = []
    try:
        for name in ("prefill-0", "decode-0"):
            proc = plan.process(name)
            started.append(ServerProcess(name, proc.argv, proc.env, proc.health_url.rsplit("/", 1)[0], workdir))
        router_plan = plan.process("router")
        config_file = plan.host(router_plan.host).files[0]
        config_path = workdir / "router.json"
        config = json.loads(config_file.content)
        config["upstream_api_key_file"] = None  # these instances start without `up`, so without a key
        config_path.write_text(json.dumps(config))
        started.append(ServerProcess("router", [sys.executable, "-m", "kvpush.router", "--config", str(config_path)],
                               router_plan.env, router_plan.health_url.rsplit("/", 1)[0], workdir))
        for proc in started:
            proc.wait_healthy()
        deployment = Deployment(protocol, *started)
        # The router probes instances from its start and ejects those not up yet; wait until its
        # probes have brought both back, or early requests would be served by decode alone.
        deadline = time.monotonic() + 60
        while deployment.router_metric("kvpush_router_instance_in_rotation") < 2:
            assert time.monotonic() < deadline, "router never put both instances back in rotation"
            time.sleep(0.2)
        yield deployment
    finally:
        for proc in reversed(started):
            proc.kill()


@pytest.mark.timeout(900)
@pytest.mark.parametrize("stream", [False, True])
def test_answers_equal_a_single_server_and_kv_came_by_transfer(deployment, reference_answers, stream):
    external_before = deployment.decode_tokens("external_kv_transfer")
    local_before = deployment.decode_tokens("local_compute")
    with ThreadPoolExecutor(4) as pool:
        try:
            results = list(pool.map(lambda p: complete(deployment.router.url, p, stream), PROMPTS))
        except TimeoutError:
            pytest.fail(f"{deployment.protocol}: a request timed out; router log:\n{deployment.router.tail(30)}\n"
                        f"decode log:\n{deployment.decode.tail(30)}\nprefill log:\n{deployment.prefill.tail(30)}")
    texts = [answer_text(status, raw, stream) for status, raw in results]
    mismatched = [i for i, (got, want) in enumerate(zip(texts, reference_answers)) if got != want]
    assert not mismatched, f"{deployment.protocol}: prompts {mismatched} differ from the single server"
    external = deployment.decode_tokens("external_kv_transfer") - external_before
    local = deployment.decode_tokens("local_compute") - local_before
    prompt_tokens = sum(len(p) for p in PROMPTS)
    # vLLM may recompute the last prompt token on decode; everything else must have come by transfer.
    assert external >= prompt_tokens - len(PROMPTS), (external, prompt_tokens)
    assert local <= len(PROMPTS), (local, prompt_tokens)
    assert deployment.router_metric("kvpush_router_requests_total", outcome="success") >= len(PROMPTS)
    assert deployment.router_metric("kvpush_router_fallbacks_total") == 0
    retried = [line for line in deployment.router.tail(400).splitlines() if "retrying" in line]
    assert deployment.router_metric("kvpush_router_retries_total") == 0, retried


@pytest.mark.timeout(900)
def test_killing_prefill_mid_push_is_seen_at_once_and_every_request_still_ends(deployment):
    """kvpush's last test (it kills the prefill instance) while decode holds blocks for requests
    whose prefill is queued or running. The router sees the prefill leg fail within 2 s; each
    request cut short is retried and then served by decode alone (the router's fallback) or ends
    with an error, never hangs; decode frees every block."""
    if deployment.protocol != "kvpush":
        pytest.skip("push's failure path: decode waits on prefill from the start")
    prompts = full_length_prompts(12, 1500, seed=5)
    served_before = {o: deployment.router_metric("kvpush_router_requests_total", outcome=o)
                     for o in ("success", "failed", "unavailable")}
    fallbacks_before = deployment.router_metric("kvpush_router_fallbacks_total")

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
        while deployment.router_metric("kvpush_router_leg_failures_total", instance="prefill-0") < 1 \
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
    assert seen < 2.0
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
def test_killing_decode_mid_run_ends_every_request_clearly(deployment):
    """Last test of the pull and vLLM push deployments: it kills the decode instance."""
    if deployment.protocol == "kvpush":
        pytest.skip("kvpush's deployment ended with its prefill killed")
    prompts = PROMPTS[:6]

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
    status, raw = complete(deployment.router.url, PROMPTS[0], stream=False, timeout_s=60)
    assert status in (502, 503) and json.loads(raw)["error"]["code"] == status
    failed = sum(deployment.router_metric("kvpush_router_requests_total", outcome=o)
                 for o in ("failed", "failed_mid_stream", "unavailable"))
    assert failed >= 2
    assert deployment.router_metric("kvpush_router_leg_failures_total", instance="decode-0") >= 1
