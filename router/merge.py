"""The answers of a split batch (one part per prompt) merged back into one, as vLLM answers a
batch: choice `index` = prompt position x n + the choice's own index, usage summed, one id.
Pure functions over vLLM's JSON; the parts' own ids and transfer fields do not reach the client."""
from __future__ import annotations

import json
from typing import Any

DONE_EVENT = b"data: [DONE]\n\n"
_USAGE_KEYS = ("prompt_tokens", "completion_tokens", "total_tokens")


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


def _reindex(choices: list, part: int, n: int) -> list:
    out = []
    for choice in choices:
        if isinstance(choice, dict):
            choice = {**choice, "index": part * n + int(choice.get("index") or 0)}
        out.append(choice)
    return out


def sum_usage(usages: list[dict]) -> dict:
    total: dict[str, Any] = {k: sum(int(u.get(k) or 0) for u in usages) for k in _USAGE_KEYS}
    cached = [u["prompt_tokens_details"].get("cached_tokens") for u in usages
              if isinstance(u.get("prompt_tokens_details"), dict)]
    if cached:
        total["prompt_tokens_details"] = {"cached_tokens": sum(int(c or 0) for c in cached)}
    return total


def merge_answers(answers: list[dict], n: int, response_id: str) -> dict:
    """Non-streamed answers, one per prompt in prompt order, as one answer."""
    merged = dict(answers[0])
    merged["id"] = response_id
    merged["choices"] = [
        c for part, answer in enumerate(answers) for c in _reindex(answer.get("choices") or [], part, n)
    ]
    usages = [a["usage"] for a in answers if isinstance(a.get("usage"), dict)]
    if usages:
        merged["usage"] = sum_usage(usages)
    if "kv_transfer_params" in merged:
        merged["kv_transfer_params"] = None
    if merged.get("metrics") is not None:  # vLLM reports per-request metrics for one prompt only
        merged["metrics"] = None
    return merged


class StreamMerger:
    """The SSE streams of a batch's parts as one stream: each part's events are rewritten and
    passed on as they come (interleaved by arrival, as vLLM interleaves its prompts); each part's
    own end marker and final usage chunk are held back, and one of each follows the last part."""

    def __init__(self, parts: int, n: int, response_id: str):
        self.n = n
        self.response_id = response_id
        self._pending = [b""] * parts
        self._usage: list[dict | None] = [None] * parts
        self.done = [False] * parts
        self.error = False  # a part reported an error: the merged stream ends after it

    def feed(self, part: int, data: bytes) -> bytes:
        """What to send the client for these bytes of one part's stream (whole events only)."""
        buf = self._pending[part] + data
        out = []
        start = 0
        while not self.error and (end := buf.find(b"\n\n", start)) >= 0:
            out.append(self._event(part, buf[start:end]))
            start = end + 2
        self._pending[part] = buf[start:]
        return b"".join(out)

    def _event(self, part: int, event: bytes) -> bytes:
        if not event.startswith(b"data:"):
            return b""
        payload = event[5:].strip()
        if payload == b"[DONE]":
            self.done[part] = True
            return b""
        try:
            obj = json.loads(payload)
        except ValueError:
            obj = None
        if not isinstance(obj, dict):
            return b""
        if "error" in obj:
            self.error = True
            return b"data: " + payload + b"\n\n"
        choices = obj.get("choices")
        if not choices and isinstance(obj.get("usage"), dict):  # the part's final usage chunk
            self._usage[part] = obj
            return b""
        obj["id"] = self.response_id
        if isinstance(choices, list):
            obj["choices"] = _reindex(choices, part, self.n)
        return b"data: " + _dumps(obj) + b"\n\n"

    def finish(self) -> bytes:
        """The merged final usage chunk (when the parts sent theirs) and the end marker."""
        usages = [u for u in self._usage if u is not None]
        if not usages:
            return DONE_EVENT
        final = dict(usages[-1])
        final["id"] = self.response_id
        final["usage"] = sum_usage([u["usage"] for u in usages])
        return b"data: " + _dumps(final) + b"\n\n" + DONE_EVENT
