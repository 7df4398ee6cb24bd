"""router/merge.py: a split batch's answers and streams merged as vLLM answers a batch."""
from __future__ import annotations

import json

from kvpush.router.merge import DONE_EVENT, StreamMerger, merge_answers


def answer(label: str, n: int, prompt_tokens: int, completion_tokens: int) -> dict:
    return {"id": f"cmpl-{label}-0", "object": "text_completion", "created": 5, "model": "m",
            "choices": [{"index": i, "text": f"{label}{i}", "finish_reason": "length"} for i in range(n)],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens},
            "kv_transfer_params": {"leaked": True}}


def test_answers_merge_with_openai_choice_indices_and_summed_usage():
    merged = merge_answers([answer("a", 2, 4, 6), answer("b", 2, 7, 6), answer("c", 2, 1, 6)], 2, "cmpl-X")
    assert [(c["index"], c["text"]) for c in merged["choices"]] == [
        (0, "a0"), (1, "a1"), (2, "b0"), (3, "b1"), (4, "c0"), (5, "c1")]
    assert merged["usage"] == {"prompt_tokens": 12, "completion_tokens": 18, "total_tokens": 30}
    assert merged["id"] == "cmpl-X" and merged["created"] == 5 and merged["kv_transfer_params"] is None


def test_cached_prompt_tokens_are_summed_when_the_parts_report_them():
    parts = [answer("a", 1, 4, 1), answer("b", 1, 4, 1)]
    for part, cached in zip(parts, (2, 3)):
        part["usage"]["prompt_tokens_details"] = {"cached_tokens": cached}
    assert merge_answers(parts, 1, "x")["usage"]["prompt_tokens_details"] == {"cached_tokens": 5}


def sse(obj) -> bytes:
    return b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n"


def chunk(part_id: str, index: int, text: str, reason=None) -> dict:
    return {"id": part_id, "object": "text_completion", "created": 1, "model": "m",
            "choices": [{"index": index, "text": text, "finish_reason": reason}]}


def events(data: bytes) -> list:
    return [json.loads(e[6:]) if e != b"data: [DONE]" else "DONE" for e in data.split(b"\n\n") if e]


def test_streams_interleave_by_arrival_with_rewritten_indices_and_one_final_usage_chunk():
    merger = StreamMerger(parts=2, n=2, response_id="cmpl-X")
    out = merger.feed(1, sse(chunk("p1", 1, "b1")) + sse(chunk("p1", 0, "b0")))
    out += merger.feed(0, sse(chunk("p0", 0, "a0", "length")))
    usage = {"id": "p0", "object": "text_completion", "created": 1, "model": "m", "choices": [],
             "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}
    out += merger.feed(0, sse(usage) + sse(b"[DONE]"))
    out += merger.feed(1, sse({**usage, "usage": {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6}}))
    out += merger.feed(1, sse(b"[DONE]"))
    assert merger.done == [True, True] and not merger.error
    got = events(out)
    assert [(e["id"], e["choices"][0]["index"], e["choices"][0]["text"]) for e in got] == [
        ("cmpl-X", 3, "b1"), ("cmpl-X", 2, "b0"), ("cmpl-X", 0, "a0")]
    final = events(merger.finish())
    assert final[0]["usage"] == {"prompt_tokens": 7, "completion_tokens": 4, "total_tokens": 11}
    assert final[0]["choices"] == [] and final[0]["id"] == "cmpl-X" and final[1] == "DONE"


def test_an_event_split_across_reads_is_passed_on_once_whole():
    merger = StreamMerger(parts=1, n=1, response_id="x")
    whole = sse(chunk("p", 0, "hello"))
    assert merger.feed(0, whole[:10]) == b""
    assert events(merger.feed(0, whole[10:]))[0]["choices"][0]["text"] == "hello"
    assert merger.finish() == DONE_EVENT  # no part sent usage: none is made up


def test_a_parts_error_event_passes_and_stops_the_merge():
    merger = StreamMerger(parts=2, n=1, response_id="x")
    error = {"error": {"message": "boom", "type": "InternalServerError", "code": 500}}
    out = merger.feed(0, sse(error) + sse(chunk("p", 0, "after")))
    assert merger.error and events(out) == [error]
