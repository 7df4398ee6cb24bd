"""Prometheus series for the push connector, fed by the PushStats dicts vLLM ships from the
worker to the API server's stats logger (vLLM calls `observe` once per logging interval).

Kept free of vLLM imports: vLLM hands over the metric classes (its multiprocess-aware
wrappers) and the label values per engine."""
from __future__ import annotations

from typing import Any

_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_BYTES_BUCKETS = tuple(float(2 ** p) for p in range(12, 36, 2))  # 4 KiB .. 16 GiB

# stats key -> (metric name, help); each failure counts once on the instance that saw it
_COUNTERS = {
    "sends_ok": ("vllm:kvpush_pushes_sent", "Pushes this prefill instance completed (WRITE done)."),
    "recvs_ok": ("vllm:kvpush_pushes_received", "Pushes this decode instance received complete."),
    "sends_failed": ("vllm:kvpush_failed_transfers", "Pushes that failed on this instance."),
    "recvs_failed": ("vllm:kvpush_failed_transfers", "Pushes that failed on this instance."),
    "marks_on_compute_thread": ("vllm:kvpush_step_marks_on_compute_thread",
                                "GPU prefill steps with pushes whose forward-pass mark vLLM's compute thread "
                                "recorded itself before the next forward pass (the recorder thread had not run)."),
    "late_write_backstops": ("vllm:kvpush_late_write_backstops",
                             "Transfer parts whose blocks decode let go after late_write_hold_s without prefill's word "
                             "that its WRITEs ended or proof that it is gone (it dropped that prefill's connection)."),
    "kv_digest_mismatches": ("vllm:kvpush_kv_digest_mismatches",
                             "Transfer parts whose KV in decode's blocks differed from the digest prefill sent "
                             "(verify_kv): each failed its load."),
    "kv_digests_verified": ("vllm:kvpush_kv_digests_verified",
                            "Pushes whose KV in decode's blocks matched the digests prefill sent, every byte "
                            "(verify_kv): the check ran and passed."),
}
_DROPPED = ("vllm:kvpush_dropped_messages",
            "Side-channel messages and requests this instance dropped or refused, by reason "
            "(malformed, unknown or duplicate transfer, expired, engine not allowed, ...).")
_REFUSED_PARAMS = ("vllm:kvpush_refused_transfer_params",
                   "Requests whose kvpush kv_transfer_params this instance refused, by reason (unsigned, "
                   "bad_signature, expired, wrong_engine, wrong_prompt, malformed): nothing of them was transferred.")
# Histogram sums are the byte totals (one name per side, so a transfer is never counted twice
# within one instance).
_HISTOGRAMS = {
    "send_bytes": ("vllm:kvpush_sent_bytes", "KV bytes per push written to a decode instance.", _BYTES_BUCKETS),
    "recv_bytes": ("vllm:kvpush_received_bytes", "KV bytes per push received from a prefill instance.",
                   _BYTES_BUCKETS),
    "prefill_end_to_done_s": ("vllm:kvpush_prefill_end_to_write_done_seconds",
                              "Prefill step end to WRITE completion, per push.", _LATENCY_BUCKETS),
    "write_s": ("vllm:kvpush_write_seconds",
                "A push's WRITE from its post to its completion (sent bytes over its sum: the transfer's bytes/s).",
                _LATENCY_BUCKETS),
    "registration_wait_s": ("vllm:kvpush_registration_wait_seconds",
                            "Gap between decode's block registration and prefill's finished blocks "
                            "(whichever came first), per push.", _LATENCY_BUCKETS),
    "layer_wait_s": ("vllm:kvpush_layer_wait_seconds",
                     "Time a decode forward pass waited for streamed KV layers to land, per pass that waited.",
                     _LATENCY_BUCKETS),
}


class PushPromMetrics:
    """Counters and histograms per engine; `observe` takes one interval's PushStats.data."""

    def __init__(self, counter_cls: Any, histogram_cls: Any, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        def per_engine(metric: Any) -> dict[int, Any]:
            return {idx: metric.labels(*values) for idx, values in per_engine_labelvalues.items()}

        by_name = {name: per_engine(counter_cls(name=name, documentation=doc, labelnames=labelnames))
                   for name, doc in dict(_COUNTERS.values()).items()}
        self._counters = {key: by_name[name] for key, (name, _) in _COUNTERS.items()}
        dropped = counter_cls(name=_DROPPED[0], documentation=_DROPPED[1], labelnames=[*labelnames, "reason"])
        self._dropped = {idx: (dropped, list(values)) for idx, values in per_engine_labelvalues.items()}
        refused = counter_cls(
            name=_REFUSED_PARAMS[0], documentation=_REFUSED_PARAMS[1], labelnames=[*labelnames, "reason"]
        )
        self._refused = {idx: (refused, list(values)) for idx, values in per_engine_labelvalues.items()}
        self._histograms = {key: per_engine(histogram_cls(name=name, documentation=doc, buckets=list(buckets),
                                                          labelnames=labelnames))
                            for key, (name, doc, buckets) in _HISTOGRAMS.items()}

    def observe(self, data: dict[str, Any], engine_idx: int = 0) -> None:
        for key in _COUNTERS:
            if data.get(key):
                self._counters[key][engine_idx].inc(int(data[key]))
        metric, values = self._dropped[engine_idx]
        for reason, n in data.get("dropped", {}).items():
            metric.labels(*values, reason).inc(int(n))
        metric, values = self._refused[engine_idx]
        for reason, n in data.get("refused_params", {}).items():
            metric.labels(*values, reason).inc(int(n))
        for key, histogram in self._histograms.items():
            for value in data.get(key, ()):
                histogram[engine_idx].observe(value)
