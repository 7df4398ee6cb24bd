"""The router's own Prometheus metrics, in a private registry served at /metrics.

Under a worker supervisor (workers.py) prometheus_client keeps every value in files of one shared
directory instead, and /metrics on any worker reads them all: counters and histograms add up over
the workers, gauges say per metric how they combine.
"""
from __future__ import annotations

import os

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

# prometheus_client keeps values in files under PROMETHEUS_MULTIPROC_DIR when that is set at import;
# /metrics reads the workers' files only when the supervisor says so with its own variable (a topology
# may set the former for vLLM, whose files must not show up as the router's).
PROMETHEUS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"
WORKERS_DIR_ENV = "KVPUSH_ROUTER_METRICS_DIR"

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)

# the handoff gap's targets are tens of ms (benchmarks/notes/cpu-ttft-against-pull.md, "Against the targets":
# <= 20 ms p50, <= 50 ms p90; the buckets chosen: benchmarks/notes/bench-cost.md): 2.5 ms steps up to 25 ms,
# then 5 ms to 50 ms
_HANDOFF_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.0125, 0.015, 0.0175, 0.02, 0.0225, 0.025,
                    0.03, 0.035, 0.04, 0.045, 0.05, 0.06, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                    20.0, 40.0)

_OWN_BUCKETS = (0.0001, 0.00025, 0.0005, 0.00075, 0.001, 0.0015, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.025,
                0.05, 0.1)

# prompt units (tokens of a token-id prompt, else characters): 32 to 1M by powers of 2, and 0
_PREFIX_BUCKETS = (0.0,) + tuple(float(2 ** k) for k in range(5, 21))

# read by `kvpush up` while it changes the instance list (instances.py)
INSTANCE_LIST_METRIC = "kvpush_router_instance_list"
DRAINING_METRIC = "kvpush_router_draining"

