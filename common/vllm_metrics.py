"""Read the few numbers kvpush needs from a Prometheus text page (vLLM's and the router's /metrics)."""
from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = "vllm:kv_cache_usage_perc"
PROMPT_TOKENS_BY_SOURCE = "vllm:prompt_tokens_by_source_total"  # a counter: exposed with _total
EXTERNAL_KV_SOURCE = "external_kv_transfer"

Sample = tuple[str, dict[str, str], float]


def _parsed(text: str) -> list[Sample]:
    return [(sample.name, dict(sample.labels), float(sample.value))
            for family in text_string_to_metric_families(text) for sample in family.samples]


def samples(text: str, prefixes: tuple[str, ...] = ()) -> list[Sample]:
    """Every sample of the page, or of the series whose names start with one of `prefixes`: (series
    name as exposed, e.g. with _total or _bucket; labels; value), read by prometheus_client's parser
    of the Prometheus text format (label escapes undone, NaN and +Inf as floats).

    With `prefixes`, only those lines reach the parser: a vLLM page has hundreds of series, and the
    router reads each instance's every second on its event loop. A page with a line the parser
    refuses is read line by line, that line left out: one odd series must not hide the rest."""
    if prefixes:
        text = "".join(f"{line}\n" for line in text.splitlines() if line.startswith(prefixes))
    try:
        return _parsed(text)
    except ValueError:
        found: list[Sample] = []
        for line in text.splitlines():
            if line.strip() and not line.startswith("#"):
                try:
                    found += _parsed(line + "\n")
                except ValueError:
                    continue
        return found


def metric_sum(text: str, name: str, **labels: str) -> float | None:
    """Sum of all samples of `name` whose labels include `labels`; None when there is none."""
    found = [value for metric, sample_labels, value in samples(text, (name,))
             if metric == name and all(sample_labels.get(k) == v for k, v in labels.items())]
    return sum(found) if found else None


@dataclass(frozen=True)
class VllmLoad:
    running: float | None
    waiting: float | None
    kv_usage: float | None  # 0..1


def vllm_load(text: str) -> VllmLoad:
    return VllmLoad(metric_sum(text, RUNNING), metric_sum(text, WAITING), metric_sum(text, KV_USAGE))


def external_kv_tokens(text: str) -> float:
    return metric_sum(text, PROMPT_TOKENS_BY_SOURCE, source=EXTERNAL_KV_SOURCE) or 0.0


CACHE_CONFIG_INFO = "vllm:cache_config_info"  # a gauge at 1 whose labels are vLLM's CacheConfig fields


def prefix_caching(text: str) -> bool | None:
    """Whether the instance caches prompt prefixes (its enable_prefix_caching); None when its page
    does not say."""
    if metric_sum(text, CACHE_CONFIG_INFO, enable_prefix_caching="True"):
        return True
    if metric_sum(text, CACHE_CONFIG_INFO, enable_prefix_caching="False") is not None:
        return False
    return None


PROCESS_START_TIME = "process_start_time_seconds"  # prometheus_client's process collector (vLLM's API server)


def process_start_time(text: str) -> float | None:
    """When the serving process started (seconds since the epoch); None when its page does not say."""
    return metric_sum(text, PROCESS_START_TIME)
