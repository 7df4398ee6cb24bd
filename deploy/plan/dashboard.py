"""A Grafana dashboard (JSON model) for the router's kvpush_router_* and the connector's
vllm:kvpush_* metrics, scraped with the config of monitor_config.py.

Every query names its metrics through `_series`, which filters on the scrape config's
`deployment` label, so `metric_names()` lists exactly what the dashboard reads (a test checks each
against real /metrics output). Panels are laid out two per row, in the order given.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

DEPLOYMENT_LABEL = "deployment"  # labels the scrape config gives every target
PROCESS_LABEL = "process"  # its process name in the plan (prefill-0, router, ...)
RATE = "[$__rate_interval]"
METRIC_NAME = re.compile(r"\b(kvpush_router_[a-z_]+|vllm:kvpush_[a-z_]+)\b")


def _series(name: str, labels: str = "") -> str:
    return f'{name}{{{DEPLOYMENT_LABEL}=~"$deployment"{"," + labels if labels else ""}}}'


def _rate(name: str, by: str = "") -> str:
    summed = f"sum by ({by}) " if by else "sum "
    return f"{summed}(rate({_series(name)}{RATE}))"


def _quantile(q: float, histogram: str, by: str = "") -> str:
    keep = f"le, {by}" if by else "le"
    return f"histogram_quantile({q:g}, sum by ({keep}) (rate({_series(histogram + '_bucket')}{RATE})))"


@dataclass(frozen=True)
class Panel:
    title: str
    unit: str  # Grafana's unit id: reqps, s, bytes, Bps, short, percentunit
    targets: tuple[tuple[str, str], ...]  # (legend, PromQL)
    description: str = ""


def _latency(title: str, histogram: str, description: str, by: str = "") -> Panel:
    legend = f"{{{{{by}}}}} " if by else ""
    return Panel(title, "s", tuple((f"{legend}p{int(q * 100)}", _quantile(q, histogram, by)) for q in (0.5, 0.9, 0.99)),
                 description)


ROUTER_PANELS = (
    Panel(
        "Requests by outcome",
        "reqps",
        (("{{outcome}}", _rate("kvpush_router_requests_total", "outcome")),),
        "Requests the router finished per second: success, client_error, failed, failed_mid_stream, cancelled, "
        "unavailable.",
    ),
    _latency(
        "TTFT at the router", "kvpush_router_ttft_seconds", "Router receipt to first token sent (streaming requests)."
    ),
    _latency(
        "The router's own part of TTFT",
        "kvpush_router_own_latency_seconds",
        "Receipt to the decode leg's start, plus decode's first token received to written to the client.",
    ),
    _latency(
        "Prefill answer to decode's first token",
        "kvpush_router_handoff_gap_seconds",
        "The handoff: prefill leg's answer to the decode leg's first token (0 when decode was first).",
    ),
    _latency(
        "Leg latency by leg",
        "kvpush_router_leg_seconds",
        "One leg, sent to answered (decode: to its last byte).",
        "leg",
    ),
    _latency("End-to-end latency", "kvpush_router_e2e_latency_seconds", "Router receipt to response end."),
    Panel(
        "Legs in flight per instance",
        "short",
        (("{{instance}}", f"sum by (instance) ({_series('kvpush_router_inflight')})"),),
    ),
    Panel(
        "Instances in rotation",
        "short",
        (
            ("{{role}}", f"sum by (role) ({_series('kvpush_router_instance_in_rotation')})"),
            ("draining {{role}}", f"sum by (role) ({_series('kvpush_router_draining')})"),
        ),
        "Instances receiving new legs, and legs still on instances removed from the list.",
    ),
    Panel(
        "Retries, fallbacks and failed legs",
        "reqps",
        (
            ("retry {{reason}}", _rate("kvpush_router_retries_total", "reason")),
            ("fallback {{reason}}", _rate("kvpush_router_fallbacks_total", "reason")),
            ("decode computed {{reason}}", _rate("kvpush_router_decode_computed_prompts_total", "reason")),
            ("leg failed {{role}} {{reason}}", _rate("kvpush_router_leg_failures_total", "role, reason")),
        ),
    ),
    Panel(
        "Instance restarts seen",
        "short",
        (("{{instance}}", f"max by (instance) ({_series('kvpush_router_instance_restarts')})"),),
    ),
    Panel(
        "Prompt share to move (prefix-aware)",
        "percentunit",
        (
            (
                "{{unit}}",
                f"{_rate('kvpush_router_prompt_to_move_total', 'unit')} / "
                f"{_rate('kvpush_router_prompt_length_total', 'unit')}",
            ),
        ),
        "The part of prompts their decode instance did not hold by the router's record.",
    ),
    _latency(
        "Prefix held by the chosen instance",
        "kvpush_router_prefix_hit_length",
        "Prefix-aware policy: tokens (or chars) of each prompt the chosen instance already held.",
        "role",
    ),
    Panel(
        "Client connections",
        "short",
        (
            ("open", f"sum ({_series('kvpush_router_client_connections')})"),
            ("refused {{reason}}", _rate("kvpush_router_refused_connections_total", "reason")),
            ("router processes", f"count ({_series('kvpush_router_worker_up')})"),
            ("prefix record blocks {{role}}", f"sum by (role) ({_series('kvpush_router_prefix_record_blocks')})"),
        ),
    ),
)

CONNECTOR_PANELS = (
    Panel(
        "Pushes per second",
        "reqps",
        (
            ("sent {{process}}", _rate("vllm:kvpush_pushes_sent_total", "process")),
            ("received {{process}}", _rate("vllm:kvpush_pushes_received_total", "process")),
            ("failed {{process}}", _rate("vllm:kvpush_failed_transfers_total", "process")),
        ),
    ),
    Panel(
        "KV bytes per second",
        "Bps",
        (
            ("sent {{process}}", _rate("vllm:kvpush_sent_bytes_sum", "process")),
            ("received {{process}}", _rate("vllm:kvpush_received_bytes_sum", "process")),
        ),
    ),
    Panel(
        "WRITE throughput (sent bytes / WRITE time)",
        "Bps",
        (
            (
                "{{process}}",
                f"{_rate('vllm:kvpush_sent_bytes_sum', 'process')} / "
                f"{_rate('vllm:kvpush_write_seconds_sum', 'process')}",
            ),
        ),
    ),
    _latency(
        "Prefill step end to WRITE done", "vllm:kvpush_prefill_end_to_write_done_seconds", "Per push, on prefill."
    ),
    _latency("WRITE time", "vllm:kvpush_write_seconds", "A push's WRITE from its post to its completion."),
    _latency(
        "Registration to prefill's blocks",
        "vllm:kvpush_registration_wait_seconds",
        "Gap between decode's block registration and prefill's finished blocks, per push.",
    ),
    _latency(
        "Decode waited for streamed layers",
        "vllm:kvpush_layer_wait_seconds",
        "Time a decode forward pass waited for streamed KV layers to land, per pass that waited.",
    ),
    Panel(
        "Dropped messages, refused requests and transfer params, backstops",
        "short",
        (
            ("dropped {{reason}}", _rate("vllm:kvpush_dropped_messages_total", "reason")),
            ("refused {{reason}}", _rate("vllm:kvpush_refused_requests_total", "reason")),
            ("refused transfer params {{reason}}", _rate("vllm:kvpush_refused_transfer_params_total", "reason")),
            ("late-write backstops", _rate("vllm:kvpush_late_write_backstops_total")),
            ("marks on compute thread", _rate("vllm:kvpush_step_marks_on_compute_thread_total")),
        ),
    ),
)


def metric_names() -> set[str]:
    """Every metric name (as exposed: with _total, _bucket, _sum) the dashboard's queries read."""
    return {name for panel in ROUTER_PANELS + CONNECTOR_PANELS for _, expr in panel.targets
            for name in METRIC_NAME.findall(expr)}


