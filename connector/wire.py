"""Side-channel wire messages between a decode (D) and a prefill (P) worker.

Frames are a 4-byte big-endian length followed by a UTF-8 JSON object with a "type" field; after
the handshake each also carries a 16-byte MAC tag, which the length counts (frame_mac.py).
D opens one TCP connection per P rank; over it D sends HELLO, AUTH, LAYOUT, REGISTER, CANCEL and PING
and P answers with CHALLENGE, WELCOME/REFUSE, ACCEPTED (P has the request), STREAMING and LANDED (a
WRITE that lands part by part), DONE, FAIL, QUIESCED (every WRITE of a transfer P gave up on has
ended) and PONG. HELLO, CHALLENGE and AUTH authenticate both
sides (auth.py) before anything else is taken from the peer, and are small: a frame from an unproven
peer is at most MAX_UNAUTHENTICATED_FRAME_BYTES. What is large (D's KV layout and NIXL agent
metadata, LAYOUT) flows only after both sides proved the key. Decoding validates every field: a
malformed frame raises WireError, which the receiver counts and drops (it never reaches protocol
state).
"""
from __future__ import annotations

import base64
import json
import re
import struct
from dataclasses import asdict, dataclass, field, fields
from typing import Any, ClassVar

from .regions import HeadLayout, LayoutIdentity, Region

MAX_FRAME_BYTES = 16 * 1024 * 1024  # a REGISTER of a million blocks; nothing else comes near it
# Until a peer proves who it is: HELLO, CHALLENGE and AUTH are a few hundred bytes (ids, nonces,
# proofs), so a stranger's frame costs little to read and nothing to refuse.
MAX_UNAUTHENTICATED_FRAME_BYTES = 4096
LENGTH = struct.Struct(">I")


class WireError(ValueError):
    """A frame that is not a valid message."""


class FrameTooLarge(WireError):
    """A length prefix over the connection's limit: refused before any of the frame's body is read."""


@dataclass(frozen=True)
class Hello:
    """D's first frame, before either side is proven: who it says it is, and its challenge to P.
    Small on purpose (see MAX_UNAUTHENTICATED_FRAME_BYTES); its layout comes in LAYOUT."""

    type: ClassVar[str] = "hello"
    engine_id: str
    tp_rank: int
    tp_size: int
    nonce: str = ""  # D's challenge to P (auth.py); "" where the side channel is not authenticated


@dataclass(frozen=True)
class Layout:
    """D's KV cache as P needs it to write there, sent once both sides proved the key: its NIXL
    agent metadata, KV regions, the GPU they live on and the layout's identity."""

    type: ClassVar[str] = "layout"
    agent_name: str
    agent_metadata: bytes
    identity: LayoutIdentity
    regions: tuple[Region, ...]
    head_layouts: tuple[HeadLayout, ...]  # one per region
    device_id: int = 0  # the GPU the regions live on (NIXL descriptors name it); 0 for DRAM


@dataclass(frozen=True)
class Challenge:
    """P's answer to a HELLO: its proof of the key, and a nonce for D to prove it too (auth.py)."""

    type: ClassVar[str] = "challenge"
    engine_id: str
    tp_rank: int
    nonce: str
    proof: str


@dataclass(frozen=True)
class Auth:
    """D's proof of the key, answering P's CHALLENGE; it also binds the digest of the LAYOUT that
    D sends next (auth.py), so P takes that frame only as D made it."""

    type: ClassVar[str] = "auth"
    proof: str
    layout_digest: str


@dataclass(frozen=True)
class Welcome:
    type: ClassVar[str] = "welcome"
    engine_id: str


@dataclass(frozen=True)
class Refuse:
    type: ClassVar[str] = "refuse"
    engine_id: str
    reason: str


@dataclass(frozen=True)
class Register:
    """D's blocks for one transfer: P writes its blocks [first_block, first_block+len) into them."""

    type: ClassVar[str] = "register"
    transfer_id: str
    block_ids: tuple[int, ...]
    first_block: int
    num_tokens: int
    # The prompt's identity (kv_params.PromptIdentity) D loads it for: P writes nothing unless its
    # own request's is the same. -1 and "": not given (P then refuses to write).
    prompt_tokens: int = -1
    prompt_digest: str = ""


