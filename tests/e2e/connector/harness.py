"""Real vLLM (CPU) prefill/decode servers with kvpush's connector, for the connector's e2e tests.

Servers are started from `deploy.plan.build_plan` of a test topology (argv and env exactly as
`kvpush up` would use them), in their own process groups, and always killed at the end.
The two legs of a request are sent the way the router contract says.
"""
from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from kvpush.deploy.plan.plan import build_plan
from e2e_instances import KV_CACHE_GIB
from plan_secrets import write_secret_files
from server_process import ServerProcess
from kvpush.deploy.lifecycle.tiny_model import make_tiny_model
from kvpush.deploy.topology.topology import TinyModelSpec, parse_topology

LATE_WRITE_HOLD_S = 4  # short, so a test can watch held blocks come back
PORTS = {"prefill_http": 17100, "decode_http": 17101, "prefill_side": 17200, "decode_side": 17210, "router": 17000}

# float32, not the templates' bf16: the random-weight model's logits are near ties, and bf16's
# rounding flips some greedy picks with decode's batch shape; in float32 every answer can be
# compared exactly, also under concurrent load. (This AVX2 CPU also prefills float32 faster.)
TOPOLOGY = """
name: kvpush-connector-e2e
platform: cpu
model: {{path: {model}, served_name: tiny, max_model_len: 2048, enforce_eager: true, dtype: float32}}
connector: {{type: kvpush, backend: UCX, transfer_timeout_s: 5, extra_config: {{late_write_hold_s: {hold_s}}}}}
hosts:
  local: {{address: 127.0.0.1, workdir: {workdir}}}
prefill: [{{cpu_cores: "0", kv_cache_gib: {kv_cache_gib}, http_port: {prefill_http}, side_channel_port: {prefill_side}}}]
decode: [{{cpu_cores: "1", kv_cache_gib: {kv_cache_gib}, http_port: {decode_http}, side_channel_port: {decode_side}}}]
router: {{port: {router}}}
env: {{UCX_MODULES: "^ib", UCX_MEM_EVENTS: "no", VLLM_LOGGING_LEVEL: "DEBUG"}}
"""


def deployment_plan(model_dir: Path, workdir: Path):
    topo = parse_topology(TOPOLOGY.format(model=model_dir, workdir=workdir, hold_s=LATE_WRITE_HOLD_S,
                                          kv_cache_gib=KV_CACHE_GIB, **PORTS))
    plan = build_plan(topo)
    write_secret_files(plan)  # the connector authenticates its side channel with the deployment's key
    return topo, plan


def ensure_model(model_dir: Path) -> Path:
    make_tiny_model(model_dir, TinyModelSpec(seed=0))
    return model_dir


def Server(name: str, argv: list[str], env: dict[str, str], port: int, log_dir: Path) -> ServerProcess:
    return ServerProcess(name, argv, env, f"http://127.0.0.1:{port}", log_dir)


def post(url: str, body: dict, timeout_s: float = 120) -> tuple[int, dict]:
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, {"error": e.read().decode(errors="replace")}
    except (urllib.error.URLError, ConnectionError, OSError) as e:  # e.g. the server was killed
        return 0, {"error": f"{type(e).__name__}: {e}"}


def completion_body(prompt: list[int] | str, max_tokens: int) -> dict:
    return {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}


@dataclass
class Legs:
    prefill_status: int
    prefill: dict
    decode_status: int
    decode: dict
    seconds: float
    decode_done_at: float  # time.monotonic() when the decode leg answered

    @property
    def text(self) -> str | None:
        return self.decode["choices"][0]["text"] if self.decode_status == 200 else None

    @property
    def finish_reason(self) -> str | None:
        return self.decode["choices"][0]["finish_reason"] if self.decode_status == 200 else None


def push_request(prefill_url: str, decode_url: str, plan, body: dict, pool: ThreadPoolExecutor) -> Legs:
    """Both legs at once, exactly as the router contract says."""
    p = plan.process("prefill-0")
    d = plan.process("decode-0")
    p_engine, d_engine = "kvpush-connector-e2e.prefill-0", "kvpush-connector-e2e.decode-0"
    tid = uuid.uuid4().hex
    p_body = {**body, "max_tokens": 1, "stream": False,
              "kv_transfer_params": {"kvpush_role": "producer", "transfer_id": tid, "peer_engine_id": d_engine,
                                     "peer_host": "127.0.0.1", "peer_port": PORTS["decode_side"]}}
    d_body = {**body, "kv_transfer_params": {"kvpush_role": "consumer", "transfer_id": tid, "peer_engine_id": p_engine,
                                             "peer_host": "127.0.0.1", "peer_port": p.side_channel_ports[0],
                                             "peer_tp_size": 1}}
    def timed_post(url: str, body: dict) -> tuple[int, dict, float]:
        status, answer = post(url, body)
        return status, answer, time.monotonic()

    started = time.monotonic()
    fp = pool.submit(timed_post, prefill_url, p_body)
    fd = pool.submit(timed_post, decode_url, d_body)
    (ps, pr, _), (ds, dr, d_done) = fp.result(), fd.result()
    return Legs(ps, pr, ds, dr, time.monotonic() - started, d_done)


def wait_until_queued_on_prefill(prefill: Server, decode: Server, timeout_s: float = 10.0) -> None:
    """Returns once prefill has requests waiting and decode holds blocks for them: a stop or kill
    now hits registered transfers that prefill has not yet written."""
    deadline = time.monotonic() + timeout_s
    while prefill.metric("vllm:num_requests_waiting") < 1 or kv_usage(decode) <= 0:
        if time.monotonic() > deadline:
            raise AssertionError("prefill never had requests queued behind registered transfers")
        time.sleep(0.02)


def kv_usage(server: Server) -> float:
    return server.metric("vllm:kv_cache_usage_perc")


def grep_log(server: Server, pattern: str) -> list[str]:
    return [l for l in server.log_path.read_text(errors="replace").splitlines() if re.search(pattern, l)]
