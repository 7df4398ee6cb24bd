"""The per-request `kv_transfer_params` of kvpush's connector: the router writes them on each
leg, the connector reads them. Defined once, here, with how they are signed and checked.

prefill leg: {"kvpush_role": "producer", "transfer_id", "peer_engine_id", "peer_host", "peer_port", "peer_tp_size",
              "engine_id", "expires", "prompt_tokens", "prompt_digest", "signature"}
decode leg:  {"kvpush_role": "consumer", ... the same keys, naming the prefill instance}
The peer is the instance at the other end; its side channel listens on peer_port + its TP rank.
`engine_id` is the instance the leg is for.

Signed (where the deployment has a secret): the router signs each leg with HMAC-SHA256 under the
key derived from the deployment secret for deployment_secret.TRANSFER_PARAMS, over every field above but the
signature itself (`signed_text`). The connector refuses a leg that is unsigned, wrongly signed,
past `expires` (Unix seconds), for another engine, or whose `prompt_tokens`/`prompt_digest` (bound
only where the router knows the prompt's token ids: a completion request whose prompt is token
ids) are not its prompt's. What binds a text or chat prompt is the agreement of prefill and decode
(`PromptIdentity`): decode's REGISTER carries its prompt's identity and prefill writes nothing into
it unless its own request's is the same.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import struct
from dataclasses import dataclass, replace
from typing import Any, Final, Iterable, Literal

ROLE_KEY = "kvpush_role"
PRODUCER: Final = "producer"
CONSUMER: Final = "consumer"
SIGNATURE_VERSION = "kvpush kv_transfer_params v1"
DEFAULT_TTL_S = 120  # a leg's params are good this long after the router signed them

# Why the connector refuses a leg's params: the label of vllm:kvpush_refused_transfer_params_total.
UNSIGNED, BAD_SIGNATURE, EXPIRED, WRONG_ENGINE, WRONG_PROMPT, MALFORMED = (
    "unsigned", "bad_signature", "expired", "wrong_engine", "wrong_prompt", "malformed")


class ParamsError(ValueError):
    pass


def prompt_digest(token_ids: Any) -> str:
    """SHA-256 (hex) of a prompt's token ids, each as 4 bytes little-endian (struct packs them at C
    speed: ~0.25 ms for 16k ids on a slow core). ValueError for something that is not such an id."""
    ids = token_ids if isinstance(token_ids, (list, tuple)) else list(token_ids or ())
    try:
        packed = struct.pack(f"<{len(ids)}i", *ids)
    except struct.error as exc:
        raise ValueError(f"not a list of token ids: {exc}") from None
    return hashlib.sha256(b"kvpush prompt v1\0" + packed).hexdigest()


@dataclass(frozen=True)
class PromptIdentity:
    """What prefill and decode must agree on before KV moves: the prompt's length and a digest of
    its token ids and of what else makes equal ids cache differently in vLLM (the cache salt, the
    LoRA adapter, multimodal inputs' hashes: `extra`)."""

    tokens: int
    digest: str

    @classmethod
    def of(cls, token_ids: Any, cache_salt: str | None = None, lora_name: str | None = None,
           extra: Iterable[str] = ()) -> PromptIdentity:
        ids = list(token_ids or ())
        return cls.from_ids_digest(len(ids), prompt_digest(ids), cache_salt, lora_name, extra)

    @classmethod
    def from_ids_digest(cls, tokens: int, ids_digest: str, cache_salt: str | None = None,
                        lora_name: str | None = None, extra: Iterable[str] = ()) -> PromptIdentity:
        """The identity of a prompt whose ids' prompt_digest is known (hashed once per request)."""
        text = json.dumps(["kvpush prompt identity v1", ids_digest, cache_salt, lora_name, list(extra)],
                          separators=(",", ":")).encode()
        return cls(tokens, hashlib.sha256(text).hexdigest())


@dataclass(frozen=True)
class PushParams:
    role: Literal["producer", "consumer"]
    transfer_id: str
    peer_engine_id: str
    peer_host: str
    peer_port: int
    peer_tp_size: int = 1
    engine_id: str = ""  # the instance this leg is for
    expires: int = 0  # Unix seconds; 0: none (unsigned params)
    prompt_tokens: int | None = None  # bound by the router only where it knows the token ids
    prompt_digest: str | None = None  # prompt_digest(ids) of those ids
    signature: str = ""  # hex HMAC-SHA256 of signed_text(); "" unsigned

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {ROLE_KEY: self.role, "transfer_id": self.transfer_id,
                               "peer_engine_id": self.peer_engine_id, "peer_host": self.peer_host,
                               "peer_port": self.peer_port, "peer_tp_size": self.peer_tp_size}
        if self.signature:
            out.update(engine_id=self.engine_id, expires=self.expires, prompt_tokens=self.prompt_tokens,
                       prompt_digest=self.prompt_digest, signature=self.signature)
        return out

    def signed_text(self) -> bytes:
        """What the signature covers: every field but itself, in one unambiguous encoding."""
        return json.dumps([SIGNATURE_VERSION, self.role, self.transfer_id, self.engine_id, self.peer_engine_id,
                           self.peer_host, self.peer_port, self.peer_tp_size, self.prompt_tokens, self.prompt_digest,
                           self.expires], separators=(",", ":")).encode()

    def signed(self, key: bytes, engine_id: str, expires: int, prompt_ids: list[int] | None = None,
               ids_digest: str | None = None) -> PushParams:
        """These params for the instance `engine_id`, good until `expires`, bound to `prompt_ids`
        (whose prompt_digest is `ids_digest`, where known) where the caller knows them, and signed
        with `key`. ValueError if `prompt_ids` are not token ids."""
        tokens = digest = None
        if prompt_ids is not None:
            tokens, digest = len(prompt_ids), ids_digest or prompt_digest(prompt_ids)
        unsigned = replace(self, engine_id=engine_id, expires=int(expires), prompt_tokens=tokens,
                           prompt_digest=digest, signature="")
        return replace(unsigned, signature=hmac.new(key, unsigned.signed_text(), hashlib.sha256).hexdigest())

    def refusal(
        self, key: bytes, engine_id: str, now: float, prompt_ids: Any, ids_digest: str | None = None
    ) -> str | None:
        """Why an instance `engine_id` holding `key` refuses these params for a request whose prompt
        is `prompt_ids` (whose prompt_digest is `ids_digest`, where known) at Unix time `now` (a
        reason constant), or None."""
        if not self.signature:
            return UNSIGNED
        expected = hmac.new(key, replace(self, signature="").signed_text(), hashlib.sha256).hexdigest()
        if not hmac.compare_digest(expected, self.signature):
            return BAD_SIGNATURE
        if now > self.expires:
            return EXPIRED
        if self.engine_id != engine_id:
            return WRONG_ENGINE
        if self.prompt_tokens is not None or self.prompt_digest is not None:
            ids = prompt_ids if isinstance(prompt_ids, (list, tuple)) else list(prompt_ids or ())
            if self.prompt_tokens != len(ids):
                return WRONG_PROMPT
            try:
                if self.prompt_digest != (ids_digest or prompt_digest(ids)):
                    return WRONG_PROMPT
            except ValueError:
                return WRONG_PROMPT
        return None

    @classmethod
    def parse(cls, params: Any) -> PushParams | None:
        """None for requests without kvpush params; ParamsError for malformed ones."""
        if not isinstance(params, dict) or ROLE_KEY not in params:
            return None
        role = params[ROLE_KEY]
        if role not in (PRODUCER, CONSUMER):
            raise ParamsError(f"{ROLE_KEY} must be '{PRODUCER}' or '{CONSUMER}', not {role!r}")
        try:
            parsed = cls(role, _text(params["transfer_id"]), _text(params["peer_engine_id"]),
                         _text(params["peer_host"]), _integer(params["peer_port"]),
                         _integer(params.get("peer_tp_size", 1)), _text(params.get("engine_id", "")),
                         _integer(params.get("expires", 0)), _optional_int(params.get("prompt_tokens")),
                         _optional_text(params.get("prompt_digest")), _text(params.get("signature", "")))
        except (KeyError, TypeError, ValueError) as exc:
            raise ParamsError(f"kvpush kv_transfer_params are incomplete or malformed: {exc}") from None
        if not parsed.transfer_id or not 0 < parsed.peer_port < 65536:
            raise ParamsError("kvpush kv_transfer_params need a transfer_id and a valid peer_port")
        if not 0 < parsed.peer_tp_size <= 1024:
            raise ParamsError(f"kvpush kv_transfer_params: peer_tp_size {parsed.peer_tp_size} is not a TP size")
        return parsed


# Exact types only: a signature over "5" must not verify params carrying 5, nor True for 1.
def _text(value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{value!r} is not a string")
    return value


def _integer(value: Any) -> int:
    if type(value) is not int:
        raise TypeError(f"{value!r} is not an integer")
    return value


def _optional_int(value: Any) -> int | None:
    return None if value is None else _integer(value)


def _optional_text(value: Any) -> str | None:
    return None if value is None else _text(value)
