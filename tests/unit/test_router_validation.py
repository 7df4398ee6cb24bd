"""What the router rejects itself, before any leg is sent."""
from __future__ import annotations

import pytest

from kvpush.router.validation import RequestRejected, parse_request


def reject(raw: bytes, chat: bool = False, limit: int = 100) -> RequestRejected:
    with pytest.raises(RequestRejected) as info:
        parse_request(raw, chat, "tiny", limit)
    return info.value


def test_accepts_valid_bodies():
    assert parse_request(b'{"model": "tiny", "prompt": "hi"}', False, "tiny", 100)["prompt"] == "hi"
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
