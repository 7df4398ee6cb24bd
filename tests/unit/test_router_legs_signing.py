"""The router signs each kvpush leg for the instance it goes to; the connector's check accepts it."""
from __future__ import annotations

import os
import time

import pytest

from kvpush.common.deployment_secret import TRANSFER_PARAMS, derive_key, derive_token
from kvpush.common.errors import UsageError
from kvpush.common.kv_params import UNSIGNED, WRONG_ENGINE, WRONG_PROMPT, PushParams
from kvpush.router.config import Upstream
from kvpush.router.legs_signing import LegSigner, bound_prompt_ids, read_signing_key
from kvpush.router.protocols import concurrent_legs

SECRET = b"s" * 32
KEY = derive_key(SECRET, TRANSFER_PARAMS)
P = Upstream(name="p0", url="http://p", engine_id="dep.p0", side_channel_host="10.0.0.1", side_channel_port=5600)
D = Upstream(name="d0", url="http://d", engine_id="dep.d0", side_channel_host="10.0.0.2", side_channel_port=5601)


def signed_legs(body: dict, chat: bool = False, signer: LegSigner | None = None):
    signer = signer or LegSigner(KEY, 60)
    legs = concurrent_legs("kvpush", body, chat=chat, transfer_id="T1", prefill=P, decode=D)
    return (PushParams.parse(signer.sign(legs.prefill, P)["kv_transfer_params"]),
            PushParams.parse(signer.sign(legs.decode, D)["kv_transfer_params"]))


def test_each_leg_verifies_on_its_own_instance_only():
    ids = [5, 6, 7, 8]
    prefill, decode = signed_legs({"prompt": ids, "max_tokens": 4})
    now = time.time()
    assert prefill.refusal(KEY, "dep.p0", now, ids) is None and decode.refusal(KEY, "dep.d0", now, ids) is None
    assert prefill.refusal(KEY, "dep.d0", now, ids) == WRONG_ENGINE  # a prefill leg's params sent to decode
    assert decode.refusal(KEY, "dep.d0", now, [5, 6, 7, 9]) == WRONG_PROMPT
    assert 55 <= decode.expires - now <= 61


def test_the_prompt_is_bound_where_the_router_knows_its_token_ids():
    assert bound_prompt_ids({"prompt": [1, 2]}) == [1, 2]
    assert bound_prompt_ids({"prompt": [[1, 2]]}) == [1, 2]  # a batch of one
    assert bound_prompt_ids({"prompt": "text"}) is None
    assert bound_prompt_ids({"messages": [{"role": "user", "content": "x"}]}) is None
    assert bound_prompt_ids({"prompt": [1, 2], "truncate_prompt_tokens": 1}) is None  # the engine sees fewer
    assert bound_prompt_ids({"prompt": ["a", "b"]}) is None  # a batch of texts (split into parts before)
    prefill, decode = signed_legs({"prompt": "some text", "max_tokens": 4})
    assert prefill.prompt_digest is None and decode.prompt_tokens is None and decode.signature


def test_ids_no_engine_takes_are_bound_to_nothing():
    prefill, _ = signed_legs({"prompt": [1, 2 ** 40]})
    assert prefill.signature and prefill.prompt_tokens is None


def test_both_legs_of_an_attempt_hash_the_prompt_once(monkeypatch):
    import kvpush.router.legs_signing as signing

    calls = []
    monkeypatch.setattr(signing, "prompt_digest", lambda ids: calls.append(1) or "d" * 64)
    prefill, decode = signed_legs({"prompt": [1, 2, 3]})
    assert len(calls) == 1 and prefill.prompt_digest == decode.prompt_digest == "d" * 64


def test_without_a_key_nothing_is_signed():
    prefill, decode = signed_legs({"prompt": "x"}, signer=LegSigner(None, 60))
    assert prefill.signature == "" and decode.refusal(KEY, "dep.d0", time.time(), []) == UNSIGNED


def test_bodies_without_kvpush_params_are_left_alone():
    body = {"prompt": "x", "kv_transfer_params": {"do_remote_decode": True}}
    assert LegSigner(KEY, 60).sign(dict(body), P) == body


def test_the_key_file_holds_the_derived_key(tmp_path):
    path = tmp_path / "router-params.key"
    path.write_text(derive_token(SECRET, TRANSFER_PARAMS) + "\n")
    os.chmod(path, 0o600)
    assert read_signing_key(str(path)) == KEY
    assert read_signing_key(None) is None


@pytest.mark.parametrize("content, mode, words", [("ab" * 32, 0o644, "readable by other users"),
                                                  ("not hex", 0o600, "not a kvpush signing key"),
                                                  ("ab" * 16, 0o600, "not a kvpush signing key")])
def test_a_bad_key_file_is_one_line_naming_it(tmp_path, content, mode, words):
    path = tmp_path / "router-params.key"
    path.write_text(content + "\n")
    os.chmod(path, mode)
    with pytest.raises(UsageError, match=words) as exc:
        read_signing_key(str(path))
    assert "transfer_params_key_file" in str(exc.value) and "\n" not in str(exc.value)
