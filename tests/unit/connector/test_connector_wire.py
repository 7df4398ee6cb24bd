"""Wire messages: round trips, and every kind of malformed frame is a WireError (never a crash)."""
from __future__ import annotations

import json

import pytest

from kvpush.connector import wire
from kvpush.connector.regions import HeadLayout, LayoutIdentity, Region

IDENTITY = LayoutIdentity("m", "bfloat16", 128, ("l0", "l1"), 2)
REGIONS = (Region(4096, 65536, 65536, 10), Region(1 << 30, 65536, 65536, 10))
HEADS = tuple(HeadLayout.whole(r.block_len) for r in REGIONS)
MESSAGES = [
    wire.Hello("D.e", 0, 1), wire.Hello("D.e", 1, 2, "ab" * 32),
    wire.Layout("agent", b"\x00\xffmeta", IDENTITY, REGIONS, HEADS),
    wire.Layout("agent", b"meta", IDENTITY, REGIONS, (HeadLayout(2, 16384, (0, 32768)),) * 2, device_id=3),
    wire.Challenge("P.e", 1, "cd" * 32, "ef" * 32), wire.Auth("01" * 32, "23" * 32),
    wire.Welcome("P.e"), wire.Refuse("P.e", "no"),
    wire.Register("t1", (5, 3, 9), 1, 300), wire.Cancel("t1"), wire.Accepted("t1"),
    wire.Done("t1", 4096), wire.Fail("t1", "boom"), wire.Streaming("t1"), wire.Landed("t1", (0, 3)),
    wire.Fail("t1", "still copying", may_still_land=True), wire.Quiesced("t1"),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: m.type)
def test_round_trip(msg):
    frame = wire.encode(msg)
    [body] = wire.FrameReader().feed(frame)
    assert wire.decode(body) == msg


def test_frame_reader_splits_and_joins_partial_frames():
    data = b"".join(wire.encode(m) for m in MESSAGES)
    reader, got = wire.FrameReader(), []
    for i in range(0, len(data), 7):
        got += reader.feed(data[i:i + 7])
    assert [wire.decode(b) for b in got] == MESSAGES


def test_oversized_frame_is_refused():
    with pytest.raises(wire.FrameTooLarge):
        wire.FrameReader().feed(wire.LENGTH.pack(wire.MAX_FRAME_BYTES + 1))


def test_a_frame_over_the_unproven_limit_is_refused_on_its_length_prefix_alone():
    """The refusal comes from the 4-byte prefix: no body byte is needed, none is decoded."""
    reader = wire.FrameReader(wire.MAX_UNAUTHENTICATED_FRAME_BYTES)
    with pytest.raises(wire.FrameTooLarge, match="exceeds 4096"):
        reader.feed(wire.LENGTH.pack(wire.MAX_UNAUTHENTICATED_FRAME_BYTES + 1))
    assert wire.FrameReader(4096).feed(wire.LENGTH.pack(4096) + b"x" * 4096) == [b"x" * 4096]  # the cap itself passes


def test_a_frame_behind_the_one_that_proves_the_peer_gets_the_proven_limit():
    """AUTH and the LAYOUT behind it may arrive in one read: the limit is checked per frame, as
    each comes up, so the LAYOUT is held to the limit in force once AUTH was handled."""
    big = wire.LENGTH.pack(10_000) + b"y" * 10_000
    reader = wire.FrameReader(wire.MAX_UNAUTHENTICATED_FRAME_BYTES)
    reader.add(wire.encode(wire.Auth("01" * 32, "23" * 32)) + big)
    assert isinstance(wire.decode(reader.next_frame()), wire.Auth)
    reader.max_frame = wire.MAX_FRAME_BYTES  # what Connection.trust() does
    assert reader.next_frame() == b"y" * 10_000 and reader.next_frame() is None


def test_every_message_before_the_proof_fits_the_unproven_limit_at_its_largest():
    longest = "x" * wire.MAX_ID_CHARS
    for msg in (wire.Hello(longest, 2 ** 63 - 2, 2 ** 63 - 1, "ab" * 32),
                wire.Challenge(longest, 2 ** 63 - 1, "cd" * 32, "ef" * 32), wire.Auth("01" * 32, "23" * 32)):
        assert len(wire.encode(msg)) - wire.LENGTH.size <= wire.MAX_UNAUTHENTICATED_FRAME_BYTES


