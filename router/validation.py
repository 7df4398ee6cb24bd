"""Checks the router makes before any leg is sent; everything deeper is left to vLLM (its 4xx
answers reach the client verbatim)."""
from __future__ import annotations

import json
from typing import Any


class RequestRejected(Exception):
    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def _chars(value: Any) -> int:
    """Prompt size in characters; a token id counts as one."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, (list, tuple)):
        return sum(_chars(v) if isinstance(v, (str, list, tuple, dict)) else 1 for v in value)
    if isinstance(value, dict):  # chat content part
        return _chars(value.get("text", ""))
    return 0


def _message_chars(messages: list) -> int:
    total = 0
    for message in messages:
        if isinstance(message, dict):
            total += _chars(message.get("content") or "")
    return total


def parse_request(raw: bytes, chat: bool, served_model_name: str, max_prompt_chars: int) -> dict:
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise RequestRejected(400, f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise RequestRejected(400, "request body must be a JSON object")
    model = body.get("model")
    if model not in (None, "") and model != served_model_name:
        raise RequestRejected(404, f"The model `{model}` does not exist. Valid aliases: {served_model_name}.", "model")
    if "stream" in body and not isinstance(body["stream"], bool) and body["stream"] is not None:
        raise RequestRejected(400, "`stream` must be a boolean", "stream")
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise RequestRejected(400, "`messages` is required and must be a non-empty list", "messages")
        size = _message_chars(messages)
        field = "messages"
    else:
        if "prompt" not in body and "prompt_embeds" not in body:
            raise RequestRejected(400, "`prompt` is required", "prompt")
        prompt = body.get("prompt")
        if prompt is not None and not isinstance(prompt, (str, list)):
            raise RequestRejected(400, "`prompt` must be a string, a list of strings or a list of token ids", "prompt")
        size = _chars(prompt)
        field = "prompt"
    if size > max_prompt_chars:
        raise RequestRejected(400, f"{field} too long: {size} characters > the router's limit of {max_prompt_chars}", field)
    return body