@dataclass(frozen=True)
class Cancel:
    type: ClassVar[str] = "cancel"
    transfer_id: str


@dataclass(frozen=True)
class Accepted:
    """P has the request for this transfer (queued or prefilling): D stops its no-show timer."""

    type: ClassVar[str] = "accepted"
    transfer_id: str


@dataclass(frozen=True)
class Streaming:
    """P's prefill is done and its WRITE starts now, one part per layer: D may schedule the request
    and wait for each layer's part (LANDED) as its forward pass reaches that layer."""

    type: ClassVar[str] = "streaming"
    transfer_id: str


@dataclass(frozen=True)
class Landed:
    """These regions (indices into D's LAYOUT) of the transfer hold their final bytes."""

    type: ClassVar[str] = "landed"
    transfer_id: str
    regions: tuple[int, ...]
    digest: str = ""  # verify_kv: kv_digest.py's digest of the bytes written into those regions ("" off)


@dataclass(frozen=True)
class Done:
    type: ClassVar[str] = "done"
    transfer_id: str
    num_bytes: int
    digest: str = ""  # verify_kv: kv_digest.py's digest of every byte the push wrote ("" off)


@dataclass(frozen=True)
class Fail:
    type: ClassVar[str] = "fail"
    transfer_id: str
    reason: str
    may_still_land: bool = False  # P gave up on a WRITE it could not recall: bytes may land later


@dataclass(frozen=True)
class Quiesced:
    """Every WRITE handle P posted for this transfer has ended (completed or failed): nothing more
    of it can land. Follows a FAIL with may_still_land; D holds the blocks until it comes."""

    type: ClassVar[str] = "quiesced"
    transfer_id: str


@dataclass(frozen=True)
class Ping:
    """D, while it waits on P: are you still there? (see liveness.py)"""

    type: ClassVar[str] = "ping"


@dataclass(frozen=True)
class Pong:
    type: ClassVar[str] = "pong"


Message = (Hello | Challenge | Auth | Layout | Welcome | Refuse | Register | Cancel | Accepted | Streaming | Landed
           | Done | Fail | Quiesced | Ping | Pong)
_TYPES: dict[str, type] = {cls.type: cls for cls in (Hello, Challenge, Auth, Layout, Welcome, Refuse, Register, Cancel,
                                                     Accepted, Streaming, Landed, Done, Fail, Quiesced, Ping, Pong)}
HANDSHAKE_TYPES = (Hello, Challenge, Auth, Refuse)  # what a peer may send before it is authenticated
MAX_ID_CHARS = 256
ID_PATTERN = re.compile(r"[A-Za-z0-9._:-]+")
HEX_64 = re.compile(r"[0-9a-f]{64}")
HEX_16 = re.compile(r"[0-9a-f]{16}")
MAX_INT = 2 ** 63 - 1  # every integer on the wire is an index, a size or an address: it fits an int64
MAX_LIST = 65536  # layers, regions: far above any model


def encode(msg: Message) -> bytes:
    body = asdict(msg)
    body["type"] = msg.type
    if isinstance(msg, Layout):
        body["agent_metadata"] = base64.b64encode(msg.agent_metadata).decode()
    data = json.dumps(body, separators=(",", ":")).encode()
    return LENGTH.pack(len(data)) + data


def decode(data: bytes) -> Message:
    """Decode one frame body (without the length prefix); raise WireError if it is not valid."""
    try:
        body = json.loads(data)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:  # RecursionError: nested too deep
        raise WireError(f"not JSON: {type(exc).__name__}") from None
    if not isinstance(body, dict):
        raise WireError("frame is not an object")
    kind = body.pop("type", None)
    cls = _TYPES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise WireError("unknown message type")
    try:
        return _BUILDERS[cls](body)
    except (KeyError, TypeError, ValueError) as exc:
        raise WireError(f"bad {kind}: {exc}") from None


def _exact_keys(body: dict, cls: type) -> None:
    expected = {f.name for f in fields(cls)}
    if set(body) != expected:
        raise WireError(f"fields {sorted(body)} != {sorted(expected)}")


