"""The router in front of fake instances (real HTTP): each kvpush leg it sends carries parameters
signed for the instance that receives it, which that instance's check accepts; a client's own
transfer parameters never get through."""
from __future__ import annotations

import os
import time

from router_harness import deployment
from router_helpers import run

from kvpush.common.kv_params import PushParams


def key_file(tmp_path) -> tuple[bytes, str]:
    key = os.urandom(32)
    path = tmp_path / "router-params.key"
    path.write_text(key.hex() + "\n")
    path.chmod(0o600)
    return key, str(path)


def test_each_leg_is_signed_for_the_instance_that_receives_it(tmp_path):
    key, path = key_file(tmp_path)
    ids = list(range(100, 164))

    async def scenario():
        async with deployment("kvpush", transfer_params_key_file=path, transfer_params_ttl_s=30) as dep:
            forged = {"kvpush_role": "consumer", "transfer_id": "x", "peer_engine_id": "evil", "peer_host": "10.9.9.9",
                      "peer_port": 1, "signature": "00" * 32}
            for prompt in (ids, "a text prompt"):
                status, _ = await dep.post("/v1/completions", {"model": "fake", "prompt": prompt, "max_tokens": 4,
                                                               "kv_transfer_params": forged})
                assert status == 200
            now = time.time()
            for fake, engine, role in ((dep.prefill[0], "test.p0", "producer"), (dep.decode[0], "test.d0", "consumer")):
                bound, text = [PushParams.parse(r.body["kv_transfer_params"]) for r in fake.received]
                assert bound.role == text.role == role and bound.peer_engine_id != "evil"
                assert bound.refusal(key, engine, now, ids) is None
                assert bound.prompt_tokens == len(ids) and text.prompt_tokens is None
                assert text.refusal(key, engine, now, [1, 2, 3]) is None
                assert bound.refusal(key, "test.other", now, ids) == "wrong_engine"
                assert now + 25 < bound.expires <= now + 31

    run(scenario())


def test_without_a_key_file_legs_go_unsigned():
    async def scenario():
        async with deployment("kvpush") as dep:
            status, _ = await dep.post("/v1/completions", {"model": "fake", "prompt": "hi", "max_tokens": 2})
            assert status == 200
            [p] = dep.prefill[0].received
            assert "signature" not in p.body["kv_transfer_params"]

    run(scenario())
