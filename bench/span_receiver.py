"""A small OTLP/HTTP trace receiver the bench runs while it measures: vLLM instances on this host send
their per-request spans here (http/protobuf, POST /v1/traces), and the bench takes them per load level.

It listens on loopback only, on a port the kernel picks, and takes no more than it must: a body
needs a Content-Length of at most MAX_BODY_BYTES (gzip or deflate unpacked to at most that too),
connections are capped, a slow sender times out, and at most MAX_KEPT_SPANS records are held (the
bench takes its own after every load level). What it parses is opentelemetry-proto's
ExportTraceServiceRequest (engine_spans.parse_export); anything else gets a 4xx and is dropped.
"""
from __future__ import annotations

import threading
import time
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

from kvpush.common.errors import KvpushError

from .engine_spans import parse_export

TRACES_PATH = "/v1/traces"
LOOPBACK = "127.0.0.1"
MAX_BODY_BYTES = 16 * 1024 * 1024  # an SDK batch is 512 spans of ~1 KiB
MAX_KEPT_SPANS = 500_000
MAX_CONNECTIONS = 64
READ_TIMEOUT_S = 10.0
_DECOMPRESS = {"gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}


def _unpack(body: bytes, encoding: str) -> bytes:
    """The body as sent, unpacked (bounded: a small bomb cannot grow past MAX_BODY_BYTES)."""
    if encoding in ("", "identity"):
        return body
    unpacker = zlib.decompressobj(_DECOMPRESS[encoding])
    data = unpacker.decompress(body, MAX_BODY_BYTES)
    if unpacker.unconsumed_tail or not unpacker.eof:
        raise ValueError("unpacks beyond the size limit, or is truncated")
    return data


class SpanReceiver:
    """Start with `with SpanReceiver() as receiver:`; `endpoint` is what the instances are given."""

    def __init__(self, host: str = LOOPBACK, port: int = 0):
        self._records: list[dict] = []
        self._changed = threading.Condition()
        self.rejected = 0  # requests answered with a 4xx
        self.dropped = 0  # spans beyond MAX_KEPT_SPANS
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._server = _Server((host, port), _handler_for(self), self._slots)
        # shutdown() waits for one poll of the loop: stopping the receiver takes at most 50 ms
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="otlp-receiver", daemon=True)

    @property
    def endpoint(self) -> str:
        address = self._server.server_address  # (host, port) of a TCP server
        return f"http://{address[0]!s}:{address[1]}{TRACES_PATH}"

    def start(self) -> SpanReceiver:
        self._thread.start()
        return self

    def close(self) -> None:
        if self._thread.is_alive():
            self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> SpanReceiver:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def count_rejected(self) -> None:
        with self._changed:
            self.rejected += 1

    def add(self, records: list[dict]) -> None:
        with self._changed:
            room = MAX_KEPT_SPANS - len(self._records)
            self._records.extend(records[:max(room, 0)])
            self.dropped += max(len(records) - max(room, 0), 0)
            self._changed.notify_all()

    def take(self, keep: Callable[[dict], bool]) -> list[dict]:
        """Remove and return the records `keep` picks."""
        with self._changed:
            taken = [r for r in self._records if keep(r)]
            self._records = [r for r in self._records if not keep(r)]
            return taken

    def wait_until(self, done: Callable[[list[dict]], bool], timeout_s: float) -> bool:
        """Wait until `done(records held)` holds, at most timeout_s; whether it did."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while not done(list(self._records)):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._changed.wait(left)
            return True


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: type, slots: threading.BoundedSemaphore):
        self._slots = slots
        super().__init__(address, handler)

    def process_request(self, request, client_address) -> None:
        if not self._slots.acquire(blocking=False):  # too many connections: this one is closed unread
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


def _handler_for(receiver: SpanReceiver) -> type:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # the exporter keeps its connection; every answer has a length
        timeout = READ_TIMEOUT_S

        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            if self.path != TRACES_PATH:
                return self._answer(404, b"only POST /v1/traces", keep=False)
            length = self.headers.get("Content-Length")
            encoding = (self.headers.get("Content-Encoding") or "").strip().lower()
            if length is None or not length.isdigit():
                return self._answer(411, b"a Content-Length is required", keep=False)
            if int(length) > MAX_BODY_BYTES:
                return self._answer(413, b"body too large", keep=False)
            body = self.rfile.read(int(length))
            if len(body) < int(length):
                self.close_connection = True
                return None
            if encoding not in ("", "identity", *_DECOMPRESS):
                return self._answer(415, b"unsupported Content-Encoding", keep=True)
            try:
                records = parse_export(_unpack(body, encoding))
            except (KvpushError, ValueError, zlib.error) as exc:
                return self._answer(400, str(exc).encode()[:200], keep=True)
            receiver.add(records)
            # an empty ExportTraceServiceResponse: full success
            self._answer(200, b"", keep=True, content_type="application/x-protobuf")

        def do_GET(self) -> None:  # noqa: N802
            self._answer(405, b"only POST /v1/traces", keep=False)

        def _answer(self, status: int, body: bytes, keep: bool, content_type: str = "text/plain") -> None:
            if status >= 400:
                receiver.count_rejected()
            self.close_connection = not keep
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            if not keep:
                self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the bench prints its own lines
            pass

    return Handler
