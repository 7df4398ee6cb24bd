"""router/vllm_errors.py: how the router reads vLLM's failed answers: a request vLLM finished with an
error (how a failed KV load shows), the request's own fault, anything else; and the events before
decode's first token."""
from __future__ import annotations

import json

import pytest

from kvpush.router.vllm_errors import (CLIENT, GENERATION, SERVER, classify_event, error_message, event_failure_kind,
                                       failure_kind)

# What vLLM 0.32's OpenAI server answers for a GenerationError (create_error_response(GenerationError()),
# dumped by its ErrorResponse model): a request whose KV load failed under kv_load_failure_policy "fail".
GENERATION_ERROR = {"error": {"message": "Internal server error", "type": "InternalServerError", "param": None,
                              "code": 500}}


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


@pytest.mark.parametrize("status,body,kind", [
    (500, GENERATION_ERROR, GENERATION),
    # any other 5xx: the instance's own failure
    (500, {"error": {"message": "EngineCore encountered an issue. See stack trace (above) for the root cause.",
                     "type": "InternalServerError", "param": None, "code": 500}}, SERVER),
    (500, {"error": {"message": "Internal server error", "type": "NotImplementedError", "param": None, "code": 500}},
     SERVER),
    (503, {"error": {"message": "Internal server error", "type": "ServiceUnavailableError", "param": None,
                     "code": 503}}, SERVER),
    (502, b"<html>bad gateway</html>", SERVER),
    # the request's own fault: never retried
    (400, {"error": {"message": "max_tokens is too large", "type": "BadRequestError", "param": "max_tokens",
                     "code": 400}}, CLIENT),
    (404, {"error": {"message": "The model `x` does not exist.", "type": "NotFoundError", "param": "model",
                     "code": 404}}, CLIENT),
    (422, b"{}", CLIENT),
    # 408 and 429 ask to try again
    (408, b"", SERVER),
    (429, {"error": {"message": "too many requests", "type": "TooManyRequests", "param": None, "code": 429}}, SERVER),
])
def test_an_answers_failure_kind_follows_status_and_vllms_generation_error_exactly(status, body, kind):
    payload = body if isinstance(body, bytes) else json.dumps(body).encode()
    assert failure_kind(status, payload) == kind


@pytest.mark.parametrize("event,kind", [
    (data(GENERATION_ERROR), GENERATION),  # vLLM's stream after a failed KV load
    (data({"choices": [{"index": 0, "text": "", "finish_reason": "error"}]}), GENERATION),
    (data({"error": {"message": "boom", "type": "InternalServerError", "param": None, "code": 500}}), SERVER),
    # an exception inside vLLM's stream generator that is the request's fault (a ValueError: 400)
    (data({"error": {"message": "bad value", "type": "BadRequestError", "param": None, "code": 400}}), CLIENT),
    (data({"error": "plain"}), SERVER),
])
def test_a_stream_error_events_failure_kind(event, kind):
    assert classify_event(event) == "error"
    assert event_failure_kind(event) == kind
