"""What the router rejects itself, before any leg is sent."""
from __future__ import annotations

import pytest

from kvpush.router.validation import RequestRejected, check_request_id, parse_request


def reject(raw: bytes, chat: bool = False, limit: int = 100) -> RequestRejected:
    with pytest.raises(RequestRejected) as info:
        parse_request(raw, chat, "tiny", limit)
    return info.value


def test_accepts_valid_bodies():
    assert parse_request(b'{"model": "tiny", "prompt": "hi"}', False, "tiny", 100).body["prompt"] == "hi"
    assert parse_request(b'{"prompt": [1, 2, 3]}', False, "tiny", 100)  # model is optional, as in vLLM
    assert parse_request(b'{"messages": [{"role": "user", "content": "hi"}]}', True, "tiny", 100)


@pytest.mark.parametrize("raw,chat,status,param", [
    (b"{not json", False, 400, None),
    (b"[1, 2]", False, 400, None),
    (b'{"model": "other", "prompt": "x"}', False, 404, "model"),
    (b'{"max_tokens": 3}', False, 400, "prompt"),
    (b'{"prompt": 5}', False, 400, "prompt"),
    (b'{"prompt": "x", "stream": "yes"}', False, 400, "stream"),
    (b'{"messages": []}', True, 400, "messages"),
    (b'{"prompt": "x"}', True, 400, "messages"),
])
def test_rejects_with_openai_status(raw, chat, status, param):
    exc = reject(raw, chat)
    assert (exc.status, exc.param) == (status, param)


def test_prompt_limit_counts_strings_tokens_and_chat_parts():
    assert reject(b'{"prompt": "' + b"a" * 101 + b'"}').status == 400
    assert reject(b'{"prompt": [' + b",".join([b"1"] * 101) + b"]}").status == 400
    parts = b'[{"type": "text", "text": "' + b"a" * 60 + b'"}, {"type": "text", "text": "' + b"b" * 60 + b'"}]'
    assert "too long" in reject(b'{"messages": [{"role": "user", "content": ' + parts + b"}]}", chat=True).message
    assert parse_request(b'{"prompt": "' + b"a" * 100 + b'"}', False, "tiny", 100)


def test_bodies_nested_past_the_limit_are_a_400_not_a_crash():
    for depth in (101, 5_000, 100_000):
        raw = b'{"prompt": "x", "a": ' + b"[" * depth + b"]" * depth + b"}"
        exc = reject(raw)
        assert exc.status == 400 and "nests deeper" in exc.message
    assert parse_request(b'{"prompt": "x", "a": ' + b"[" * 90 + b"]" * 90 + b"}", False, "tiny", 100)


def test_transfer_parameters_from_a_client_are_removed_and_the_raw_bytes_dropped():
    raw = b'{"prompt": "x", "kv_transfer_params": {"kvpush_role": "consumer"}, "ec_transfer_params": {}, ' \
          b'"vllm_xargs": {"kv_transfer_params": "x", "keep": 1}}'
    parsed = parse_request(raw, False, "tiny", 100)
    assert parsed.body == {"prompt": "x", "vllm_xargs": {"keep": 1}} and parsed.raw is None
    clean = b'{"prompt": "x"}'
    assert parse_request(clean, False, "tiny", 100).raw is clean  # forwarded without re-encoding


@pytest.mark.parametrize("raw,param", [
    (b'{"prompt": "x", "n": 0}', "n"),
    (b'{"prompt": "x", "n": "2"}', "n"),
    (b'{"prompt": "x", "n": true}', "n"),
    (b'{"prompt": "x", "n": 1.5}', "n"),
    (b'{"prompt": ["a", [1]]}', "prompt"),
    (b'{"prompt": [[1], "a"]}', "prompt"),
    (b'{"prompt": [["a"]]}', "prompt"),
    (b'{"prompt": ["a", "b", "c"]}', "prompt"),  # over max_batch_prompts=2
])
def test_what_the_router_reads_is_checked(raw, param):
    with pytest.raises(RequestRejected) as info:
        parse_request(raw, False, "tiny", 100, max_batch_prompts=2)
    assert (info.value.status, info.value.param) == (400, param)


@pytest.mark.parametrize("value,ok", [
    (None, True), ("req-1.2:3_x", True), ("a" * 256, True),
    ("", False), ("a" * 257, False), ("has space", False), ("caf\udcc3\udca9", False), ("x\ty", False),
])
def test_a_request_id_is_bounded_printable_ascii(value, ok):
    if ok:
        assert check_request_id(value) == value
    else:
        with pytest.raises(RequestRejected):
            check_request_id(value)


@pytest.mark.parametrize("raw, field, token", [
    (b'{"prompt": "x", "temperature": NaN}', "temperature", "NaN"),
    (b'{"prompt": "x", "top_p": Infinity}', "top_p", "Infinity"),
    (b'{"prompt": "x", "logit_bias": {"50256": -Infinity}}', "logit_bias.50256", "-Infinity"),
    (b'{"prompt": "x", "repetition_penalty": 1e999}', "repetition_penalty", "1e999"),
    (b'{"prompt": "x", "response_format": {"schema": [0.5, {"max": -1E400}]}}', "response_format.schema[1].max", "-1E400"),
])
def test_numbers_that_are_not_finite_are_a_400_naming_the_field(raw, field, token):
    exc = reject(raw)
    assert (exc.status, exc.param) == (400, field)
    assert exc.message == f"`{field}` is not a finite number ({token}); the router takes finite numbers only"


def test_finite_numbers_and_the_words_in_strings_pass():
    body = parse_request(b'{"prompt": "NaN Infinity", "temperature": 0.7, "top_p": 1e308, "seed": 1e3}',
                         False, "tiny", 100).body
    assert body == {"prompt": "NaN Infinity", "temperature": 0.7, "top_p": 1e308, "seed": 1000.0}
