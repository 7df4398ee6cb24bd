"""Mutual challenge-response on a side-channel connection: who a peer is comes from a proof made
with the deployment's side-channel key, never from what it claims.

    D -> P  HELLO      (D's engine id, rank and TP size, nonce_d)      before proof: a few hundred bytes
    P -> D  CHALLENGE  (P's engine id and rank, nonce_p, proof_p)      before proof
    D -> P  AUTH       (proof_d, digest of D's LAYOUT)                 before proof
    D -> P  LAYOUT     (NIXL agent metadata, KV regions, layout)       once D is proven; its digest must match
    P -> D  WELCOME or REFUSE (allow list, layout, NIXL peer)

proof_p = HMAC(key, "prefill" | nonce_d | nonce_p | P's engine id | P's rank | digest(HELLO))
proof_d = HMAC(key, "decode"  | nonce_p | nonce_d | D's engine id | D's rank | digest(HELLO) | digest(LAYOUT))

Each side's proof covers the other's fresh nonce, so a recorded handshake cannot be replayed; the
HELLO's digest, so D's claimed identity and TP size cannot be changed on the way; and D's proof the
LAYOUT's digest, so the NIXL metadata and regions P makes a peer of are the ones D sent. Nothing
before the proofs is large: P hashes a HELLO of a few hundred bytes and verifies an HMAC, and takes
the LAYOUT (up to the proven-peer frame limit) only from a connection that proved the key. Only the
deployment's processes hold the key (derived from the deployment secret,
kvpush.common.deployment_secret). Pure.
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


def prove(key: bytes, role: str, their_nonce: str, my_nonce: str, engine_id: str, tp_rank: int, *digests: str) -> str:
    """This side's proof, as `role` ("prefill" or "decode"), over the digests of what it binds
    (the HELLO; for decode also its LAYOUT)."""
    message = "\x00".join((role, their_nonce, my_nonce, engine_id, str(tp_rank), *digests)).encode()
    return hmac.new(key, message, hashlib.sha256).hexdigest()


def verify(key: bytes, proof: str, role: str, their_nonce: str, my_nonce: str, engine_id: str, tp_rank: int,
           *digests: str) -> bool:
    """The other side's proof, made as `role` with `my_nonce` as the nonce it had to answer."""
    expected = prove(key, role, my_nonce, their_nonce, engine_id, tp_rank, *digests)
    return hmac.compare_digest(expected, proof)
