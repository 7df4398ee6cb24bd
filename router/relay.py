"""The decode stream after its first token, from the instance's connection straight into the client's.

Each parsed piece is written, framed as an HTTP chunk, in the instance connection's data callback:
no coroutine step per token. A step resumed the whole chain of awaiting frames (aiohttp's handler,
middleware, dispatcher) and went through aiohttp's writer, which together cost about as much CPU
as the rest of a request; at 64 streams that is most of the router's work.
"""
from __future__ import annotations

import asyncio

ERROR_MARKER = b'{"error"'
HIGH_WATER = 1 << 16  # unsent bytes to the client above which the instance's answer stops being read
DRAIN_POLL_S = 0.002


class StreamRelay:
    """The sink of UpstreamResponse.forward: writes each piece to the client's transport and keeps
    what the end of the stream is judged by (its last bytes, whether an error event went by)."""

    def __init__(self, transport: asyncio.Transport, chunked: bool, tail: bytes, keep: int):
        self.transport = transport
        self.chunked = chunked  # False for an HTTP/1.0 client: the body goes unframed until close
        self.tail = tail[-keep:]
        self.keep = keep
        self.saw_error = False
        self.client_gone = False

    def __call__(self, piece: bytes) -> bool:
        """Forward one piece; True asks the instance's connection to pause."""
        transport = self.transport
        if self.client_gone or transport.is_closing():
            self.client_gone = True
            return True
        # an HTTP/1.1 chunk, exactly as aiohttp's writer frames one
        transport.write(b"%x\r\n%b\r\n" % (len(piece), piece) if self.chunked else piece)
        if ERROR_MARKER in piece:
            self.saw_error = True
        keep = self.keep
        self.tail = piece[-keep:] if len(piece) >= keep else (self.tail + piece)[-keep:]
        return transport.get_write_buffer_size() > HIGH_WATER

    async def drained(self) -> None:
        """Wait until the client took most of what was written (only when it reads slower than
        the stream comes)."""
        transport = self.transport
        while transport.get_write_buffer_size() > HIGH_WATER // 2 and not transport.is_closing():
            await asyncio.sleep(DRAIN_POLL_S)
        if transport.is_closing():
            self.client_gone = True