def body_of(msg) -> dict:
    return json.loads(wire.encode(msg)[4:])


@pytest.mark.parametrize("mutate", [
    lambda b: b"not json",
    lambda b: b"[1, 2]",
    lambda b: json.dumps({**b, "type": "nope"}).encode(),
    lambda b: json.dumps({**b, "extra": 1}).encode(),
    lambda b: json.dumps({k: v for k, v in b.items() if k != "block_ids"}).encode(),
    lambda b: json.dumps({**b, "block_ids": [1, -2]}).encode(),
    lambda b: json.dumps({**b, "block_ids": [1, 1]}).encode(),
    lambda b: json.dumps({**b, "block_ids": "1,2"}).encode(),
    lambda b: json.dumps({**b, "first_block": True}).encode(),
    lambda b: json.dumps({**b, "transfer_id": ""}).encode(),
    lambda b: json.dumps({**b, "transfer_id": "x" * 1000}).encode(),
    lambda b: b"\xff\xfe",
])
def test_malformed_register_is_wire_error(mutate):
    with pytest.raises(wire.WireError):
        wire.decode(mutate(body_of(wire.Register("t", (1, 2), 0, 10))))


@pytest.mark.parametrize("mutate", [
    lambda b: {**b, "agent_metadata": "***"},
    lambda b: {**b, "regions": []},
    lambda b: {**b, "regions": [{"base": 0, "block_len": 1, "stride": 1, "num_blocks": 1}]},
    lambda b: {**b, "identity": {**b["identity"], "block_lens": [1]}},
    lambda b: {**b, "identity": "x"},
])
def test_malformed_layout_is_wire_error(mutate):
    with pytest.raises(wire.WireError):
        wire.decode(json.dumps(mutate(body_of(MESSAGES[2]))).encode())


@pytest.mark.parametrize("mutate", [
    lambda b: {**b, "nonce": "zz"},
    lambda b: {**b, "tp_rank": 2},
    lambda b: {**b, "engine_id": "D#1"},
    lambda b: {**b, "agent_metadata": ""},  # the layout belongs in LAYOUT, after the proof
])
def test_malformed_hello_is_wire_error(mutate):
    with pytest.raises(wire.WireError):
        wire.decode(json.dumps(mutate(body_of(MESSAGES[1]))).encode())


def test_identity_mismatch_names_both_values():
    other = LayoutIdentity("m2", "float16", 16, ("l0", "l2"), 2)
    diffs = " ".join(IDENTITY.mismatches(other))
    assert "model: 'm' vs 'm2'" in diffs and "'bfloat16' vs 'float16'" in diffs and "128 vs 16" in diffs
    assert "l1" in diffs and "l2" in diffs
    assert IDENTITY.mismatches(IDENTITY) == []


@pytest.mark.parametrize("body", [
    {"type": "landed", "transfer_id": "t1", "regions": [0, -1]},
    {"type": "landed", "transfer_id": "t1", "regions": 3},
    {"type": "landed", "transfer_id": "t1"},
    {"type": "streaming", "transfer_id": ""},
    {"type": "streaming", "transfer_id": "t1", "regions": []},
])
def test_malformed_streaming_messages_are_wire_errors(body):
    with pytest.raises(wire.WireError):
        wire.decode(json.dumps(body).encode())


@pytest.mark.parametrize("data", [
    b'{"type": []}',  # an unhashable type name
    b"[" * 100_000 + b"]" * 100_000,  # nested past the parser's recursion limit
    b'{"type":"register","transfer_id":"t","block_ids":[%d],"first_block":0,"num_tokens":1}' % 2 ** 63,
    b'{"type":"done","transfer_id":"t","num_bytes":%d}' % 2 ** 70,
])
def test_frames_that_used_to_escape_as_other_errors_are_wire_errors(data):
    with pytest.raises(wire.WireError):
        wire.decode(data)
