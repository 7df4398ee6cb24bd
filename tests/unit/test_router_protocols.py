"""Leg bodies per protocol: the exact fields each connector reads."""
from __future__ import annotations

import re

from kvpush.common.kv_params import PushParams
from kvpush.router.config import Upstream
from kvpush.router.protocols import concurrent_legs, new_transfer_id, pull_decode_leg, pull_prefill_leg

P = Upstream(name="p0", url="http://p", engine_id="dep.p0", side_channel_host="10.0.0.1", side_channel_port=5600, tp_size=2, pp_size=1)
D = Upstream(name="d0", url="http://d", engine_id="dep.d0", side_channel_host="10.0.0.2", side_channel_port=5601)


def test_kvpush_contract_exact_fields():
    body = {"model": "m", "prompt": "hi", "max_tokens": 50, "stream": True, "stream_options": {"include_usage": True}}
    legs = concurrent_legs("kvpush", body, chat=False, transfer_id="T1", prefill=P, decode=D)
    assert legs.prefill == {"model": "m", "prompt": "hi", "max_tokens": 1, "stream": False, "kv_transfer_params": {
        "kvpush_role": "producer", "transfer_id": "T1", "peer_engine_id": "dep.d0", "peer_host": "10.0.0.2", "peer_port": 5601,
        "peer_tp_size": 1}}
    assert legs.decode == {**body, "kv_transfer_params": {
        "kvpush_role": "consumer", "transfer_id": "T1", "peer_engine_id": "dep.p0", "peer_host": "10.0.0.1",
        "peer_port": 5600, "peer_tp_size": 2}}
    assert "kv_transfer_params" not in body and body["max_tokens"] == 50  # the client's body is not mutated


def test_connector_reads_what_the_router_writes():
    """The contract test: each kvpush leg the router builds parses, on the connector's side, into
    the peer at the other end of that leg."""
    legs = concurrent_legs("kvpush", {"prompt": "x"}, chat=False, transfer_id="T9", prefill=P, decode=D)
    producer = PushParams.parse(legs.prefill["kv_transfer_params"])
    consumer = PushParams.parse(legs.decode["kv_transfer_params"])
    assert producer == PushParams("producer", "T9", D.engine_id, D.side_channel_host, D.side_channel_port, D.tp_size)
    assert consumer == PushParams("consumer", "T9", P.engine_id, P.side_channel_host, P.side_channel_port, P.tp_size)


def test_chat_prefill_leg_caps_both_token_limits():
    body = {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 9}
    legs = concurrent_legs("kvpush", body, chat=True, transfer_id="T", prefill=P, decode=D)
    assert legs.prefill["max_tokens"] == 1 and legs.prefill["max_completion_tokens"] == 1
    assert legs.decode["max_completion_tokens"] == 9


def test_nixl_push_gives_decode_the_prefill_coordinates():
    legs = concurrent_legs("nixl-push", {"prompt": "x"}, chat=False, transfer_id="T", prefill=P, decode=D)
    assert legs.prefill["kv_transfer_params"] == {"do_remote_decode": True, "do_remote_prefill": False}
    assert legs.decode["kv_transfer_params"] == {
        "do_remote_decode": False, "do_remote_prefill": True, "remote_engine_id": "dep.p0",
        "remote_request_id": "cmpl-T-0", "remote_host": "10.0.0.1", "remote_port": 5600, "tp_size": 2, "pp_size": 1}
    chat = concurrent_legs("nixl-push", {"messages": []}, chat=True, transfer_id="T", prefill=P, decode=D)
    assert chat.decode["kv_transfer_params"]["remote_request_id"] == "chatcmpl-T"


def test_nixl_pull_decode_leg_carries_prefill_answer():
    prefill = pull_prefill_leg({"prompt": "x", "stream": True}, chat=False)
    assert prefill["kv_transfer_params"] == {"do_remote_decode": True, "do_remote_prefill": False}
    assert prefill["max_tokens"] == 1 and prefill["stream"] is False
    returned = {"do_remote_prefill": True, "remote_block_ids": [[1, 2]], "remote_engine_id": "e"}
    decode = pull_decode_leg({"prompt": "x", "stream": True}, {"choices": [], "kv_transfer_params": returned})
    assert decode == {"prompt": "x", "stream": True, "kv_transfer_params": returned}
    assert pull_decode_leg({"prompt": "x"}, {"choices": []}) is None


def test_transfer_ids_are_unique_per_dispatch():
    assert len({new_transfer_id() for _ in range(1000)}) == 1000


def test_a_transfer_id_starts_with_the_clients_request_id_in_the_alphabet_every_wire_takes():
    ids = {new_transfer_id("bench-1a2b-7") for _ in range(100)}
    assert len(ids) == 100 and all(re.fullmatch(r"bench-1a2b-7-[0-9a-f]{32}", i) for i in ids)
    # vLLM's NIXL connectors split request ids on ',' and ':'; kvpush's wire takes [A-Za-z0-9._:-]
    assert re.fullmatch(r"a_b_c_d_e_-[0-9a-f]{32}", new_transfer_id("a,b:c/d e\\"))
    assert new_transfer_id("x" * 256).startswith("x" * 128 + "-") and len(new_transfer_id("x" * 256)) == 128 + 33
    assert re.fullmatch(r"[0-9a-f]{32}", new_transfer_id(None)) and re.fullmatch(r"[0-9a-f]{32}", new_transfer_id(""))
