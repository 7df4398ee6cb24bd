"""Decode's answer to a prefill rank's CHALLENGE (the handshake of auth.py): whether it proves
the deployment's key for the rank this connection was opened to, and if so decode's AUTH and the
session's frame keys. Pure: the push service (consumer.py) sends and counts.
"""
from __future__ import annotations

from . import auth, frame_mac, wire
from .fanin import rank_key


def answer_challenge(key: bytes, hello: wire.Hello, challenge: wire.Challenge, peer_engine: str, engine_id: str,
                     tp_rank: int, layout_digest: str) -> tuple[wire.Auth, frame_mac.SessionKeys] | None:
    """Decode rank `engine_id`/`tp_rank`, which sent `hello` to prefill rank `peer_engine`: its AUTH
    and the session keys, or None if the CHALLENGE is not that rank's proof of `key`."""
    hello_digest = auth.digest(wire.encode(hello))
    claimed = rank_key(challenge.engine_id, challenge.tp_rank)
    if claimed != peer_engine or not auth.verify(key, challenge.proof, "prefill", challenge.nonce, hello.nonce,
                                                 challenge.engine_id, challenge.tp_rank, hello_digest):
        return None
    keys = frame_mac.session_keys(key, hello.nonce, challenge.nonce)
    proof = auth.prove(key, "decode", challenge.nonce, hello.nonce, engine_id, tp_rank, hello_digest, layout_digest)
    return wire.Auth(proof, layout_digest), keys
