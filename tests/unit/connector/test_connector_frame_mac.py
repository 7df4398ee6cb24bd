"""kvpush.connector.frame_mac: a sealed frame opens only as the next frame of its own direction of
its own connection, exactly as it was sent."""
from __future__ import annotations

import pytest

from kvpush.connector import auth, wire
from kvpush.connector.frame_mac import TAG_BYTES, FrameMacError, session_keys

KEY = b"k" * 32
NONCE_D, NONCE_P = auth.new_nonce(), auth.new_nonce()


def pair(key=KEY, nonce_d=NONCE_D, nonce_p=NONCE_P, sender="decode"):
    """(sealer of `sender`, the other side's opener) of one connection."""
    keys = session_keys(key, nonce_d, nonce_p)
    receiver = "prefill" if sender == "decode" else "decode"
    return keys.sealer(sender), keys.opener(receiver)


def body(sealed: bytes) -> bytes:
    """As FrameReader hands a frame over: without its length prefix (checked here too)."""
    (size,) = wire.LENGTH.unpack_from(sealed)
    assert size == len(sealed) - wire.LENGTH.size
    return sealed[wire.LENGTH.size:]


FRAMES = [wire.encode(m) for m in (wire.Register("t1", (1, 2, 3), 0, 48), wire.Cancel("t1"), wire.Ping(),
                                   wire.Done("t1", 4096))]


@pytest.mark.parametrize("sender", ["decode", "prefill"])
def test_frames_open_in_order_as_sent_and_the_length_prefix_counts_the_tag(sender):
    sealer, opener = pair(sender=sender)
    for plain in FRAMES:
        sealed = sealer.seal(plain)
        assert len(sealed) == len(plain) + TAG_BYTES
        assert wire.decode(opener.open(body(sealed))) == wire.decode(plain[wire.LENGTH.size:])
    assert sealer.seq == opener.seq == len(FRAMES)


def test_a_plain_frame_does_not_open():
    _, opener = pair()
    with pytest.raises(FrameMacError):
        opener.open(FRAMES[0][wire.LENGTH.size:])


@pytest.mark.parametrize("where", ["first body byte", "last body byte", "first tag byte", "last tag byte"])
def test_a_change_to_any_byte_of_a_frame_fails(where):
    sealer, opener = pair()
    sealed = bytearray(sealer.seal(FRAMES[3]))
    index = {"first body byte": wire.LENGTH.size, "last body byte": len(sealed) - TAG_BYTES - 1,
             "first tag byte": len(sealed) - TAG_BYTES, "last tag byte": len(sealed) - 1}[where]
    sealed[index] ^= 0x01
    with pytest.raises(FrameMacError):
        opener.open(bytes(sealed[wire.LENGTH.size:]))


@pytest.mark.parametrize("delta", [-1, 1])
def test_a_changed_length_prefix_fails(delta):
    """The frame then ends elsewhere in the stream: its tag is not where the sender put it."""
    sealer, opener = pair()
    sealed = sealer.seal(FRAMES[0]) + sealer.seal(FRAMES[1])
    (size,) = wire.LENGTH.unpack_from(sealed)
    reader = wire.FrameReader()
    reader.add(wire.LENGTH.pack(size + delta) + sealed[wire.LENGTH.size:])
    with pytest.raises(FrameMacError):
        opener.open(reader.next_frame())


def test_a_body_changed_in_place_with_a_recomputed_length_fails():
    """e.g. a DONE's byte count rewritten on the way, the frame kept well formed."""
    sealer, opener = pair()
    sealed = sealer.seal(wire.encode(wire.Done("t1", 4096)))
    forged = sealed[wire.LENGTH.size:-TAG_BYTES].replace(b"4096", b"8192") + sealed[-TAG_BYTES:]
    with pytest.raises(FrameMacError):
        opener.open(forged)


def test_a_replayed_frame_fails():
    sealer, opener = pair()
    first = sealer.seal(FRAMES[1])
    opener.open(body(first))
    with pytest.raises(FrameMacError):
        opener.open(body(first))


def test_frames_out_of_order_fail():
    sealer, opener = pair()
    first, second = sealer.seal(FRAMES[0]), sealer.seal(FRAMES[1])
    with pytest.raises(FrameMacError):
        opener.open(body(second))
    del first


def test_a_frame_dropped_from_the_middle_makes_the_next_fail():
    sealer, opener = pair()
    opener.open(body(sealer.seal(FRAMES[0])))
    sealer.seal(FRAMES[1])  # never delivered
    with pytest.raises(FrameMacError):
        opener.open(body(sealer.seal(FRAMES[2])))


def test_a_frame_reflected_to_its_sender_fails():
    """D's PING sent back to D as if it were P's frame: the directions have their own keys."""
    keys = session_keys(KEY, NONCE_D, NONCE_P)
    ping = keys.sealer("decode").seal(wire.encode(wire.Ping()))
    with pytest.raises(FrameMacError):
        keys.opener("decode").open(body(ping))  # what D opens P's frames with


def test_a_frame_of_another_connection_fails():
    """Same key, same sequence number, another handshake's nonces."""
    sealer, _ = pair()
    _, other = pair(nonce_p=auth.new_nonce())
    with pytest.raises(FrameMacError):
        other.open(body(sealer.seal(FRAMES[0])))


def test_a_frame_sealed_with_another_deployment_s_key_fails():
    sealer, _ = pair(key=b"x" * 32)
    _, opener = pair()
    with pytest.raises(FrameMacError):
        opener.open(body(sealer.seal(FRAMES[0])))


@pytest.mark.parametrize("cut", [1, TAG_BYTES, TAG_BYTES + 5])
def test_a_frame_cut_short_fails(cut):
    sealer, opener = pair()
    sealed = body(sealer.seal(FRAMES[0]))
    with pytest.raises(FrameMacError):
        opener.open(sealed[:-cut])


def test_a_frame_shorter_than_a_tag_fails_naming_why():
    _, opener = pair()
    with pytest.raises(FrameMacError, match="cannot hold its 16-byte tag"):
        opener.open(b"{}")


def test_a_failed_frame_does_not_advance_the_sequence():
    sealer, opener = pair()
    good = sealer.seal(FRAMES[0])
    with pytest.raises(FrameMacError):
        opener.open(body(good)[:-1] + bytes([body(good)[-1] ^ 1]))
    assert opener.seq == 0


def test_each_direction_and_each_connection_has_its_own_keys():
    keys = session_keys(KEY, NONCE_D, NONCE_P)
    other = session_keys(KEY, NONCE_D, auth.new_nonce())
    swapped = session_keys(KEY, NONCE_P, NONCE_D)
    assert len({keys.decode, keys.prefill, other.decode, other.prefill, swapped.decode, swapped.prefill}) == 6
    assert KEY not in (keys.decode, keys.prefill)
