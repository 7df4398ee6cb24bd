"""Prefill and decode agree on the prompt before a byte moves: D's REGISTER carries its prompt's
identity, P matches it with its own request's and refuses the match if they differ."""
from __future__ import annotations

import pytest

from kvpush.common.kv_params import PromptIdentity
from kvpush.connector import wire
from kvpush.connector.state import Match, Offer, ProducerState, Registration, Rejection

A = PromptIdentity.of(range(100, 140))
B = PromptIdentity.of(range(200, 240))  # another prompt of the same length


def offer(prompt, tid="t1"):
    return Offer(tid, "req", (1, 2, 3), "dep.d0", 0.0, prompt)


def registration(prompt, tid="t1"):
    return Registration(tid, "dep.d0", (7, 8), 0, 0.0, 0, prompt)


@pytest.mark.parametrize("offer_first", [True, False])
def test_same_prompt_matches_in_either_order(offer_first):
    state = ProducerState(timeout_s=5)
    first, second = (state.offer, state.register) if offer_first else (state.register, state.offer)
    first(offer(A) if offer_first else registration(A))
    result = second(registration(A) if offer_first else offer(A))
    assert isinstance(result, Match) and result.dst_blocks == (7, 8)


@pytest.mark.parametrize("offer_first", [True, False])
@pytest.mark.parametrize("theirs", [B, PromptIdentity(A.tokens, B.digest), PromptIdentity(A.tokens + 1, A.digest), None])
def test_another_prompt_is_refused_and_counted_and_frees_prefills_blocks(offer_first, theirs):
    state = ProducerState(timeout_s=5)
    if offer_first:
        state.offer(offer(A))
        result = state.register(registration(theirs))
    else:
        state.register(registration(theirs))
        result = state.offer(offer(A))
    assert isinstance(result, Rejection) and result.tell_decode and result.req_id == "req"
    assert "is not prefill's" in result.reason and state.dropped["prompt_mismatch"] == 1
    # the transfer id is spent: a second registration for it (with the right prompt) is late
    assert isinstance(state.register(registration(A)), Rejection)


def test_register_carries_the_prompts_identity_over_the_wire():
    msg = wire.Register("t1", (7, 8), 0, 40, A.tokens, A.digest)
    assert wire.decode(wire.encode(msg)[wire.LENGTH.size:]) == msg
    legacy = wire.Register("t1", (7, 8), 0, 40)
    assert wire.decode(wire.encode(legacy)[wire.LENGTH.size:]).prompt_digest == ""


@pytest.mark.parametrize("field, value", [("prompt_digest", "xyz"), ("prompt_tokens", -2), ("prompt_tokens", "40")])
def test_a_register_with_a_malformed_identity_is_a_wire_error(field, value):
    import json
    body = json.loads(wire.encode(wire.Register("t1", (7,), 0, 4, A.tokens, A.digest))[wire.LENGTH.size:])
    body[field] = value
    with pytest.raises(wire.WireError):
        wire.decode(json.dumps(body).encode())
