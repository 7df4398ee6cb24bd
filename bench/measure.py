"""Measuring one rate against one running deployment: /metrics scraped before and after the load."""
from __future__ import annotations

import json
from pathlib import Path

from kvpush.common.errors import KvpushError
from kvpush.deploy.lifecycle.secrets import AccessKeys
from kvpush.deploy.runners import Runner

from .client import BenchClient, LoadSpec
from .deployment import Deployed, Endpoint, timed
from .engine_timings import collect
from .handoff import summarize
from .options import BenchEvents, BenchOptions, seed_for
from .raw import RAW_DIR, keep, read_text, relative
from .results import RatePoint, completed_request_ids, parse_client_result, parse_request_samples
from .scrape import instance_figures, router_figures


def scrape(runners: dict[str, Runner], endpoints: list[Endpoint], keys: AccessKeys) -> dict[str, str]:
    pages = {}
    for e in endpoints:
        response = runners[e.host].http("GET", e.metrics_url, timeout=15, headers=keys.headers(e.role))
        if response.status != 200:
            raise KvpushError(f"{e.name} on host {e.host}: {e.metrics_url} answered HTTP {response.status}")
        pages[e.name] = response.text()
    return pages


def measure_rate(d: Deployed, options: BenchOptions, events: BenchEvents, client: BenchClient, rate_index: int,
                 round_index: int = 0) -> tuple[RatePoint, Path]:
    """Drive one rate against one deployment; /metrics scraped before and after. Returns the point and
    the client's per-request result file, as kept (raw.keep)."""
    rate = options.rates[rate_index]
    seed = seed_for(options.seed, rate_index, round_index)
    name = f"{d.run.mode}-rate{rate:g}" + (f"-round{round_index + 1}" if options.rounds > 1 else "")
    raw_dir = options.out_dir / RAW_DIR
    load = LoadSpec(base_url=d.base_url, served_model=d.topo.model.name, tokenizer=d.tokenizer, rate=rate,
                    num_prompts=options.num_prompts, input_len=options.input_len, output_len=options.output_len,
                    seed=seed, result_dir=str(raw_dir), result_filename=f"{name}.json", request_id_prefix=f"{name}-",
                    prefix_len=options.prefix_len, input_len_spread=options.input_len_spread,
                    workload=options.workload(), timeout_s=options.client_timeout_s)
    before = scrape(d.runners, d.endpoints, d.keys)
    workload = options.workload()
    events.rate_started(d.run.mode, rate, (options.num_prompts if workload is None else workload.conversations) / rate)
    with timed(d.run, f"rate {rate:g}" + (f" round {round_index + 1}" if options.rounds > 1 else "")):
        path = client.run(load, options.out_dir / "logs" / f"{name}.log", options.client_timeout_s, d.keys.client)
    after = scrape(d.runners, d.endpoints, d.keys)
    metrics_path = raw_dir / f"{name}-metrics.json"
    metrics_path.write_text(json.dumps({"before": before, "after": after}))
    keep(metrics_path)
    path = keep(path)
    text = read_text(path)
    handoff, spans_file = None, None
    if d.spans is not None and d.topo.connector.type != "colocated":
        spans_path = raw_dir / f"{name}-spans.json.gz"
        with timed(d.run, f"spans {rate:g}" + (f" round {round_index + 1}" if options.rounds > 1 else "")):
            joined = collect(
                d.spans,
                load.request_id_prefix,
                completed_request_ids(text, load.request_id_prefix, str(path)),
                spans_path,
            )
        handoff, spans_file = summarize(joined), relative(spans_path, options.out_dir)
    point = RatePoint(
        mode=d.run.mode,
        rate=rate,
        seed=seed,
        client=parse_client_result(text, str(path)),
        router=router_figures(before[d.router.name], after[d.router.name]),
        instances=[
            instance_figures(e.name, e.role, before[e.name], after[e.name]) for e in d.endpoints if e.role != "router"
        ],
        round=round_index,
        tails=parse_request_samples(text, str(path)).tails(options.slo),
        raw_file=relative(path, options.out_dir),
        engine_handoff=handoff,
        spans_file=spans_file,
    )
    events.rate_done(d.run.mode, point)
    return point, path
