"""HTTP/1.1 answer parsing for the router's upstream client: a state machine fed the bytes of
one answer as they arrive (head, then a body framed by Content-Length, chunks, or the connection's
end), with no copying of the buffer it is given.

The class holding the answer (upstream_answer.UpstreamResponse) owns the state this works on and
says what happens once the answer ends (`_finish`).
"""
from __future__ import annotations

_HEAD_END = b"\r\n\r\n"
_CRLF = b"\r\n"


class UpstreamError(Exception):
    """The connection failed, closed early, or carried something that is not an HTTP/1.1 answer."""


class AnswerParser:
    """Parses one answer into `status`, `headers` and body pieces (`_body`, `_body_size`)."""

    status: int
    headers: dict[str, str]
    _mode: str  # head -> length | chunk_size | chunk_data | chunk_crlf | trailer | until_eof -> done
    _remaining: int
    _reusable: bool
    _body: list[bytes]
    _body_size: int

    def _finish(self, reusable: bool) -> None:
        raise NotImplementedError

    def _take_body(self, data: bytes, pos: int, end: int) -> None:
        self._body.append(data[pos:end] if pos or end < len(data) else data)
        self._body_size += end - pos

    def _parse(self, data: bytes) -> bytes:
        """Consume what `data` holds; return the unparsed rest (an incomplete head or chunk line).

        Offsets into one bytes object, no buffer edits: an SSE event usually arrives as exactly
        one chunk, and this runs once per event."""
        pos, size = 0, len(data)
        while pos < size:
            mode = self._mode
            if mode == "chunk_size":
                end = data.find(_CRLF, pos)
                if end < 0:
                    if size - pos > 1024:
                        raise UpstreamError("chunk size line over 1 KiB")
                    return data[pos:]
                line = data[pos:end]
                try:
                    self._remaining = int(line.split(b";", 1)[0] if b";" in line else line, 16)
                except ValueError:
                    raise UpstreamError(f"bad chunk size line {line[:40]!r}") from None
                pos = end + 2
                self._mode = "chunk_data" if self._remaining else "trailer"
            elif mode == "chunk_data" or mode == "length":
                end = min(pos + self._remaining, size)
                self._take_body(data, pos, end)
                self._remaining -= end - pos
                pos = end
                if self._remaining:
                    return b""
                if mode == "length":
                    self._finish(reusable=pos == size)
                else:
                    self._mode = "chunk_crlf"
            elif mode == "chunk_crlf":
                if size - pos < 2:
                    return data[pos:]
                if data[pos:pos + 2] != _CRLF:
                    raise UpstreamError("chunk not followed by CRLF")
                pos += 2
                self._mode = "chunk_size"
            elif mode == "head":
                end = data.find(_HEAD_END, pos)
                if end < 0:
                    if size - pos > 65536:
                        raise UpstreamError("answer head over 64 KiB")
                    return data[pos:]
                head = data[pos:end]
                pos = end + 4
                self._parse_head(head, nothing_after=pos == size)
            elif mode == "trailer":
                end = data.find(_CRLF, pos)
                if end < 0:
                    return data[pos:]
                empty_line = end == pos
                pos = end + 2
                if empty_line:
                    self._finish(reusable=pos == size)
            elif mode == "until_eof":
                self._take_body(data, pos, size)
                return b""
            else:  # done: bytes after the answer's end; the connection was already handed back
                return b""
        return b""

    def _parse_head(self, head: bytes, nothing_after: bool) -> None:
        lines = head.split(_CRLF)
        status_line = lines[0].split(b" ", 2)
        if len(status_line) < 2 or not status_line[0].startswith(b"HTTP/1."):
            raise UpstreamError(f"not an HTTP/1.x answer: {lines[0][:60]!r}")
        try:
            status = int(status_line[1])
        except ValueError:
            raise UpstreamError(f"bad status line {lines[0][:60]!r}") from None
        if 100 <= status < 200:  # an interim answer: the real one follows
            return
        headers = {}
        for line in lines[1:]:
            name, sep, value = line.partition(b":")
            if sep:
                headers[name.strip().lower().decode("latin-1")] = value.strip().decode("latin-1")
        self.status, self.headers = status, headers
        connection = headers.get("connection", "").lower()
        self._reusable = status_line[0] == b"HTTP/1.1" and "close" not in connection
        if "chunked" in headers.get("transfer-encoding", "").lower():
            self._mode = "chunk_size"
        elif "content-length" in headers:
            try:
                self._remaining = int(headers["content-length"])
            except ValueError:
                raise UpstreamError(f"bad Content-Length {headers['content-length']!r}") from None
            self._mode = "length"
            if not self._remaining:
                self._finish(reusable=nothing_after)
        elif status in (204, 304):
            self._finish(reusable=nothing_after)
        else:
            self._mode = "until_eof"
            self._reusable = False
