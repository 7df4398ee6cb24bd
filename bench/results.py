"""Parse `vllm bench serve` result files and aggregate a whole bench (pure: no processes, no I/O
beyond reading the JSON text handed in)."""
from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, field, replace

from kvpush.common.errors import KvpushError

from .handoff import HandoffSamples, HandoffSummary
from .handoff import pooled as pooled_handoff
from .handoff import summarize as summarize_handoff
from .scrape import InstanceFigures, RouterFigures, ms_per_request
from .tails import Slo, Tails, percentile, summarize

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
class RequestSamples:
    """Per-request latencies (ms) of the requests that succeeded, from a `--save-detailed` result file."""

    ttft: list[float]
    e2el: list[float]  # same order as ttft
    request_tpot: list[float | None]  # same order; None: a one-token answer has no TPOT
    itl: list[float]  # every gap between tokens, all requests
    sent: int = 0  # requests sent, failed ones included
    duration_s: float = 0.0

    @property
    def tpot(self) -> list[float]:
        return [v for v in self.request_tpot if v is not None]

    def tails(self, slo: Slo) -> Tails:
        return summarize(self.ttft, self.request_tpot, self.e2el, self.sent, self.duration_s, slo)


def pooled_samples(samples: list[RequestSamples]) -> RequestSamples:
    """Every round's requests together (bench time summed)."""
    return RequestSamples(
        ttft=[v for s in samples for v in s.ttft],
        e2el=[v for s in samples for v in s.e2el],
        request_tpot=[v for s in samples for v in s.request_tpot],
        itl=[v for s in samples for v in s.itl],
        sent=sum(s.sent for s in samples),
        duration_s=sum(s.duration_s for s in samples),
    )


def _per_request(text: str, source: str) -> tuple[dict, dict[str, list]]:
    """A `--save-detailed` result file's document and its per-request lists (checked for equal length)."""
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise KvpushError(f"{source}: not a `vllm bench serve` result file ({exc})") from None
    if not isinstance(data, dict) or not isinstance(data.get("ttfts"), list):
        raise KvpushError(f"{source}: has no per-request figures; it was not written with --save-detailed")
    count = len(data["ttfts"])
    columns = {name: data.get(name) for name in ("latencies", "itls", "output_lens", "errors")}
    bad = [name for name, values in columns.items() if not isinstance(values, list) or len(values) != count]
    if bad:
        raise KvpushError(f"{source}: per-request figures of unequal length ({', '.join(bad)} vs {count} ttfts); "
                          f"the file is damaged")
    return data, {"ttfts": data["ttfts"], **columns}


def _succeeded(columns: dict[str, list], i: int) -> bool:
    return not columns["errors"][i] and bool(columns["output_lens"][i])  # failed: vLLM records 0 tokens and an error


def completed_request_ids(text: str, prefix: str, source: str = "<result>") -> list[str]:
    """The X-Request-Ids of the requests that succeeded: `vllm bench serve` numbers its requests from 0
    after the prefix, and lists them in that order."""
    _, columns = _per_request(text, source)
    return [f"{prefix}{i}" for i in range(len(columns["ttfts"])) if _succeeded(columns, i)]


def parse_request_samples(text: str, source: str = "<result>") -> RequestSamples:
    data, columns = _per_request(text, source)
    count = len(columns["ttfts"])
    ttft: list[float] = []
    tpot: list[float | None] = []
    itl: list[float] = []
    e2el: list[float] = []
    for i in range(count):
        if not _succeeded(columns, i):
            continue
        first, whole, tokens = data["ttfts"][i], columns["latencies"][i], columns["output_lens"][i]
        ttft.append(first * 1000)
        e2el.append(whole * 1000)
        itl.extend(gap * 1000 for gap in columns["itls"][i])
        tpot.append((whole - first) / (tokens - 1) * 1000 if tokens > 1 else None)
    return RequestSamples(ttft, e2el, tpot, itl, sent=count, duration_s=float(data.get("duration") or 0.0))


def _stats(values: list[float]) -> Stats:
    if not values:
        return Stats(None, None, None, None)
    return Stats(statistics.fmean(values), *(percentile(values, q) for q in (0.5, 0.9, 0.99)))


@dataclass(frozen=True)
class RatePoint:
    """Everything measured for one mode at one rate (in one round, or pooled over rounds)."""

    mode: str
    rate: float
    seed: int
    client: ClientResult
    router: RouterFigures
    instances: list[InstanceFigures]
    round: int = 0  # which round of a `--rounds` bench; the pooled point has -1
    tails: Tails | None = None  # percentiles with confidence intervals, goodput (from the per-request results)
    raw_file: str | None = None  # the client's per-request results, relative to the bench's directory
    engine_handoff: HandoffSummary | None = None  # from both engines' spans (handoff.py); None: not measured
    spans_file: str | None = None  # the spans it came from, relative to the bench's directory

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

    @property
    def prefill_engine_ms(self) -> float | None:
        """Prefill instances' own time per request, first scheduled to first token (their mean)."""
        prefill = [i for i in self.instances if i.role == "prefill"]
        return ms_per_request(sum(i.engine_prefill_s for i in prefill), sum(i.engine_requests for i in prefill))


