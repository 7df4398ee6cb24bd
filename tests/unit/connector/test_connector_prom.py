from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from kvpush.connector.prom import PushPromMetrics
from kvpush.connector.stats import PushStats
from kvpush.bench.scrape import instance_figures


def _metrics(registry: CollectorRegistry) -> PushPromMetrics:
    def counter(**kw):
        return Counter(registry=registry, **kw)

    def histogram(**kw):
        return Histogram(registry=registry, **kw)

    return PushPromMetrics(counter, histogram, ["model_name", "engine"], {0: ["tiny", "0"]})


def _interval(sent: list[int], received: list[int], failed: int) -> dict:
    stats = PushStats()
    stats.data.update(send_bytes=sent, recv_bytes=received, sends_ok=len(sent), recvs_ok=len(received),
                      sends_failed=failed, prefill_end_to_done_s=[0.002] * len(sent),
                      registration_wait_s=[0.01] * len(sent))
    return stats.to_dict()


def test_observe_exports_bytes_counts_and_latencies():
    registry = CollectorRegistry()
    metrics = _metrics(registry)
    metrics.observe(_interval([1024, 3072], [], failed=1))
    metrics.observe(_interval([4096], [], failed=0))
    page = generate_latest(registry).decode()
    assert 'vllm:kvpush_sent_bytes_sum{engine="0",model_name="tiny"} 8192.0' in page
    assert 'vllm:kvpush_pushes_sent_total{engine="0",model_name="tiny"} 3.0' in page
    assert 'vllm:kvpush_failed_transfers_total{engine="0",model_name="tiny"} 1.0' in page
    assert 'vllm:kvpush_prefill_end_to_write_done_seconds_count{engine="0",model_name="tiny"} 3.0' in page


def test_bench_scrape_reads_kvpush_bytes_once():
    registry = CollectorRegistry()
    metrics = _metrics(registry)
    before = generate_latest(registry).decode()
    metrics.observe(_interval([], [2048, 2048], failed=2))
    figures = instance_figures("d", "decode", before, generate_latest(registry).decode())
    assert sum(figures.kv_bytes.values()) == 4096
    assert figures.failed_transfers == 2


def test_dropped_messages_are_exported_by_reason_summed_over_intervals():
    registry = CollectorRegistry()
    metrics = _metrics(registry)
    first, second = PushStats(), PushStats()
    first.record_dropped({"malformed": 2, "refused_handshake": 1})
    second.record_dropped({"malformed": 1})
    metrics.observe(PushStats().aggregate(first).aggregate(second).to_dict())
    page = generate_latest(registry).decode()
    assert 'vllm:kvpush_dropped_messages_total{engine="0",model_name="tiny",reason="malformed"} 3.0' in page
    assert 'vllm:kvpush_dropped_messages_total{engine="0",model_name="tiny",reason="refused_handshake"} 1.0' in page
    assert PushStats().aggregate(first).reduce()["dropped"] == 3


def test_marks_the_compute_thread_recorded_itself_are_counted():
    registry = CollectorRegistry()
    metrics = _metrics(registry)
    stats = PushStats()
    stats.record_marks_on_compute_thread(2)
    stats.record_marks_on_compute_thread(1)
    assert not stats.is_empty() and stats.reduce()["marks_on_compute_thread"] == 3
    metrics.observe(stats.to_dict())
    page = generate_latest(registry).decode()
    assert 'vllm:kvpush_step_marks_on_compute_thread_total{engine="0",model_name="tiny"} 3.0' in page
