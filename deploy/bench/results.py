"""Parse `vllm bench serve` result files and aggregate a whole bench (pure: no processes, no I/O
beyond reading the JSON text handed in)."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from ..errors import KvpushError
from .scrape import InstanceFigures, RouterFigures

LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")
STAT_NAMES = ("mean", "p50", "p90", "p99")


@dataclass(frozen=True)
class Stats:
    """Milliseconds."""

    mean: float | None
    p50: float | None
    p90: float | None
    p99: float | None


@dataclass(frozen=True)
class ClientResult:
    """What vLLM's benchmark client measured at one request rate."""

    rate: float
    completed: int
    failed: int
    duration_s: float
    request_throughput: float  # req/s
    output_throughput: float  # tok/s
    total_token_throughput: float  # tok/s
    total_input_tokens: int
    total_output_tokens: int
    max_concurrent_requests: float | None
    latency: dict[str, Stats]  # ttft, tpot, itl, e2el


def _stat(data: dict, metric: str, stat: str) -> float | None:
    keys = [f"{stat}_{metric}_ms"] + ([f"median_{metric}_ms"] if stat == "p50" else [])
    for key in keys:
        if data.get(key) is not None:
            return float(data[key])
    return None


def parse_client_result(text: str, source: str = "<result>") -> ClientResult:
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise KvpushError(f"{source}: not a `vllm bench serve` result file ({exc})") from None
    if not isinstance(data, dict) or "completed" not in data:
        raise KvpushError(f"{source}: not a `vllm bench serve` result file (no 'completed' field)")
    rate = data.get("request_rate")
    latency = {m: Stats(*(_stat(data, m, s) for s in STAT_NAMES)) for m in LATENCY_METRICS}
    return ClientResult(
        rate=float("inf") if rate in (None, "inf") else float(rate),
        completed=int(data["completed"]),
        failed=int(data.get("failed") or 0),
        duration_s=float(data.get("duration") or 0.0),
        request_throughput=float(data.get("request_throughput") or 0.0),
        output_throughput=float(data.get("output_throughput") or 0.0),
        total_token_throughput=float(data.get("total_token_throughput") or 0.0),
        total_input_tokens=int(data.get("total_input_tokens") or 0),
        total_output_tokens=int(data.get("total_output_tokens") or 0),
        max_concurrent_requests=data.get("max_concurrent_requests"),
        latency=latency,
    )


@dataclass(frozen=True)
class RatePoint:
    """Everything measured for one mode at one rate."""

    mode: str
    rate: float
    seed: int
    client: ClientResult
    router: RouterFigures
    instances: list[InstanceFigures]

    @property
    def prompt_tokens_external(self) -> float:
        return sum(i.prompt_tokens_external for i in self.instances if i.role == "decode")

    @property
    def decode_prompt_tokens_local(self) -> float:
        return sum(i.prompt_tokens_local for i in self.instances if i.role == "decode")

    @property
    def kv_bytes(self) -> float:
        """Bytes one side reported moving (each transfer is counted once: the larger side's sum)."""
        per_role = {"prefill": 0.0, "decode": 0.0}
        for inst in self.instances:
            per_role[inst.role] = per_role.get(inst.role, 0.0) + sum(inst.kv_bytes.values())
        return max(per_role.values(), default=0.0)

    @property
    def failed_transfers(self) -> float:
        return sum(i.failed_transfers for i in self.instances)


@dataclass
class ModeRun:
    mode: str
    topology_hash: str
    points: list[RatePoint] = field(default_factory=list)
    error: str | None = None  # why this mode stopped early, if it did
    up_s: float | None = None
    idle_cores: dict[str, float] = field(default_factory=dict)  # per instance, with no request in flight
    phases_s: dict[str, float] = field(default_factory=dict)  # where the bench's wall time went: up, prove, rate 1, down...


def figure(point: RatePoint, name: str) -> float | None:
    """A named figure of one point: '<metric>_<stat>' (ttft_p50, tpot_mean, ...), 'handoff_p50', 'handoff_p90',
    'throughput' (req/s), 'output_throughput', 'failed'."""
    if name == "handoff_p50":
        return point.router.handoff_gap_p50_ms
    if name == "handoff_p90":
        return point.router.handoff_gap_p90_ms
    if name == "throughput":
        return point.client.request_throughput
    if name == "output_throughput":
        return point.client.output_throughput
    if name == "failed":
        return float(point.client.failed)
    metric, _, stat = name.partition("_")
    return getattr(point.client.latency[metric], stat)


RATIO_FIGURES = ("ttft_p50", "ttft_p90", "tpot_p50", "itl_p50", "e2el_p50", "handoff_p50")


def ratio(value: float | None, baseline: float | None) -> float | None:
    if value is None or baseline is None or baseline <= 0:
        return None
    return value / baseline


def ratios_vs_baseline(runs: list[ModeRun], baseline: str) -> dict[str, dict[float, dict[str, float | None]]]:
    """mode -> rate -> figure -> value / baseline's value at the same rate (None where either is missing)."""
    base = next((r for r in runs if r.mode == baseline), None)
    base_points = {p.rate: p for p in base.points} if base else {}
    out: dict[str, dict[float, dict[str, float | None]]] = {}
    for run in runs:
        out[run.mode] = {}
        for p in run.points:
            b = base_points.get(p.rate)
            out[run.mode][p.rate] = {f: ratio(figure(p, f), figure(b, f) if b else None) for f in RATIO_FIGURES}
    return out


def rates_of(runs: list[ModeRun]) -> list[float]:
    return sorted({p.rate for r in runs for p in r.points})


def point_at(run: ModeRun, rate: float) -> RatePoint | None:
    return next((p for p in run.points if p.rate == rate), None)


def point_to_dict(point: RatePoint) -> dict:
    d = asdict(point)
    d["prompt_tokens_external"] = point.prompt_tokens_external
    d["decode_prompt_tokens_local"] = point.decode_prompt_tokens_local
    d["kv_bytes"] = point.kv_bytes
    d["failed_transfers"] = point.failed_transfers
    return d