def pool_points(points: list[RatePoint], samples: list[RequestSamples], slo: Slo = Slo(),
                handoffs: list[HandoffSamples] | None = None) -> RatePoint:
    """One mode at one rate over several rounds: latency percentiles of all requests together, counts
    and throughput summed, handoff percentiles (router histograms, per round) as their median over rounds,
    the engines' handoff (`handoffs`, one per round that measured it) over all requests together."""
    first = points[0]
    c = [p.client for p in points]
    duration = sum(x.duration_s for x in c)
    pooled = pooled_samples(samples)
    client = ClientResult(
        rate=first.client.rate,
        completed=sum(x.completed for x in c),
        failed=sum(x.failed for x in c),
        duration_s=duration,
        request_throughput=sum(x.completed for x in c) / duration if duration else 0.0,
        output_throughput=sum(x.total_output_tokens for x in c) / duration if duration else 0.0,
        total_token_throughput=sum(x.total_input_tokens + x.total_output_tokens for x in c) / duration
        if duration
        else 0.0,
        total_input_tokens=sum(x.total_input_tokens for x in c),
        total_output_tokens=sum(x.total_output_tokens for x in c),
        max_concurrent_requests=max(
            (x.max_concurrent_requests for x in c if x.max_concurrent_requests is not None), default=None
        ),
        latency={m: _stats(getattr(pooled, m)) for m in LATENCY_METRICS},
    )

    def median_of(name: str) -> float | None:
        values = [getattr(p.router, name) for p in points if getattr(p.router, name) is not None]
        return statistics.median(values) if values else None

    outcomes: dict[str, float] = {}
    for p in points:
        for k, v in p.router.outcomes.items():
            outcomes[k] = outcomes.get(k, 0.0) + v
    router = RouterFigures(
        handoff_gap_p50_ms=median_of("handoff_gap_p50_ms"),
        handoff_gap_p90_ms=median_of("handoff_gap_p90_ms"),
        handoff_gap_mean_ms=median_of("handoff_gap_mean_ms"),
        handoff_observations=sum(p.router.handoff_observations for p in points),
        retries=sum(p.router.retries for p in points),
        leg_failures=sum(p.router.leg_failures for p in points),
        outcomes=outcomes,
    )
    instances = []
    for i, inst in enumerate(first.instances):
        same = [p.instances[i] for p in points]
        kv_bytes: dict[str, float] = {}
        for x in same:
            for k, v in x.kv_bytes.items():
                kv_bytes[k] = kv_bytes.get(k, 0.0) + v
        instances.append(replace(inst, prompt_tokens_external=sum(x.prompt_tokens_external for x in same),
                                 prompt_tokens_local=sum(x.prompt_tokens_local for x in same),
                                 prompt_tokens_cached=sum(x.prompt_tokens_cached for x in same),
                                 kv_bytes=kv_bytes, failed_transfers=sum(x.failed_transfers for x in same),
                                 engine_requests=sum(x.engine_requests for x in same),
                                 engine_prefill_s=sum(x.engine_prefill_s for x in same),
                                 engine_queued=sum(x.engine_queued for x in same),
                                 engine_queue_s=sum(x.engine_queue_s for x in same)))
    return RatePoint(mode=first.mode, rate=first.rate, seed=first.seed, client=client, router=router,
                     instances=instances, round=-1, tails=pooled.tails(slo),
                     engine_handoff=summarize_handoff(pooled_handoff(handoffs)) if handoffs else None)


@dataclass
class ModeRun:
    mode: str
    topology_hash: str
    points: list[RatePoint] = field(default_factory=list)  # one per rate (pooled over rounds when there are several)
    round_points: list[RatePoint] = field(default_factory=list)  # with --rounds: one per round and rate
    error: str | None = None  # why this mode stopped early, if it did
    up_s: float | None = None
    idle_cores: dict[str, float] = field(default_factory=dict)  # per instance, with no request in flight
    phases_s: dict[str, float] = field(
        default_factory=dict
    )  # where the bench's wall time went: up, prove, rate 1, down...


def figure(point: RatePoint, name: str) -> float | None:
    """A named figure of one point: '<metric>_<stat>' (ttft_p50, tpot_mean, ...), 'handoff_p50', 'handoff_p90',
    'throughput' (req/s), 'output_throughput', 'failed', 'goodput' (req/s meeting both SLOs), 'good_fraction'."""
    if name in ("goodput", "good_fraction"):
        return getattr(point.tails, name).value if point.tails else None
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


RATIO_FIGURES = ("ttft_p50", "ttft_p90", "ttft_p99", "tpot_p50", "itl_p50", "e2el_p50", "handoff_p50", "goodput")


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


PAIRED_FIGURES = ("ttft_p50", "ttft_p90", "ttft_p99", "tpot_p50", "goodput")


def paired_ratios(runs: list[ModeRun], baseline: str) -> dict[str, dict[float, dict[str, list[float]]]]:
    """mode -> rate -> figure -> per-round ratios to the baseline's figure in the same round. Modes of one
    round ran minutes apart at most, so slow drift of the machine cancels out of each ratio."""
    base = next((r for r in runs if r.mode == baseline), None)
    base_points = {(p.round, p.rate): p for p in base.round_points} if base else {}
    out: dict[str, dict[float, dict[str, list[float]]]] = {}
    for run in runs:
        by_rate: dict[float, dict[str, list[float]]] = {}
        for p in run.round_points:
            b = base_points.get((p.round, p.rate))
            for f in PAIRED_FIGURES:
                value = ratio(figure(p, f), figure(b, f) if b else None)
                if value is not None:
                    by_rate.setdefault(p.rate, {}).setdefault(f, []).append(value)
        out[run.mode] = by_rate
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
    d["prefill_engine_ms"] = point.prefill_engine_ms
    for inst, inst_dict in zip(point.instances, d["instances"]):
        inst_dict["prefill_ms_per_request"] = inst.prefill_ms_per_request
        inst_dict["queue_ms_per_request"] = inst.queue_ms_per_request
    return d
