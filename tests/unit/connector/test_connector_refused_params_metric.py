"""The scheduler's refusals of kv_transfer_params reach /metrics as
vllm:kvpush_refused_transfer_params_total{reason}, through the stats vLLM carries and aggregates."""
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from kvpush.connector.prom import PushPromMetrics
from kvpush.connector.stats import PushStats


def test_refusals_are_exported_by_reason_after_aggregation():
    registry = CollectorRegistry()
    metrics = PushPromMetrics(lambda **kw: Counter(registry=registry, **kw), lambda **kw: Histogram(registry=registry, **kw),
                              ["model_name", "engine"], {0: ["tiny", "0"]})
    scheduler_side = PushStats()
    scheduler_side.record_refused_params({"unsigned": 2, "expired": 1})
    worker_side = PushStats()
    worker_side.data["recvs_ok"] = 1
    merged = worker_side.aggregate(scheduler_side)  # what vLLM does with the scheduler's and the workers' stats
    assert not merged.is_empty() and merged.reduce()["refused_params"] == 3
    assert not scheduler_side.is_empty() and PushStats().is_empty()
    metrics.observe(merged.to_dict())
    page = generate_latest(registry).decode()
    assert 'vllm:kvpush_refused_transfer_params_total{engine="0",model_name="tiny",reason="unsigned"} 2.0' in page
    assert 'vllm:kvpush_refused_transfer_params_total{engine="0",model_name="tiny",reason="expired"} 1.0' in page
