"""Read the few numbers kvpush needs from a Prometheus text page (vLLM's and the router's /metrics)."""
from __future__ import annotations

import re
from dataclasses import dataclass

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = "vllm:kv_cache_usage_perc"
PROMPT_TOKENS_BY_SOURCE = "vllm:prompt_tokens_by_source_total"  # a counter: exposed with _total
EXTERNAL_KV_SOURCE = "external_kv_transfer"

_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)')
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    """Every sample of the page: (metric, labels, value); comments and unreadable lines left out."""
    out = []
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if m:
            try:
                out.append((m.group(1), dict(_LABEL.findall(m.group(2) or "")), float(m.group(3))))
            except ValueError:
                continue
    return out


def metric_sum(text: str, name: str, **labels: str) -> float | None:
    """Sum of all samples of `name` whose labels include `labels`; None when there is none."""
    found = [value for metric, sample_labels, value in samples(text)
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
