"""CPU cost of signed kv_transfer_params, per request, in this process: the router's signing of
both legs of an attempt (LegSigner.sign, text and token-id prompts) and the connector's check on an instance (the
signature, and the prompt's identity it hands to the P/D agreement), by prompt length.

    python benchmarks/transfer_params_cost.py [--repeats 2000] > out.json
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time

from kvpush.common.kv_params import PRODUCER, PromptIdentity, PushParams
from kvpush.router.config import Upstream
from kvpush.router.legs_signing import LegSigner


def per_call_us(fn, repeats: int) -> float:
    """Median over 5 batches of the mean time of one call, in microseconds."""
    batches = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        batches.append((time.perf_counter() - start) / repeats * 1e6)
    return round(statistics.median(batches), 2)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=2000)
    args = parser.parse_args()
    key = os.urandom(32)
    signer = LegSigner(key, 120)
    decode = Upstream(name="d0", url="http://d", engine_id="dep.decode-0", side_channel_host="10.0.0.2", side_channel_port=5601)
    params = PushParams(PRODUCER, "a" * 32, "dep.decode-0", "10.0.0.2", 5601).to_dict()
    rows = []

    def attempt(prompt) -> None:
        """Both legs of one attempt (the prompt hashed once for both), as the router signs them."""
        signer._last = None  # a new request's prompt
        for _ in range(2):
            signer.sign({"prompt": prompt, "kv_transfer_params": dict(params)}, decode)

    for tokens in (16, 1024, 16384):
        ids = [random.randrange(10, 150_000) for _ in range(tokens)]
        text = "x" * (4 * tokens)
        signed = PushParams.parse(signer.sign({"prompt": ids, "kv_transfer_params": dict(params)}, decode)["kv_transfer_params"])
        unbound = PushParams.parse(signer.sign({"prompt": text, "kv_transfer_params": dict(params)}, decode)["kv_transfer_params"])
        now = time.time()
        rows.append({
            "prompt_tokens": tokens,
            "router_sign_attempt_text_us": per_call_us(lambda: attempt(text), args.repeats),
            "router_sign_attempt_token_ids_us": per_call_us(lambda: attempt(ids), args.repeats),
            "instance_check_bound_us": per_call_us(lambda: signed.refusal(key, "dep.decode-0", now, ids), args.repeats),
            "instance_check_unbound_us": per_call_us(lambda: unbound.refusal(key, "dep.decode-0", now, ids), args.repeats),
            "instance_prompt_identity_us": per_call_us(lambda: PromptIdentity.of(ids), args.repeats),
        })
    print(json.dumps({"cpus": os.cpu_count(), "load_avg_1m": os.getloadavg()[0], "rows": rows}))


if __name__ == "__main__":
    main()