def _panel_json(panel: Panel, panel_id: int, x: int, y: int) -> dict:
    return {
        "id": panel_id, "type": "timeseries", "title": panel.title, "description": panel.description,
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "gridPos": {"h": 8, "w": 12, "x": x, "y": y},
        "fieldConfig": {"defaults": {"unit": panel.unit}, "overrides": []},
        "targets": [{"refId": chr(ord("A") + i), "expr": expr, "legendFormat": legend,
                     "datasource": {"type": "prometheus", "uid": "${datasource}"}}
                    for i, (legend, expr) in enumerate(panel.targets)],
    }


def dashboard(deployment: str) -> dict:
    """The dashboard's JSON model (Grafana's Import dashboard takes it as is)."""
    panels, y, panel_id = [], 0, 1
    for title, group in (("Router (kvpush_router_*)", ROUTER_PANELS), ("Connector (vllm:kvpush_*)", CONNECTOR_PANELS)):
        panels.append({"id": panel_id, "type": "row", "title": title, "collapsed": False,
                       "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []})
        panel_id, y = panel_id + 1, y + 1
        for i, panel in enumerate(group):
            panels.append(_panel_json(panel, panel_id, 12 * (i % 2), y + 8 * (i // 2)))
            panel_id += 1
        y += 8 * ((len(group) + 1) // 2)
    return {
        "title": f"kvpush {deployment}", "uid": f"kvpush-{deployment}"[:40], "schemaVersion": 39, "version": 1,
        "tags": ["kvpush", "vllm"], "time": {"from": "now-1h", "to": "now"}, "refresh": "30s",
        "templating": {"list": [
            {"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Prometheus"},
            {"name": "deployment", "type": "query", "label": "deployment",
             "datasource": {"type": "prometheus", "uid": "${datasource}"},
             "query": {"query": f"label_values(kvpush_router_worker_up, {DEPLOYMENT_LABEL})", "refId": "deployments"},
             "definition": f"label_values(kvpush_router_worker_up, {DEPLOYMENT_LABEL})",
             "current": {"text": deployment, "value": deployment}, "refresh": 2},
        ]},
        "panels": panels,
    }
