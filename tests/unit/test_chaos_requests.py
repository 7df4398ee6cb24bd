"""tests/chaos_requests.py: what counts as answered and as wrong."""
from __future__ import annotations

import io
import json

import pytest

from chaos_requests import RequestRecord, _read_body, _read_stream

pytestmark = pytest.mark.unit


def record(streamed: bool = False) -> RequestRecord:
    return RequestRecord("1p1d", "r", 0, 10, 3, streamed, 0.0, 0.0, 200, False, None, "", "", None)


def sse(*events) -> io.BytesIO:
    lines = [b"data: " + (e if isinstance(e, bytes) else json.dumps(e).encode()) + b"\n\n" for e in events]
    return io.BytesIO(b"".join(lines))


def chunk(text: str, finish=None) -> dict:
    return {"choices": [{"index": 0, "text": text, "finish_reason": finish}]}


def test_a_stream_is_answered_with_every_token_and_done_and_compared_whole():
    r = record(streamed=True)
    _read_stream(sse(chunk("ab"), chunk("c", "length"), b"[DONE]"), r)
    r.compare("abc")
    assert r.answered and r.matches_reference and r.first_token_s is not None
    r.compare("abd")
    assert r.wrong


def test_a_cut_stream_is_not_answered_and_is_wrong_only_when_what_came_is_not_the_references_start():
    r = record(streamed=True)
    _read_stream(sse(chunk("ab"), {"error": {"message": "KV load failed"}}), r)
    assert not r.answered and r.error.startswith("error event:")
    r.compare("abc")
    assert r.matches_reference is True and not r.wrong
    r.compare("xbc")
    assert r.wrong
    missing_done = record(streamed=True)
    _read_stream(sse(chunk("abc", "length")), missing_done)
    assert not missing_done.answered and "[DONE] missing" in missing_done.error


def test_a_body_cut_short_of_its_tokens_is_not_answered_and_nothing_to_compare_is_neither_right_nor_wrong():
    r = record()
    _read_body(io.BytesIO(json.dumps({"choices": [{"text": "ab", "finish_reason": "abort"}]}).encode()), r)
    assert not r.answered and r.error == "finish_reason 'abort'"
    nothing = record()
    nothing.compare("abc")
    assert nothing.matches_reference is None and not nothing.wrong
