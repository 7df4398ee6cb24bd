"""A prompt's block chain: the keys under which the router's prefix record (prefix_record.py) files
what it sent to each instance. Pure functions.

The router does not tokenize (a 16k-token prompt would cost it milliseconds of CPU per request), so
the chain is cut from what the client sent:
- a prompt of token ids: blocks of `block_tokens` ids;
- a text prompt: blocks of `block_chars` characters;
- a chat request: its messages written out as one text (each message's role, content and other
  fields, between separators), then cut like a text prompt. A conversation's next turn repeats the
  earlier messages and adds to them, so its text starts with the last turn's text and its first
  blocks are the last turn's blocks.
Block i's key hashes block i with block i-1's key, so two prompts share a key only where they
agree up to the end of that block (a 64-bit hash: a collision misroutes one request, nothing
else). The first key also hashes what makes equal text cache differently (the model, which may be a
LoRA adapter; a cache_salt; for chat, the fields the template renders before the messages).
Only whole blocks are keyed: a prompt shorter than one block has no chain.

Keys come from Python's hash(), salted per process: each router worker keeps its own record.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

TOKENS = "tokens"
CHARS = "chars"

# Request fields that change a prompt's KV without changing its text: part of the chain's seed.
_SEED_FIELDS = ("model", "cache_salt")
# Chat fields a template renders before the messages (or that change how it renders them).
_CHAT_SEED_FIELDS = ("tools", "chat_template", "chat_template_kwargs", "documents", "mm_processor_kwargs")
_MESSAGE_START, _FIELD_END, _MESSAGE_END = "\x1d", "\x1f", "\x1e"


@dataclass(frozen=True)
class PromptBlocks:
    """One prompt's chain."""

    keys: tuple[int, ...]  # one per whole block, in prompt order
    unit: str  # TOKENS or CHARS: what `block` and `length` count
    block: int  # units per block
    length: int  # the whole prompt, in units

    def units(self, blocks: int) -> int:
        """The prompt units the first `blocks` blocks cover."""
        return blocks * self.block


def prompt_blocks(body: dict, chat: bool, block_tokens: int, block_chars: int) -> PromptBlocks | None:
    """The chain of one part's prompt (fanout.Part.body); None where the prompt is not one the record
    can follow (prompt embeddings, a batch, something malformed: vLLM judges those)."""
    seed = hash(tuple(_stable(body.get(name)) for name in _SEED_FIELDS))
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list):
            return None
        seed = hash((seed, tuple(_stable(body.get(name)) for name in _CHAT_SEED_FIELDS)))
        return _text_chain(_messages_text(messages), block_chars, seed)
    if body.get("prompt_embeds") is not None:
        return None
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return _text_chain(prompt, block_chars, seed)
    if isinstance(prompt, list) and all(type(t) is int for t in prompt):
        return _token_chain(prompt, block_tokens, seed)
    return None


def _token_chain(ids: list[int], block: int, seed: int) -> PromptBlocks:
    keys, key = [], seed
    for start in range(0, len(ids) - block + 1, block):
        key = hash((key, tuple(ids[start:start + block])))
        keys.append(key)
    return PromptBlocks(tuple(keys), TOKENS, block, len(ids))


def _text_chain(text: str, block: int, seed: int) -> PromptBlocks:
    keys, key = [], seed
    for start in range(0, len(text) - block + 1, block):
        key = hash((key, text[start:start + block]))
        keys.append(key)
    return PromptBlocks(tuple(keys), CHARS, block, len(text))


def _messages_text(messages: list) -> str:
    """The messages as one text in which a longer conversation extends a shorter one."""
    out = []
    for message in messages:
        if not isinstance(message, dict):
            out.append(f"{_MESSAGE_START}{_stable(message)}{_MESSAGE_END}")
            continue
        content = message.get("content")
        others = {k: v for k, v in message.items() if k not in ("role", "content")}
        out.append(_MESSAGE_START + str(message.get("role")) + _FIELD_END
                   + (content if isinstance(content, str) else _stable(content)) + _FIELD_END
                   + (_stable(others) if others else "") + _MESSAGE_END)
    return "".join(out)


def _stable(value: Any) -> str:
    """A text that is equal for equal JSON values (dict order aside)."""
    if value is None or isinstance(value, str):
        return "" if value is None else value
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)
