"""Checks the router makes before any leg is sent; everything deeper is left to vLLM (its 4xx
answers reach the client verbatim). What the router reads itself (model, stream, prompt, n) is
checked here, so no client body can make the router fail; what it must never forward (transfer
parameters naming peers) is removed here."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

MAX_JSON_DEPTH = 100  # deep enough for any JSON schema in tools/response_format
# Per-request fields a client could use to point an instance's connector somewhere: only the
# router writes them, on its legs.
TRANSFER_FIELDS = ("kv_transfer_params", "ec_transfer_params")


class RequestRejected(Exception):
    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


@dataclass
class ParsedRequest:
    body: dict
    raw: bytes | None  # the client's bytes while they still equal `body`; None once the router changed it


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


_CONTAINERS = frozenset({dict, list})
_INT = frozenset({int})
_STR = frozenset({str})
_LIST = frozenset({list})


def json_depth_exceeds(value: Any, limit: int) -> bool:
    """True when containers nest deeper than `limit` (iterative: no recursion to exhaust). A list
    of scalars (a prompt's token ids) is passed over at C speed."""
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            return True
        children = node.values() if isinstance(node, dict) else node
        if _CONTAINERS.isdisjoint(map(type, children)):
            continue
        stack.extend((child, depth + 1) for child in children if type(child) in _CONTAINERS)
    return False


def _token_ids(value: Any) -> bool:
    return type(value) is list and set(map(type, value)) <= _INT  # bools are not token ids


def prompt_list(prompt: Any) -> list | None:
    """The prompts of a batch (a list of strings or of token-id lists), else None (one prompt)."""
    if type(prompt) is not list or not prompt:
        return None
    kinds = set(map(type, prompt))
    if kinds <= _INT:
        return None  # one prompt of token ids
    if kinds <= _STR or (kinds <= _LIST and all(_token_ids(p) for p in prompt)):
        return prompt
    raise RequestRejected(400, "`prompt` must be a string, a list of token ids, a list of strings or a list of "
                               "token-id lists", "prompt")


def _prompt_size(prompt: Any, prompts: list | None) -> int:
    """Characters of text, one per token id."""
    if prompts is not None:
        return sum(map(len, prompts))
    return len(prompt) if isinstance(prompt, (str, list)) else 0


def choices_per_prompt(body: dict) -> int:
    n = body.get("n")
    if n is None:
        return 1
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise RequestRejected(400, f"`n` must be an integer of at least 1, not {json.dumps(n)[:40]}", "n")
    return n


def strip_transfer_fields(body: dict) -> bool:
    """Remove what a client may not set; True if anything was removed."""
    changed = False
    for name in TRANSFER_FIELDS:
        if name in body:
            del body[name]
            changed = True
    xargs = body.get("vllm_xargs")  # vLLM merges these into the same per-request arguments
    if isinstance(xargs, dict):
        for name in TRANSFER_FIELDS:
            if name in xargs:
                del xargs[name]
                changed = True
    return changed


def parse_request(raw: bytes, chat: bool, served_model_name: str, max_prompt_chars: int,
                  max_batch_prompts: int = 1024) -> ParsedRequest:
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise RequestRejected(400, f"request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise RequestRejected(400, f"request body nests deeper than {MAX_JSON_DEPTH} levels") from None
    if not isinstance(body, dict):
        raise RequestRejected(400, "request body must be a JSON object")
    if json_depth_exceeds(body, MAX_JSON_DEPTH):
        raise RequestRejected(400, f"request body nests deeper than {MAX_JSON_DEPTH} levels")
    model = body.get("model")
    if model not in (None, "") and model != served_model_name:
        shown = model if isinstance(model, str) else json.dumps(model)[:80]
        raise RequestRejected(404, f"The model `{shown}` does not exist. Valid aliases: {served_model_name}.", "model")
    if "stream" in body and not isinstance(body["stream"], bool) and body["stream"] is not None:
        raise RequestRejected(400, "`stream` must be a boolean", "stream")
    choices_per_prompt(body)
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
        prompts = prompt_list(prompt)
        if prompts is not None and len(prompts) > max_batch_prompts:
            raise RequestRejected(400, f"prompt list length {len(prompts)} exceeds the router's limit of "
                                       f"{max_batch_prompts} prompts per request", "prompt")
        size = _prompt_size(prompt, prompts)
        field = "prompt"
    if size > max_prompt_chars:
        raise RequestRejected(400, f"{field} too long: {size} characters > the router's limit of {max_prompt_chars}", field)
    changed = strip_transfer_fields(body)
    return ParsedRequest(body, None if changed else raw)


MAX_REQUEST_ID_CHARS = 256


def check_request_id(value: str | None) -> str | None:
    """The client's X-Request-Id, forwarded to instances: printable ASCII only, bounded."""
    if value is None:
        return None
    if not value or len(value) > MAX_REQUEST_ID_CHARS or any(not 0x21 <= ord(c) <= 0x7E for c in value):
        raise RequestRejected(400, f"X-Request-Id must be 1-{MAX_REQUEST_ID_CHARS} printable ASCII characters "
                                   f"without spaces")
    return value
