"""Every side-channel frame after the handshake carries a MAC: a peer on the path can neither
forge, change, replay, reorder, drop from the middle nor reflect a frame without the connection
closing.

Keys. Once both nonces are known, each side derives two session keys from the deployment's
side-channel key, HKDF-SHA256 style (RFC 5869, one output block each):

    prk          = HMAC(nonce_d | nonce_p, side-channel key)                    (extract)
    key(D -> P)  = HMAC(prk, "kvpush side-channel frames v1 decode->prefill" | 0x01)  (expand)
    key(P -> D)  = HMAC(prk, "kvpush side-channel frames v1 prefill->decode" | 0x01)

Both nonces are fresh per connection, so every connection has its own keys, and a frame of one
connection means nothing on another; the two directions have their own keys, so a frame sent
back to its sender (reflected) fails.

Frames. A sealed frame is the plain frame (wire.py) with a 16-byte tag appended and its length
prefix counting the tag:

    length (4, big-endian: len(json) + 16) | json | tag (16)
    tag = HMAC-SHA256(key of this direction, sender | seq (8, big-endian) | length | json)[:16]

`sender` is b"D" or b"P"; `seq` counts the sealed frames of this direction from 0 and is not
sent: each side keeps both counters, so a replayed, reordered or dropped frame carries a tag made
for another number and fails like a forged one. A frame that fails closes the connection: nothing
behind it is read, so there is no frame "after a failed one".

Which frames are sealed: D's after its AUTH (LAYOUT, REGISTER, CANCEL, PING) and P's after its
CHALLENGE (WELCOME, REFUSE, ACCEPTED, STREAMING, LANDED, DONE, FAIL, QUIESCED, PONG); HELLO,
CHALLENGE and AUTH are the handshake itself and are bound by its proofs (auth.py). A 16-byte
(128-bit) tag is HMAC-SHA-256-128, as IPsec uses it. Nothing is encrypted. Pure.
"""
from __future__ import annotations

import hashlib
import hmac
import struct
from dataclasses import dataclass

from .wire import LENGTH, WireError

TAG_BYTES = 16
_SEQ = struct.Struct(">Q")
_INFO = {"decode": b"kvpush side-channel frames v1 decode->prefill",
         "prefill": b"kvpush side-channel frames v1 prefill->decode"}  # by sender
_SENDER = {"decode": b"D", "prefill": b"P"}
_OTHER = {"decode": "prefill", "prefill": "decode"}


class FrameMacError(WireError):
    """A sealed frame whose tag is not the one its connection's key and sequence number make:
    forged, changed, replayed, reordered, reflected or cut short."""


@dataclass(frozen=True)
class SessionKeys:
    """One connection's two frame keys, by the role that sends with each."""

    decode: bytes  # D -> P
    prefill: bytes  # P -> D

    def sealer(self, role: str) -> FrameSealer:
        """What `role` ("decode" or "prefill") seals its frames with."""
        return FrameSealer(getattr(self, role), _SENDER[role])

    def opener(self, role: str) -> FrameOpener:
        """What `role` checks the other side's frames with."""
        other = _OTHER[role]
        return FrameOpener(getattr(self, other), _SENDER[other])


def session_keys(side_channel_key: bytes, nonce_d: str, nonce_p: str) -> SessionKeys:
    """The frame keys of the connection whose handshake used these nonces (hex, as on the wire)."""
    prk = hmac.digest(bytes.fromhex(nonce_d) + bytes.fromhex(nonce_p), side_channel_key, "sha256")
    return SessionKeys(*(hmac.digest(prk, _INFO[role] + b"\x01", "sha256") for role in ("decode", "prefill")))


class _Tagger:
    def __init__(self, key: bytes, sender: bytes):
        self._base = hmac.new(key, digestmod=hashlib.sha256)  # the key's pads, computed once
        self._sender = sender
        self.seq = 0  # the next frame's number in this direction

    def _tag(self, prefix: bytes | memoryview, body: bytes | memoryview) -> bytes:
        mac = self._base.copy()
        mac.update(self._sender + _SEQ.pack(self.seq))
        mac.update(prefix)
        mac.update(body)
        return mac.digest()[:TAG_BYTES]


class FrameSealer(_Tagger):
    """The sending side of one direction. Not thread-safe: the caller seals in the order the
    frames go on the wire (Connection.send holds its lock)."""

    def seal(self, frame: bytes) -> bytes:
        """A plain frame (length prefix and body, as wire.encode makes it), sealed as the next one."""
        body = memoryview(frame)[LENGTH.size:]
        prefix = LENGTH.pack(len(body) + TAG_BYTES)
        tag = self._tag(prefix, body)
        self.seq += 1
        return b"".join((prefix, body, tag))


class FrameOpener(_Tagger):
    """The receiving side of one direction (the reactor thread's)."""

    def open(self, sealed: bytes) -> bytes:
        """A sealed frame's body without its length prefix (as FrameReader hands it over), checked
        as the next one; its message's bytes, or FrameMacError."""
        if len(sealed) < TAG_BYTES:
            raise FrameMacError(f"a frame of {len(sealed)} bytes cannot hold its {TAG_BYTES}-byte tag")
        view = memoryview(sealed)
        body, tag = view[:-TAG_BYTES], view[-TAG_BYTES:]
        if not hmac.compare_digest(self._tag(LENGTH.pack(len(sealed)), body), tag):
            raise FrameMacError(f"frame {self.seq} of this direction does not carry its tag "
                                "(forged, changed, replayed, reordered or reflected)")
        self.seq += 1
        return bytes(body)
