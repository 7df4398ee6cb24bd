"""vLLM's per-request OpenTelemetry spans, as the bench reads them (pure: bytes and dicts in, records out).

With `--otlp-traces-endpoint`, a vLLM API server exports one `llm_request` span per finished
request: its start is the request's arrival at the server (wall clock), its attributes the request
id vLLM derived from the X-Request-Id header and the engine's own timings. `parse_export` turns an
OTLP ExportTraceServiceRequest (protobuf, as opentelemetry-proto defines it) into plain records:
the instance that sent it (the resource attributes deploy/plan/engine_tracing.py sets) and the span's
attributes as they came. The bench keeps these records as its raw spans; `EngineSpan.of` reads the
figures the handoff diagnostic needs from one record, the same way live and in `--recompute`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from kvpush.common.errors import KvpushError
from kvpush.deploy.plan.engine_tracing import DEPLOYMENT_ATTRIBUTE, INSTANCE_ATTRIBUTE, ROLE_ATTRIBUTE

REQUEST_SPAN = "llm_request"  # vLLM's one span per request (v1 OutputProcessor.do_tracing)
# vLLM's span attributes (vllm.tracing.utils.SpanAttributes), in seconds where they are times
REQUEST_ID = "gen_ai.request.id"
TIME_TO_FIRST_TOKEN = "gen_ai.latency.time_to_first_token"  # arrival -> first token, at the API server (wall clock)
TIME_IN_QUEUE = "gen_ai.latency.time_in_queue"  # queued -> first scheduled, engine clock
TIME_IN_PREFILL = "gen_ai.latency.time_in_model_prefill"  # first scheduled -> first token, engine clock
E2E = "gen_ai.latency.e2e"
PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"
COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"
MAX_ID_CHARS = 1024  # far above any id vLLM derives from a 256-character X-Request-Id


def _value(any_value: Any) -> Any:
    """An OTLP AnyValue's scalar (None for arrays, maps and bytes: vLLM's request span has none)."""
    kind = any_value.WhichOneof("value")
    if kind in ("string_value", "bool_value", "int_value", "double_value"):
        return getattr(any_value, kind)
    return None


def _attributes(key_values: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kv in key_values:
        value = _value(kv.value)
        if value is not None:
            out[kv.key] = value
    return out


def parse_export(body: bytes) -> list[dict]:
    """The `llm_request` spans of one OTLP trace export, as records: {"deployment", "instance", "role",
    "start_unix_nano", "end_unix_nano", "attributes"}. KvpushError if the body is not such an export."""
    try:
        from google.protobuf.message import DecodeError
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
    except ImportError as exc:
        raise KvpushError(f"cannot read vLLM's traces: {exc}; install kvpush[bench] (opentelemetry-proto)") from None
    request = ExportTraceServiceRequest()
    try:
        request.ParseFromString(body)
    except (DecodeError, RecursionError, ValueError) as exc:
        raise KvpushError(f"not an OTLP trace export ({type(exc).__name__})") from None
    records = []
    for resource_spans in request.resource_spans:
        resource = _attributes(resource_spans.resource.attributes)
        source = {"deployment": resource.get(DEPLOYMENT_ATTRIBUTE), "instance": resource.get(INSTANCE_ATTRIBUTE),
                  "role": resource.get(ROLE_ATTRIBUTE)}
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                if span.name == REQUEST_SPAN:
                    records.append(
                        {
                            **source,
                            "start_unix_nano": span.start_time_unix_nano,
                            "end_unix_nano": span.end_time_unix_nano,
                            "attributes": _attributes(span.attributes),
                        }
                    )
    return records


@dataclass(frozen=True)
class EngineSpan:
    """One request on one instance, in seconds (arrival and first token: wall clock, Unix time)."""

    deployment: str
    instance: str
    role: str  # prefill | decode
    request_id: str  # as vLLM named the request: cmpl-<X-Request-Id>-<prompt index>, chatcmpl-<X-Request-Id>
    arrival_s: float
    ttft_s: float
    queue_s: float
    prefill_s: float  # engine time from first scheduled to first token: the prompt's forward(s), and
    # anything a connector does inside that step (kvpush's CPU WRITE)

    @property
    def first_token_s(self) -> float:
        return self.arrival_s + self.ttft_s

    @property
    def compute_start_s(self) -> float:
        """When the engine first scheduled the request, as a wall-clock time (first token less time in prefill)."""
        return self.first_token_s - self.prefill_s

    @classmethod
    def of(cls, record: Any) -> EngineSpan | None:
        """The span's figures; None for a record that lacks one or holds nonsense (never trusted as given)."""
        if not isinstance(record, dict) or not isinstance(record.get("attributes"), dict):
            return None
        attrs = record["attributes"]
        names = [n for k in ("deployment", "instance", "role") if isinstance(n := record.get(k), str) and n]
        request_id = attrs.get(REQUEST_ID)
        if len(names) < 3 or not isinstance(request_id, str) \
                or not 0 < len(request_id) <= MAX_ID_CHARS:
            return None
        start = record.get("start_unix_nano")
        times = [attrs.get(k) for k in (TIME_TO_FIRST_TOKEN, TIME_IN_QUEUE, TIME_IN_PREFILL)]
        if not isinstance(start, int) or isinstance(start, bool) or start <= 0:
            return None
        if not all(
            isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t) and t >= 0 for t in times
        ):
            return None
        return cls(
            names[0], names[1], names[2], request_id, start / 1e9, float(times[0]), float(times[1]), float(times[2])
        )
