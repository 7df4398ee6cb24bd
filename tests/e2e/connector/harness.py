"""kvpush's connector in real vLLM (CPU): the legs of a request sent straight to the pooled kvpush 1P1D's
instances (tests/pool_topologies.py: `pool-kvpush`, brought up by `kvpush up`) the way the router
contract says, with the instance key a user's deployment demands."""
from __future__ import annotations

import json
import re
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from completions import complete, completion_body
from kvpush.common.kv_params import CONSUMER, PRODUCER, PushParams


def post(url: str, body: dict, headers: dict[str, str], timeout_s: float = 120) -> tuple[int, dict]:
    extra = {k: v for k, v in body.items() if k not in ("prompt", "max_tokens", "model", "temperature", "ignore_eos", "stream")}
    status, raw = complete(url, body["prompt"], body.get("stream", False), body["max_tokens"], timeout_s, headers, **extra)
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, {"error": raw}


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


def push_request(deployment, body: dict, pool: ThreadPoolExecutor) -> Legs:
    """Both legs at once, exactly as the router contract says, signed as the router signs them."""
    plan = deployment.plan
    p, d = plan.process("prefill-0"), plan.process("decode-0")
    p_engine, d_engine = f"{deployment.name}.prefill-0", f"{deployment.name}.decode-0"
    tid = uuid.uuid4().hex
    prompt = body["prompt"] if isinstance(body["prompt"], list) else None
    producer = PushParams(PRODUCER, tid, d_engine, "127.0.0.1", deployment.topo.decode[0].side_channel_port)
    consumer = PushParams(CONSUMER, tid, p_engine, "127.0.0.1", p.side_channel_ports[0], 1)
    p_body = {**body, "max_tokens": 1, "stream": False,
              "kv_transfer_params": deployment.signed_leg(producer, "prefill-0", prompt)}
    d_body = {**body, "kv_transfer_params": deployment.signed_leg(consumer, "decode-0", prompt)}
    headers = deployment.keys.headers("decode")

    def timed_post(url: str, body: dict) -> tuple[int, dict, float]:
        status, answer = post(url, body, headers)
        return status, answer, time.monotonic()

    started = time.monotonic()
    fp = pool.submit(timed_post, p.base_url, p_body)
    fd = pool.submit(timed_post, d.base_url, d_body)
    (ps, pr, _), (ds, dr, d_done) = fp.result(), fd.result()
    return Legs(ps, pr, ds, dr, time.monotonic() - started, d_done)


def wait_until_queued_on_prefill(prefill, decode, timeout_s: float = 10.0) -> None:
    """Returns once prefill has requests waiting and decode holds blocks for them: a stop or kill
    now hits registered transfers that prefill has not yet written."""
    deadline = time.monotonic() + timeout_s
    while prefill.metric("vllm:num_requests_waiting") < 1 or kv_usage(decode) <= 0:
        if time.monotonic() > deadline:
            raise AssertionError("prefill never had requests queued behind registered transfers")
        time.sleep(0.02)


def kv_usage(server) -> float:
    return server.metric("vllm:kv_cache_usage_perc")


def grep_log(server, pattern: str) -> list[str]:
    return [l for l in server.log_path.read_text(errors="replace").splitlines() if re.search(pattern, l)]


__all__ = ["Legs", "completion_body", "grep_log", "kv_usage", "post", "push_request", "wait_until_queued_on_prefill"]
