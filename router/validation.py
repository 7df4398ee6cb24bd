"""Checks the router makes before any leg is sent; everything deeper is left to vLLM (its 4xx
answers reach the client verbatim). What the router reads itself (model, stream, prompt, n) is
checked here, so no client body can make the router fail; what it must never forward (transfer
parameters naming peers) is removed here."""
from __future__ import annotations

import json
import math
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


class _NonFinite(ValueError):
    """A number no JSON may hold (NaN, Infinity, or one past a float's range): Python's json takes
    them, vLLM's sampling would not survive them."""

    def __init__(self, token: str):
        super().__init__(token)
        self.token = token


def _refuse_constant(token: str) -> float:
    raise _NonFinite(token)


def _finite_float(token: str) -> float:
    value = float(token)
    if math.isinf(value):
        raise _NonFinite(token)
    return value


_DECODER = json.JSONDecoder(parse_constant=_refuse_constant, parse_float=_finite_float)
_NOT_FINITE = object()


def _first_non_finite(raw: bytes) -> str:
    """Where the first non-finite number of the body is, e.g. `messages[0].temperature` ('' if not found)."""
    try:
        body = json.loads(raw, parse_constant=lambda _: _NOT_FINITE,
                          parse_float=lambda token: _NOT_FINITE if math.isinf(float(token)) else 0.0)
    except (ValueError, RecursionError):
        return ""
    stack: list[tuple[Any, str]] = [(body, "")]
    while stack:
        node, path = stack.pop()
        if node is _NOT_FINITE:
            return path
        if isinstance(node, dict):
            stack.extend((v, f"{path}.{k}" if path else str(k)) for k, v in reversed(node.items()))
        elif isinstance(node, list):
            stack.extend((v, f"{path}[{i}]") for i, v in reversed(list(enumerate(node))))
    return ""


def load_json(raw: bytes) -> Any:
    """The body as JSON, refusing numbers that are not finite (400 naming the field)."""
    try:
        return _DECODER.decode(raw.decode(json.detect_encoding(raw), "surrogatepass"))
    except _NonFinite as exc:
        field = _first_non_finite(raw)
        where = f"`{field}`" if field else "a number"
        raise RequestRejected(400, f"{where} is not a finite number ({exc.token}); the router takes finite numbers "
                                   "only", field or None) from None


def parse_request(raw: bytes, chat: bool, served_model_name: str, max_prompt_chars: int,
                  max_batch_prompts: int = 1024) -> ParsedRequest:
    try:
        body = load_json(raw)
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
        raise RequestRejected(
            400, f"{field} too long: {size} characters > the router's limit of {max_prompt_chars}", field
        )
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
