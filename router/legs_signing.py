"""Signing each leg's kvpush `kv_transfer_params` (the contract and its check: kvpush.common.kv_params).

The router holds the signing key only, never the deployment secret: `kvpush up` writes the key
derived from the secret for deployment_secret.TRANSFER_PARAMS (64 hex digits) into a file of the
router's host, named by router.json's `transfer_params_key_file`. Without one the router signs
nothing (a deployment without a secret, whose connectors check nothing either).

The router does not tokenize: it binds a prompt's length and digest only where the client sent
token ids (a completion whose prompt is token ids and is not to be truncated), which are exactly
what the instance's engine sees. Every leg is bound to its transfer id, its role, the instance it
is sent to, its peer and an expiry.
"""
from __future__ import annotations

import time
from pathlib import Path

from kvpush.common.deployment_secret import SecretFileError, read_key_file
from kvpush.common.errors import UsageError
from kvpush.common.kv_params import PushParams, prompt_digest

from .config import Upstream
from .protocols import KV_PARAMS

KEY_HEX_DIGITS = 64


def read_signing_key(path: str | None) -> bytes | None:
    """The key in `transfer_params_key_file` (None: no file named, nothing is signed)."""
    if not path:
        return None
    try:
        text = read_key_file(str(Path(path).expanduser()), missing_hint="`kvpush up` writes it, or fix the path")
    except SecretFileError as exc:
        raise UsageError(f"router config: transfer_params_key_file: {exc}") from None
    try:
        key = bytes.fromhex(text)
    except ValueError:
        key = b""
    if len(key) * 2 != KEY_HEX_DIGITS:
        raise UsageError(f"router config: transfer_params_key_file {path}: not a kvpush signing key "
                         f"({KEY_HEX_DIGITS} hex digits); rerun `kvpush up` to write it again")
    return key


def bound_prompt_ids(body: dict) -> list[int] | None:
    """The token ids the instance will see for this leg's body, where the router knows them (a chat
    body has `messages`, no `prompt`)."""
    if body.get("truncate_prompt_tokens") is not None or body.get("prompt_embeds") is not None:
        return None
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list):
        prompt = prompt[0]
    if isinstance(prompt, list) and prompt and type(prompt[0]) is int:
        return prompt  # the router's validation took only token ids in such a list
    return None


class LegSigner:
    def __init__(self, key: bytes | None, ttl_s: float):
        self.key = key
        self.ttl_s = ttl_s
        # The last token-id prompt hashed and its digest: an attempt's legs share one prompt list
        self._last: tuple[list[int], str] | None = None

    def sign(self, leg_body: dict, instance: Upstream) -> dict:
        """`leg_body` with its kvpush params signed for `instance` (the same dict, changed in place:
        the leg's body is the router's own copy). Bodies without kvpush params are left as they are."""
        if self.key is None:
            return leg_body
        params = PushParams.parse(leg_body.get(KV_PARAMS))
        if params is None:
            return leg_body
        ids = bound_prompt_ids(leg_body)
        digest = None
        if ids is not None:
            if self._last is not None and self._last[0] is ids:
                digest = self._last[1]
            else:
                try:
                    digest = prompt_digest(ids)
                except ValueError:  # not token ids vLLM would take: bound to nothing, vLLM refuses them
                    ids = None
                else:
                    self._last = (ids, digest)
        signed = params.signed(self.key, instance.engine_id, int(time.time() + self.ttl_s), ids, digest)
        leg_body[KV_PARAMS] = signed.to_dict()
        return leg_body
