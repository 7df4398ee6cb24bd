"""Signed kv_transfer_params: what the router signs, what the connector refuses."""
from __future__ import annotations

import dataclasses

import pytest

from kvpush.common.kv_params import (BAD_SIGNATURE, EXPIRED, UNSIGNED, WRONG_ENGINE, WRONG_PROMPT, ParamsError,
                                     PromptIdentity, PushParams, prompt_digest)

KEY = b"k" * 32
NOW = 1_000_000
PROMPT = list(range(100, 140))


def signed(prompt_ids=PROMPT, engine="dep.decode-0", expires=NOW + 60, role="consumer") -> PushParams:
    return PushParams(role, "tid-1", "dep.prefill-0", "10.0.0.1", 7000, 1).signed(KEY, engine, expires, prompt_ids)


def wire_round_trip(params: PushParams) -> PushParams:
    parsed = PushParams.parse(params.to_dict())
    assert parsed is not None
    return parsed


def test_signed_params_survive_the_wire_and_verify():
    params = wire_round_trip(signed())
    assert params.prompt_tokens == len(PROMPT) and params.signature
    assert params.refusal(KEY, "dep.decode-0", NOW, PROMPT) is None


def test_unsigned_params_are_refused():
    params = wire_round_trip(PushParams("consumer", "tid-1", "dep.prefill-0", "10.0.0.1", 7000))
    assert params.refusal(KEY, "dep.decode-0", NOW, PROMPT) == UNSIGNED


def test_another_key_does_not_verify():
    assert signed().refusal(b"x" * 32, "dep.decode-0", NOW, PROMPT) == BAD_SIGNATURE


@pytest.mark.parametrize("field, value", [
    ("role", "producer"), ("transfer_id", "tid-2"), ("peer_engine_id", "dep.prefill-1"), ("peer_host", "10.0.0.9"),
    ("peer_port", 7001), ("peer_tp_size", 2), ("engine_id", "dep.decode-1"), ("expires", NOW + 3600),
    ("prompt_tokens", len(PROMPT) + 1), ("prompt_digest", prompt_digest(PROMPT[::-1])), ("prompt_tokens", None),
    ("prompt_digest", None),
])
def test_every_bound_field_changed_breaks_the_signature(field, value):
    tampered = wire_round_trip(dataclasses.replace(signed(), **{field: value}))
    assert tampered.refusal(KEY, "dep.decode-0", NOW, PROMPT) == BAD_SIGNATURE


def test_expired_params_are_refused():
    params = signed(expires=NOW + 60)
    assert params.refusal(KEY, "dep.decode-0", NOW + 60, PROMPT) is None
    assert params.refusal(KEY, "dep.decode-0", NOW + 61, PROMPT) == EXPIRED


def test_params_for_another_instance_are_refused():
    assert signed(engine="dep.decode-0").refusal(KEY, "dep.decode-1", NOW, PROMPT) == WRONG_ENGINE


def test_a_legs_params_replayed_on_another_prompt_of_the_same_length_are_refused():
    other = list(range(200, 240))
    assert len(other) == len(PROMPT)
    assert signed(PROMPT).refusal(KEY, "dep.decode-0", NOW, other) == WRONG_PROMPT
    assert signed(PROMPT).refusal(KEY, "dep.decode-0", NOW, PROMPT[:-1]) == WRONG_PROMPT


def test_params_without_a_bound_prompt_verify_on_any_prompt():
    """Text prompts: the router knows no token ids; prefill and decode agreeing is what binds them."""
    params = signed(prompt_ids=None)
    assert params.prompt_tokens is None and params.prompt_digest is None
    assert params.refusal(KEY, "dep.decode-0", NOW, [1, 2, 3]) is None


@pytest.mark.parametrize("field, value", [("peer_port", "7000"), ("expires", str(NOW + 60)), ("expires", True),
                                          ("prompt_tokens", "40"), ("signature", 5)])
def test_values_of_another_type_are_malformed_not_coerced(field, value):
    with pytest.raises(ParamsError):
        PushParams.parse({**signed().to_dict(), field: value})


def test_prompt_identity_tells_apart_what_caches_differently():
    base = PromptIdentity.of(PROMPT)
    assert base == PromptIdentity.of(list(PROMPT)) and base.tokens == len(PROMPT)
    assert base != PromptIdentity.of(PROMPT[:-1] + [0])
    assert base != PromptIdentity.of(PROMPT, cache_salt="s")
    assert base != PromptIdentity.of(PROMPT, lora_name="adapter")
    assert base != PromptIdentity.of(PROMPT, extra=["image-hash"])
    assert PromptIdentity.of(None).tokens == 0
