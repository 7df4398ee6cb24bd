"""How one client request becomes the parts the router dispatches, and how each part's prompt
reaches decode. Pure functions.

A completion with several prompts (a list of strings or of token-id lists) is one part per prompt:
each gets its own pair and its own transfer, and the answers are merged back in prompt order
(merge.py). Everything else is one part. Colocated instances take a batch as it is.

How decode gets a part's prompt:
- transfer: the usual two legs; decode loads the prompt's KV from prefill.
- samples: several sequences from one prompt (n > 1, beam search). The prompt is transferred
  once, by a one-token decode leg that loads it; then the client's request goes, without
  transfer parameters, to that same decode instance, whose prefix cache holds the prompt: the
  samples share it. (vLLM fans n out into child requests that would each ask for a transfer.)
- local: decode computes the prompt itself. Colocated does; so does a request whose prompt's
  own logits are asked for (prompt_logprobs; echo with logprobs), since a transferred prompt has
  none, and samples on a decode instance without prefix caching. As a fallback, so does every
  request while no prefill instance is in rotation, and a retry once no pair in rotation is left
  that has not failed it. Those are counted and named in a response header.
"""
from __future__ import annotations

import copy
import json
from dataclasses import dataclass

from .validation import ParsedRequest, RequestRejected, choices_per_prompt, prompt_list

TRANSFER = "transfer"
SAMPLES = "samples"
LOCAL = "local"

# why decode computed a prompt itself (metric label and response header value): by design...
PROMPT_LOGITS = "prompt_logprobs"
SAMPLES_WITHOUT_CACHE = "samples_without_prefix_caching"
# ...or as a fallback, where the prompt wanted a transfer that no pair could give it
NO_PREFILL = "no_prefill_in_rotation"
TRANSFERS_FAILED = "transfers_failed"  # a retry: every pair in rotation that could take the push failed it
FALLBACKS = (NO_PREFILL, TRANSFERS_FAILED)


@dataclass
class Part:
    index: int  # the prompt's position in the client's list (0 for a single prompt)
    body: dict
    raw: bytes | None  # the client's bytes when `body` is the client's body unchanged

    def data(self) -> bytes:
        if self.raw is None:
            self.raw = json.dumps(self.body).encode()
        return self.raw


def split(parsed: ParsedRequest, chat: bool, colocated: bool) -> list[Part]:
    """One part per prompt of a completion batch (disaggregated only), else the request itself."""
    body = parsed.body
    if chat or colocated:
        return [Part(0, body, parsed.raw)]
    embeds = body.get("prompt_embeds")
    if isinstance(embeds, list) and len(embeds) > 1:
        raise RequestRejected(400, "a list of prompt_embeds cannot be split by the kvpush router; "
                                   "send one prompt_embeds per request", "prompt_embeds")
    prompts = prompt_list(body.get("prompt"))
    if prompts is None or len(prompts) == 1:
        return [Part(0, body, parsed.raw)]
    parts = []
    for i, prompt in enumerate(prompts):
        part_body = copy.copy(body)
        part_body["prompt"] = prompt
        parts.append(Part(i, part_body, None))
    return parts


def several_samples(body: dict) -> bool:
    """n > 1, or beam search (vLLM 0.32 serves no best_of: it ignores the field)."""
    return choices_per_prompt(body) > 1 or bool(body.get("use_beam_search"))


def needs_prompt_logits(body: dict, chat: bool) -> bool:
    """vLLM computes prompt logprobs from the prompt's forward pass, which a transfer skips (it
    also never reads a cached prefix for them)."""
    if body.get("prompt_logprobs") is not None:
        return True
    return bool(body.get("echo")) and body.get("top_logprobs" if chat else "logprobs") is not None


def wants_prefill(body: dict, chat: bool, colocated: bool) -> bool:
    """Whether a part's prompt would come from a prefill instance, given one."""
    return not colocated and not needs_prompt_logits(body, chat)


def way_to_decode(body: dict, chat: bool, colocated: bool, without_prefill: str | None,
                  decode_caches_prefixes: bool) -> tuple[str, str | None]:
    """(TRANSFER | SAMPLES | LOCAL, why decode computes the prompt itself or None), for a part
    given a prefill instance (`without_prefill` None) or not (why not: NO_PREFILL or
    TRANSFERS_FAILED). Decode computing a prompt by design is never called a fallback."""
    if colocated:
        return LOCAL, None
    if needs_prompt_logits(body, chat):
        return LOCAL, PROMPT_LOGITS
    if several_samples(body) and not decode_caches_prefixes:
        return LOCAL, SAMPLES_WITHOUT_CACHE
    if without_prefill is not None:
        return LOCAL, without_prefill
    return (SAMPLES, None) if several_samples(body) else (TRANSFER, None)
