"""kvpush.bench.span_receiver and engine_spans.parse_export: what the OpenTelemetry SDK's own OTLP/HTTP
exporter sends (as vLLM's API server does) arrives as records; anything else is refused and bounded."""
from __future__ import annotations

import gzip
import http.client
import zlib

import pytest
from opentelemetry.exporter.otlp.proto.http import Compression
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from kvpush.common.errors import KvpushError
from kvpush.bench import span_receiver
from kvpush.bench.engine_spans import EngineSpan, parse_export
from kvpush.bench.span_receiver import SpanReceiver

ARRIVAL_NS = 1_800_000_000_123_456_789


@pytest.fixture
def receiver():
    with SpanReceiver() as r:
        yield r


def send_spans(endpoint: str, compression: Compression = Compression.NoCompression) -> None:
    """Spans as vLLM sends them: the SDK's OTLP/HTTP exporter, the resource named as deploy/plan/engine_tracing.py says."""
    resource = Resource.create({"service.name": "prefill-0", "kvpush.deployment": "dep", "kvpush.role": "prefill"})
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(endpoint=endpoint, compression=compression)))
    tracer = provider.get_tracer("test")
    tracer.start_span("llm_request", start_time=ARRIVAL_NS, attributes={
        "gen_ai.request.id": "cmpl-abc-0", "gen_ai.latency.time_to_first_token": 0.25,
        "gen_ai.latency.time_in_queue": 0.01, "gen_ai.latency.time_in_model_prefill": 0.2,
        "gen_ai.usage.prompt_tokens": 256}).end()
    tracer.start_span("not-a-request").end()  # vLLM's other spans (model loading, ...)
    provider.shutdown()


@pytest.mark.parametrize("compression", [Compression.NoCompression, Compression.Gzip, Compression.Deflate])
def test_the_sdks_exporter_delivers_request_spans_as_records(receiver, compression):
    assert receiver.endpoint.startswith("http://127.0.0.1:") and receiver.endpoint.endswith("/v1/traces")
    send_spans(receiver.endpoint, compression)
    assert receiver.wait_until(lambda held: len(held) == 1, timeout_s=10)
    [record] = receiver.take(lambda r: True)
    assert (record["deployment"], record["instance"], record["role"]) == ("dep", "prefill-0", "prefill")
    assert record["start_unix_nano"] == ARRIVAL_NS
    span = EngineSpan.of(record)
    assert span.request_id == "cmpl-abc-0" and span.ttft_s == 0.25 and span.prefill_s == 0.2
    assert span.first_token_s == pytest.approx(1_800_000_000.373457, abs=1e-6)
    assert span.compute_start_s == pytest.approx(1_800_000_000.173457, abs=1e-6)
    assert receiver.take(lambda r: True) == [] and receiver.rejected == 0


def test_take_leaves_what_it_does_not_pick_and_wait_gives_up(receiver):
    receiver.add([{"n": 1}, {"n": 2}])
    assert receiver.take(lambda r: r["n"] == 2) == [{"n": 2}]
    assert receiver.wait_until(lambda held: held == [{"n": 1}], timeout_s=0)
    assert not receiver.wait_until(lambda held: len(held) == 2, timeout_s=0.05)


def post(endpoint: str, body: bytes, headers: dict[str, str], path: str = "/v1/traces") -> int:
    host, port = endpoint.removeprefix("http://").split("/")[0].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        conn.putrequest("POST", path, skip_accept_encoding=True)
        for name, value in headers.items():
            conn.putheader(name, value)
        conn.endheaders()
        if body:
            conn.send(body)
        return conn.getresponse().status
    finally:
        conn.close()


def test_anything_but_a_bounded_trace_export_is_refused(receiver, monkeypatch):
    monkeypatch.setattr(span_receiver, "MAX_BODY_BYTES", 1024)
    export = ExportTraceServiceRequest().SerializeToString()
    ok = {"Content-Type": "application/x-protobuf", "Content-Length": str(len(export))}
    assert post(receiver.endpoint, export, ok) == 200
    assert post(receiver.endpoint, export, ok, path="/v1/metrics") == 404
    assert post(receiver.endpoint, b"", {"Content-Length": "4096"}) == 413  # refused before a byte is read
    assert post(receiver.endpoint, b"5\r\nhello\r\n0\r\n\r\n", {"Transfer-Encoding": "chunked"}) == 411
    garbage = b"\xff" * 64
    assert post(receiver.endpoint, garbage, {"Content-Length": str(len(garbage))}) == 400
    bomb = gzip.compress(b"\0" * 1_000_000)  # ~1 KB that unpacks to 1 MB
    assert len(bomb) < 1024 and post(receiver.endpoint, bomb, {"Content-Length": str(len(bomb)), "Content-Encoding": "gzip"}) == 400
    packed = zlib.compress(export)
    assert post(receiver.endpoint, packed, {"Content-Length": str(len(packed)), "Content-Encoding": "br"}) == 415
    assert receiver.rejected == 6 and receiver.take(lambda r: True) == []


def test_records_beyond_the_bound_are_counted_not_kept(receiver, monkeypatch):
    monkeypatch.setattr(span_receiver, "MAX_KEPT_SPANS", 3)
    receiver.add([{"n": i} for i in range(5)])
    assert len(receiver.take(lambda r: True)) == 3 and receiver.dropped == 2


def test_a_body_that_is_no_trace_export_is_an_error():
    with pytest.raises(KvpushError, match="not an OTLP trace export"):
        parse_export(b"\x0a\xff\xff\xff\xff\x0f")
    assert parse_export(b"") == []  # an empty export is valid: no spans