# outcome label values of kvpush_router_requests_total
OK = "success"
CLIENT_ERROR = "client_error"  # 4xx: the request was wrong (router or upstream said so)
FAILED = "failed"  # no instance could serve it, or its retry_deadline_s passed, before the first token
FAILED_MID_STREAM = "failed_mid_stream"  # a leg died after tokens reached the client
CANCELLED = "cancelled"  # the client went away
UNAVAILABLE = "unavailable"  # no instance in rotation


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("kvpush_router_requests", "Requests by endpoint and outcome.",
                                ["endpoint", "outcome"], registry=r)
        self.ttft = Histogram("kvpush_router_ttft_seconds", "Router receipt to first token sent (streaming).",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.own_latency = Histogram(
            "kvpush_router_own_latency_seconds",
            "The router's own part of TTFT (streaming): receipt to the decode leg's start, plus decode's first "
            "token received to written to the client.", buckets=_OWN_BUCKETS, registry=r)
        self.latency = Histogram("kvpush_router_e2e_latency_seconds", "Router receipt to response end.",
                                 buckets=_LATENCY_BUCKETS, registry=r)
        self.leg_latency = Histogram("kvpush_router_leg_seconds", "One leg: sent to answered (decode: to last byte).",
                                     ["leg"], buckets=_LATENCY_BUCKETS, registry=r)
        self.handoff_gap = Histogram("kvpush_router_handoff_gap_seconds",
                                     "Prefill leg's answer to decode leg's first token (0 if decode was first).",
                                     buckets=_HANDOFF_BUCKETS, registry=r)
        self.retries = Counter("kvpush_router_retries", "Attempts repeated before the first token, by reason.",
                               ["reason"], registry=r)
        self.fallbacks = Counter(
            "kvpush_router_fallbacks",
            "Prompts a decode instance computed itself because no pair could take their push, by reason: "
            "no_prefill_in_rotation, transfers_failed (every pair in rotation that could take it failed it).",
            ["reason"], registry=r)
        self.decode_computed_prompts = Counter(
            "kvpush_router_decode_computed_prompts",
            "Prompts decode computed itself by design, by reason: prompt_logprobs (a transferred prompt has no "
            "logits), samples_without_prefix_caching (n > 1 on a decode instance without prefix caching computes "
            "the prompt once per sample).", ["reason"], registry=r)
        self.leg_failures = Counter("kvpush_router_leg_failures", "Failed legs by instance, role and reason.",
                                    ["instance", "role", "reason"], registry=r)
        self.inflight = Gauge("kvpush_router_inflight", "Legs in flight per instance.", ["instance", "role"],
                              registry=r, multiprocess_mode="livesum")
        self.in_rotation = Gauge("kvpush_router_instance_in_rotation",
                                 "1 if the instance receives new legs (from every router worker).",
                                 ["instance", "role"], registry=r, multiprocess_mode="livemin")
        self.draining = Gauge(DRAINING_METRIC,
                              "Legs and transfers still on an instance removed from the instance list (0: drained).",
                              ["instance", "role"], registry=r, multiprocess_mode="livesum")
        self.instance_list = Gauge(
            INSTANCE_LIST_METRIC,
            "1 for the instance list (its digest) each router process serves, 0 for lists served before.",
            ["digest"],
            registry=r,
            multiprocess_mode="liveall",
        )
        self.restarts = Gauge("kvpush_router_instance_restarts",
                              "Restarts of an instance the router saw (its server's start time changed).",
                              ["instance", "role"], registry=r, multiprocess_mode="livemax")
        self.prefix_hit = Histogram(
            "kvpush_router_prefix_hit_length",
            "Prefix-aware policy: how much of each prompt the chosen instance already held by the router's "
            "record, per attempt, by role; unit: tokens (a prompt of token ids) or chars (text, chat messages).",
            ["role", "unit"], buckets=_PREFIX_BUCKETS, registry=r)
        self.prompt_length = Counter(
            "kvpush_router_prompt_length", "Prefix-aware policy: prompt length sent to decode instances, per "
            "attempt; unit: tokens or chars.", ["unit"], registry=r)
        self.prompt_to_move = Counter(
            "kvpush_router_prompt_to_move",
            "Prefix-aware policy: the part of each prompt its decode did not hold by the router's record, "
            "expected to move by transfer (or be computed by decode); unit: tokens or chars.", ["unit"], registry=r)
        self.prefix_record = Gauge("kvpush_router_prefix_record_blocks",
                                   "Entries (instance, prompt block) in the prefix-aware policy's record, by role.",
                                   ["role"], registry=r, multiprocess_mode="livesum")
        self.refused_connections = Counter(
            "kvpush_router_refused_connections",
            "Client connections refused or cut to bound what clients hold, by reason: connection_cap (503: every "
            "connection had a request in progress), evicted (an idle one closed to make room for a new one), silent "
            "(sent nothing within header_timeout_s), header_timeout (a head not complete within it), body_timeout "
            "(408), body_too_large (413 on a declared Content-Length, before reading), malformed_head (400: a head "
            "that "
            "is not valid HTTP, a line over 8190 bytes or over 128 header fields).",
            ["reason"],
            registry=r,
        )
        self.client_connections = Gauge("kvpush_router_client_connections", "Client connections open.",
                                        registry=r, multiprocess_mode="livesum")
        self.workers = Gauge("kvpush_router_worker_up", "1 per router process serving (one sample per worker's pid).",
                             registry=r, multiprocess_mode="liveall")
        self.workers.set(1)
        self._request_counts: dict[tuple[str, str], Counter] = {}
        self._refusals: dict[str, Counter] = {}

    def request_done(self, endpoint: str, outcome: str) -> None:
        """Count one request; each label pair's child is looked up once (labels() takes a lock and
        builds a tuple on every call)."""
        child = self._request_counts.get((endpoint, outcome))
        if child is None:
            child = self._request_counts[(endpoint, outcome)] = self.requests.labels(endpoint, outcome)
        child.inc()

    def refused_connection(self, reason: str) -> None:
        child = self._refusals.get(reason)
        if child is None:
            child = self._refusals[reason] = self.refused_connections.labels(reason)
        child.inc()

    def exposition(self) -> tuple[bytes, str]:
        shared_dir = os.environ.get(WORKERS_DIR_ENV)
        if not shared_dir:
            return generate_latest(self.registry), CONTENT_TYPE_LATEST
        every_worker = CollectorRegistry()
        MultiProcessCollector(every_worker, path=shared_dir)
        return generate_latest(every_worker), CONTENT_TYPE_LATEST
