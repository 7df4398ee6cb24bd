"""Mutual challenge-response on a side-channel connection: who a peer is comes from a proof made
with the deployment's side-channel key, never from what it claims.

    D -> P  HELLO      (its identity, layout, NIXL metadata, nonce_d)
    P -> D  CHALLENGE  (P's engine id and rank, nonce_p, proof_p)
    D -> P  AUTH       (proof_d)
    P -> D  WELCOME or REFUSE; only now does P look at the HELLO (allowlist, layout, NIXL peer)

proof_p = HMAC(key, "prefill" | nonce_d | nonce_p | P's engine id and rank | digest of the HELLO)
proof_d = HMAC(key, "decode"  | nonce_p | nonce_d | D's engine id and rank | digest of the HELLO)

Each side's proof covers the other's fresh nonce, so a recorded handshake cannot be replayed, and
the HELLO's digest, so nothing in it can be changed on the way. Only the deployment's processes
hold the key (derived from the deployment secret, kvpush.common.deployment_secret). Pure.
"""
from __future__ import annotations

import hashlib
import hmac
import secrets

NONCE_BYTES = 32


def new_nonce() -> str:
    return secrets.token_hex(NONCE_BYTES)


def digest(frame: bytes) -> str:
    return hashlib.sha256(frame).hexdigest()


def prove(key: bytes, role: str, their_nonce: str, my_nonce: str, engine_id: str, tp_rank: int, hello_digest: str) -> str:
    """This side's proof, as `role` ("prefill" or "decode")."""
    message = "\x00".join((role, their_nonce, my_nonce, engine_id, str(tp_rank), hello_digest)).encode()
    return hmac.new(key, message, hashlib.sha256).hexdigest()


def verify(key: bytes, proof: str, role: str, their_nonce: str, my_nonce: str, engine_id: str, tp_rank: int,
           hello_digest: str) -> bool:
    """The other side's proof, made as `role` with `my_nonce` as the nonce it had to answer."""
    expected = prove(key, role, my_nonce, their_nonce, engine_id, tp_rank, hello_digest)
    return hmac.compare_digest(expected, proof)
