"""StreamRelay: chunk framing, end-of-stream bookkeeping and back-pressure toward the client."""
from __future__ import annotations

import asyncio

from kvpush.router.relay import HIGH_WATER, StreamRelay

DONE = b"data: [DONE]\n\n"


class _ClientTransport:
    def __init__(self):
        self.written = bytearray()
        self.unsent = 0
        self.closing = False

    def write(self, data: bytes) -> None:
        self.written += data

    def is_closing(self) -> bool:
        return self.closing

    def get_write_buffer_size(self) -> int:
        return self.unsent


def test_pieces_are_framed_as_http_chunks_and_the_tail_is_kept():
    transport = _ClientTransport()
    relay = StreamRelay(transport, True, b"data: first\n\n", len(DONE))  # type: ignore[arg-type]
    assert relay(b"data: x\n\n") is False
    assert relay(b"data: [DO") is False and relay(b"NE]\n\n") is False  # the end marker split over two reads
    assert bytes(transport.written) == b"9\r\ndata: x\n\n\r\n9\r\ndata: [DO\r\n5\r\nNE]\n\n\r\n"
    assert relay.tail == DONE and not relay.saw_error


def test_an_http10_client_gets_the_pieces_unframed():
    transport = _ClientTransport()
    relay = StreamRelay(transport, False, b"", len(DONE))  # type: ignore[arg-type]
    relay(b"data: x\n\n")
    assert bytes(transport.written) == b"data: x\n\n"


def test_error_events_are_noticed():
    relay = StreamRelay(_ClientTransport(), True, b"", len(DONE))  # type: ignore[arg-type]
    relay(b'data: {"error": {"message": "boom"}}\n\n')
    assert relay.saw_error


def test_a_full_client_buffer_asks_to_pause_and_drained_waits_for_it():
    async def scenario():
        transport = _ClientTransport()
        relay = StreamRelay(transport, True, b"", len(DONE))  # type: ignore[arg-type]
        transport.unsent = HIGH_WATER + 1
        assert relay(b"data: x\n\n") is True
        waiter = asyncio.ensure_future(relay.drained())
        await asyncio.sleep(0.01)
        assert not waiter.done()
        transport.unsent = 0
        await asyncio.wait_for(waiter, 1)
        assert not relay.client_gone

    asyncio.run(scenario())


def test_a_closing_client_stops_the_relay():
    transport = _ClientTransport()
    relay = StreamRelay(transport, True, b"", len(DONE))  # type: ignore[arg-type]
    transport.closing = True
    assert relay(b"data: x\n\n") is True
    assert relay.client_gone and transport.written == b""