def _str(value: Any, what: str) -> str:
    if not isinstance(value, str) or not value or len(value) > MAX_ID_CHARS:
        raise WireError(f"{what} must be a non-empty string of at most {MAX_ID_CHARS} chars")
    return value


def _id(value: Any, what: str) -> str:
    """An engine or transfer id: a name, never something that could spell a rank suffix (#)."""
    text = _str(value, what)
    if not ID_PATTERN.fullmatch(text):
        raise WireError(f"{what} must be letters, digits and . _ : - only")
    return text


def _text(value: Any, what: str) -> str:
    if not isinstance(value, str) or len(value) > 4096:
        raise WireError(f"{what} must be a string of at most 4096 chars")
    return value


def _int(value: Any, what: str, lo: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= MAX_INT:
        raise WireError(f"{what} must be an integer in [{lo}, 2**63)")
    return value


def _bool(value: Any, what: str) -> bool:
    if not isinstance(value, bool):
        raise WireError(f"{what} must be true or false")
    return value


def _ints(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise WireError(f"{what} must be a list")
    return tuple(_int(v, what) for v in value)


def _identity(body: Any) -> LayoutIdentity:
    if not isinstance(body, dict):
        raise WireError("identity must be an object")
    _exact_keys(body, LayoutIdentity)
    names = body["layer_names"]
    if not isinstance(names, list) or len(names) > MAX_LIST:
        raise WireError(f"layer_names must be a list of at most {MAX_LIST}")
    return LayoutIdentity(
        model=_text(body["model"], "model"),
        dtype=_str(body["dtype"], "dtype"),
        block_size=_int(body["block_size"], "block_size", 1),
        layer_names=tuple(_str(n, "layer name") for n in names),
        kv_heads=_int(body["kv_heads"], "kv_heads", 1),
    )


def _region(body: Any) -> Region:
    if not isinstance(body, dict):
        raise WireError("region must be an object")
    _exact_keys(body, Region)
    return Region(
        base=_int(body["base"], "base", 1),
        block_len=_int(body["block_len"], "block_len", 1),
        stride=_int(body["stride"], "stride", 1),
        num_blocks=_int(body["num_blocks"], "num_blocks", 1),
    )


def _head_layout(body: Any, region: Region) -> HeadLayout:
    if not isinstance(body, dict):
        raise WireError("head layout must be an object")
    _exact_keys(body, HeadLayout)
    layout = HeadLayout(heads=_int(body["heads"], "heads", 1), head_bytes=_int(body["head_bytes"], "head_bytes", 1),
                        chunk_offsets=_ints(body["chunk_offsets"], "chunk_offsets"))
    if not layout.chunk_offsets or any(
        o + layout.heads * layout.head_bytes > region.block_len for o in layout.chunk_offsets
    ):
        raise WireError("head layout reaches past its region's block")
    return layout


def _hello(body: dict) -> Hello:
    _exact_keys(body, Hello)
    tp_rank, tp_size = _int(body["tp_rank"], "tp_rank"), _int(body["tp_size"], "tp_size", 1)
    if tp_rank >= tp_size:
        raise WireError(f"tp_rank {tp_rank} is not below tp_size {tp_size}")
    return Hello(
        engine_id=_id(body["engine_id"], "engine_id"),
        tp_rank=tp_rank,
        tp_size=tp_size,
        nonce=_hex(body["nonce"], "nonce", allow_empty=True),
    )


def _layout(body: dict) -> Layout:
    _exact_keys(body, Layout)
    regions, head_layouts = body["regions"], body["head_layouts"]
    if not isinstance(regions, list) or not regions or len(regions) > MAX_LIST:
        raise WireError(f"regions must be a non-empty list of at most {MAX_LIST}")
    if not isinstance(head_layouts, list) or len(head_layouts) != len(regions):
        raise WireError("head_layouts must list one layout per region")
    try:
        metadata = base64.b64decode(body["agent_metadata"], validate=True)
    except (TypeError, ValueError):
        raise WireError("agent_metadata is not base64") from None
    parsed = tuple(_region(r) for r in regions)
    return Layout(
        agent_name=_str(body["agent_name"], "agent_name"),
        agent_metadata=metadata,
        identity=_identity(body["identity"]),
        regions=parsed,
        head_layouts=tuple(_head_layout(h, r) for h, r in zip(head_layouts, parsed)),
        device_id=_int(body["device_id"], "device_id"),
    )


def _hex(value: Any, what: str, allow_empty: bool = False) -> str:
    """A nonce or proof: 64 hex digits."""
    if isinstance(value, str) and (value == "" and allow_empty or HEX_64.fullmatch(value)):
        return value
    raise WireError(f"{what} must be 64 hex digits")


def _digest(value: Any, what: str) -> str:
    """A KV digest (kv_digest.py): 16 hex digits, or "" where prefill computes none."""
    if isinstance(value, str) and (value == "" or HEX_16.fullmatch(value)):
        return value
    raise WireError(f"{what} must be 16 hex digits or empty")


def _register(body: dict) -> Register:
    _exact_keys(body, Register)
    block_ids = _ints(body["block_ids"], "block_ids")
    if len(set(block_ids)) != len(block_ids):
        raise WireError("block_ids has duplicates")
    return Register(
        transfer_id=_id(body["transfer_id"], "transfer_id"),
        block_ids=block_ids,
        first_block=_int(body["first_block"], "first_block"),
        num_tokens=_int(body["num_tokens"], "num_tokens"),
        prompt_tokens=_int(body["prompt_tokens"], "prompt_tokens", lo=-1),
        prompt_digest=_hex(body["prompt_digest"], "prompt_digest", allow_empty=True),
    )


def _simple(cls: type, checks: dict):
    def build(body: dict):
        _exact_keys(body, cls)
        return cls(**{k: check(body[k], k) for k, check in checks.items()})
    return build


_BUILDERS = {
    Hello: _hello,
    Layout: _layout,
    Register: _register,
    Challenge: _simple(Challenge, {"engine_id": _id, "tp_rank": _int, "nonce": _hex, "proof": _hex}),
    Auth: _simple(Auth, {"proof": _hex, "layout_digest": _hex}),
    Welcome: _simple(Welcome, {"engine_id": _id}),
    Refuse: _simple(Refuse, {"engine_id": _id, "reason": _text}),
    Cancel: _simple(Cancel, {"transfer_id": _id}),
    Accepted: _simple(Accepted, {"transfer_id": _id}),
    Streaming: _simple(Streaming, {"transfer_id": _id}),
    Landed: _simple(Landed, {"transfer_id": _id, "regions": _ints, "digest": _digest}),
    Done: _simple(Done, {"transfer_id": _id, "num_bytes": _int, "digest": _digest}),
    Fail: _simple(Fail, {"transfer_id": _id, "reason": _text, "may_still_land": _bool}),
    Quiesced: _simple(Quiesced, {"transfer_id": _id}),
    Ping: _simple(Ping, {}),
    Pong: _simple(Pong, {}),
}


@dataclass
class FrameReader:
    """Splits a byte stream into frame bodies. The limit is checked on each frame's length prefix
    as that frame comes up, before its body is read or buffered past what one recv brought: a frame
    over it raises FrameTooLarge. The limit may change between frames (`next_frame`), so a frame
    that follows the one proving the peer is held to the limit of a proven peer."""

    max_frame: int = MAX_FRAME_BYTES
    buffer: bytearray = field(default_factory=bytearray)

    def feed(self, data: bytes) -> list[bytes]:
        self.add(data)
        frames = []
        while (frame := self.next_frame()) is not None:
            frames.append(frame)
        return frames

    def add(self, data: bytes) -> None:
        self.buffer += data

    def next_frame(self) -> bytes | None:
        """The next whole frame's body, or None until more bytes come."""
        if len(self.buffer) < LENGTH.size:
            return None
        (size,) = LENGTH.unpack_from(self.buffer)
        if size > self.max_frame:
            raise FrameTooLarge(f"frame of {size} bytes exceeds {self.max_frame}")
        if len(self.buffer) < LENGTH.size + size:
            return None
        frame = bytes(self.buffer[LENGTH.size:LENGTH.size + size])
        del self.buffer[:LENGTH.size + size]
        return frame
