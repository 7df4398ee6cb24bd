"""router/legs.py: how the events before decode's first token are read."""
from __future__ import annotations

import json

import pytest

from kvpush.router.legs import classify_event, error_message


def data(obj) -> bytes:
    return b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode())


@pytest.mark.parametrize("event,kind", [
    (data({"choices": [{"index": 0, "text": " a", "finish_reason": None}]}), "token"),
    (data({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]}), "token"),  # ended with no text
    (data({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}), "other"),  # chat's role chunk
    (data({"choices": [{"index": 0, "delta": {"content": "x"}}]}), "token"),
    (data({"choices": [{"index": 0, "delta": {"tool_calls": [{"id": "c"}]}}]}), "token"),
    (data({"choices": [{"index": 0, "text": "", "finish_reason": "error"}]}), "error"),
    (data({"error": {"message": "KV load failed", "code": 500}}), "error"),
    (data(b"[DONE]"), "done"),
    (data({"choices": [], "usage": {"prompt_tokens": 1}}), "other"),
    (data(b"not json"), "other"),
    (data([1, 2]), "other"),
    (data({"choices": ["not a dict", {"delta": "nor this"}]}), "other"),
    (b": a comment", "other"),
])
def test_each_event_before_the_first_token_is_classified(event, kind):
    assert classify_event(event) == kind


def test_an_error_events_message_is_what_the_client_is_told():
    assert error_message(data({"error": {"message": "KV load failed", "code": 500}})) == "KV load failed"
    assert error_message(b'{"error": "plain"}') == "plain"
    assert error_message(b"<html>bad gateway</html>") == "<html>bad gateway</html>"
