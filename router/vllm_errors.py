"""How a vLLM 0.32 OpenAI server says that a request failed, read precisely enough to decide what
the router does about it. Pure functions.

A request the engine finished with finish_reason "error" (RequestStatus.FINISHED_ERROR) is what a
failed KV load becomes under `kv_load_failure_policy: fail` (vLLM's default; the scheduler also
finishes grammar-compile and encoder-cache failures this way). The OpenAI server turns it into a
GenerationError, which it answers
- non-streamed: HTTP 500 `{"error": {"message": "Internal server error", "type":
  "InternalServerError", "param": null, "code": 500}}` (the status line comes with the whole
  answer, after generation);
- streamed: HTTP 200, then (after chat's role chunk) the event `data: {"error": {...the same...}}`
  and `data: [DONE]`.
Any other exception is answered with its own message and type; the request's own faults (a bad
parameter) with a 4xx status, or, inside a stream, with an error event whose code is 4xx.
"""
from __future__ import annotations

import json

_TOKEN_DELTA_KEYS = ("content", "reasoning_content", "reasoning", "tool_calls")
GENERATION_ERROR_MESSAGE = "Internal server error"  # vLLM's GenerationError default, the only one it raises with
NOT_THE_REQUESTS_FAULT = (408, 429)  # 4xx that say "try again", not "this request is wrong"

# what an error says (failure_kind)
GENERATION = "generation"  # finished with finish_reason "error": on a leg that loads KV, the load failed
CLIENT = "client"  # the request itself is wrong: its answer goes to the client, never retried
SERVER = "server"  # anything else the instance failed with


def client_fault(status: int) -> bool:
    return 400 <= status < 500 and status not in NOT_THE_REQUESTS_FAULT


def _error_object(payload: bytes) -> object:
    """The `error` member of an error body or of an SSE error event's data; None if there is none."""
    try:
        obj = json.loads(payload.split(b"data: ", 1)[-1])
    except ValueError:
        return None
    return obj.get("error") if isinstance(obj, dict) else None


def failure_kind(status: int, payload: bytes) -> str:
    """GENERATION, CLIENT or SERVER, for an answer with this HTTP status and body, or (status 200)
    for a stream's error event `payload`."""
    error = _error_object(payload)
    code = status
    if isinstance(error, dict) and status == 200:
        given = error.get("code")
        code = given if isinstance(given, int) else 500
    if client_fault(code):
        return CLIENT
    if (code == 500 and isinstance(error, dict) and error.get("message") == GENERATION_ERROR_MESSAGE
            and error.get("type") == "InternalServerError"):
        return GENERATION
    return SERVER


def classify_event(event: bytes) -> str:
    """'token' (the first output the client should see), 'error', 'done' or 'other' (e.g. a
    role-only chat chunk that precedes the first token)."""
    if not event.startswith(b"data: "):
        return "other"
    payload = event[6:].strip()
    if payload == b"[DONE]":
        return "done"
    try:
        obj = json.loads(payload)
    except ValueError:
        return "other"
    if not isinstance(obj, dict):
        return "other"
    if "error" in obj:
        return "error"
    for choice in obj.get("choices") or ():
        if not isinstance(choice, dict):
            continue
        reason = choice.get("finish_reason")
        if reason == "error":
            return "error"
        if reason is not None or choice.get("text"):
            return "token"
        delta = choice.get("delta") or {}
        if isinstance(delta, dict) and any(delta.get(k) for k in _TOKEN_DELTA_KEYS):
            return "token"
    return "other"


def event_failure_kind(event: bytes) -> str:
    """What an event classify_event calls 'error' says: its error object as failure_kind reads it,
    or, for a choice finished with "error", GENERATION."""
    if _error_object(event) is None:
        return GENERATION
    return failure_kind(200, event)


def error_message(payload: bytes) -> str:
    err = _error_object(payload)
    if isinstance(err, dict):
        return str(err.get("message", err))
    if err is not None:
        return str(err)
    return payload[:200].decode(errors="replace")
