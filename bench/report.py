"""What a bench writes: bench.json (options, configuration, every mode's points and ratios) and plots."""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvpush.deploy.lifecycle.tiny_model import describe
from kvpush.deploy.topology.topology import Topology

from . import environment
from .modes import kv_bytes_per_token, topology_hash
from .options import BenchOptions, mode_topology, seed_for
from .plots import write_plots
from .results import ModeRun, paired_ratios, point_to_dict, ratios_vs_baseline
from .tails import CONFIDENCE

RESULT_FILE = "bench.json"


@dataclass
class BenchReport:
    options: BenchOptions
    configuration: dict
    runs: list[ModeRun] = field(default_factory=list)
    started_at: float = field(default_factory=time.time)
    finished_at: float | None = None
    interrupted: bool = False
    files: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        o = self.options
        return {
            "kvpush_bench": 1,
            "started_at": self.started_at,
            "finished_at": self.finished_at,
            "wall_s": None if self.finished_at is None else self.finished_at - self.started_at,
            "interrupted": self.interrupted,
            "options": {
                "modes": o.modes,
                "rates": o.rates,
                "input_len": o.input_len,
                "output_len": o.output_len,
                "num_prompts": o.num_prompts,
                "kv_heavy": o.kv_heavy,
                "prefix_len": o.prefix_len,
                "input_len_spread": o.input_len_spread,
                "baseline": o.baseline,
                "seed": o.seed,
                "port_base": o.port_base,
                "rounds": o.rounds,
                "conversations": o.conversations,
                "turns": o.turns,
                "turn_tokens": None if (workload := o.workload()) is None else workload.turn_tokens,
                "slo": {"ttft_ms": o.slo.ttft_ms, "tpot_ms": o.slo.tpot_ms},
                "confidence": CONFIDENCE,
            },
            "configuration": self.configuration,
            "runs": [
                {
                    "mode": r.mode,
                    "topology_hash": r.topology_hash,
                    "up_s": r.up_s,
                    "error": r.error,
                    "idle_cores": r.idle_cores,
                    "phases_s": r.phases_s,
                    "points": [point_to_dict(p) for p in r.points],
                    "round_points": [point_to_dict(p) for p in r.round_points],
                }
                for r in self.runs
            ],
            "ratios_vs_baseline": {
                m: {f"{rate:g}": v for rate, v in by_rate.items()}
                for m, by_rate in ratios_vs_baseline(self.runs, o.baseline).items()
            },
            "paired_ratios_vs_baseline": {
                m: {f"{rate:g}": v for rate, v in by_rate.items()}
                for m, by_rate in paired_ratios(self.runs, o.baseline).items()
            },
        }


def configuration(topo: Topology, options: BenchOptions) -> dict:
    base = mode_topology(topo, options, options.modes[0])
    model = base.model
    config: dict[str, Any] = {
        "versions": environment.versions(),
        "machine": environment.machine(),
        "topology": {"name": topo.name, "bench_deployment": base.name, "platform": topo.platform,
                     "prefill": len(topo.prefill), "decode": len(topo.decode),
                     "instances": [s.model_dump(mode="json", include={"name", "host", "cpu_cores", "kv_cache_gib"})
                                   for _, _, s in base.instances()]},
        "topology_hashes": {m: topology_hash(mode_topology(topo, options, m)) for m in options.modes},
        "model": {"path": model.path, "served_name": model.name, "max_model_len": model.max_model_len,
                  "dtype": model.dtype, "tiny": model.tiny.model_dump() if model.tiny else None,
                  "description": describe(model.tiny) if model.tiny else None,
                  "kv_bytes_per_token": kv_bytes_per_token(model.tiny) if model.tiny else None},
        "client": {"tool": "vllm bench serve" if options.workload() is None else "kvpush-conversations",
                   "process": "one warm process runs its CLI entry point for every rate",
                   "dataset": "random" if options.workload() is None else "multi-turn token-id conversations",
                   "arrivals": "poisson" if options.workload() is None else "poisson conversation starts, "
                                                                           "each turn right after the last answer",
                   "ignore_eos": True,
                   "temperature": 0, "seeds": {f"{r:g}": [seed_for(options.seed, i, k) for k in range(options.rounds)]
                                               for i, r in enumerate(options.rates)}},
    }
    per_token = config["model"]["kv_bytes_per_token"]
    if per_token:
        config["model"]["kv_bytes_per_prompt"] = per_token * (options.prefix_len + options.input_len)
    return config


def write_outputs(report: BenchReport) -> None:
    out = report.options.out_dir
    if hasattr(os, "getloadavg"):
        report.configuration.setdefault("machine", {})["load_average_at_end"] = list(os.getloadavg())
    model = report.configuration.get("model", {})
    o = report.options
    prompt = (f"{o.prefix_len} shared + " if o.prefix_len else "") + f"{o.input_len}" + \
        (f" (±{o.input_len_spread:.0%})" if o.input_len_spread else "")
    workload = o.workload()
    per_rate = (
        f"{o.num_prompts} prompts per rate"
        if workload is None
        else f"{workload.conversations} conversations x {workload.turns} turns "
        f"(+{workload.turn_tokens} tokens each) per rate"
    )
    subtitle = (f"{model.get('served_name')}, {prompt} in / {report.options.output_len} out tokens, {per_rate}"
                + (f" x {report.options.rounds} rounds" if report.options.rounds > 1 else ""))
    path = out / RESULT_FILE
    report.files.insert(0, str(path))
    _write_json(report, path)  # first: a run's figures must outlive a failure to draw them
    if any(r.points for r in report.runs):
        try:
            report.files += [str(p) for p in write_plots(report.runs, out, subtitle)]
        except ImportError:  # the JSON and tables still carry every figure
            report.configuration["plots"] = "not drawn: matplotlib is not installed (pip install 'kvpush[bench]')"
        except Exception as exc:  # a plotting bug costs the plots, not the run
            report.configuration["plots"] = f"not drawn: {type(exc).__name__}: {exc}"
        _write_json(report, path)


def _write_json(report: BenchReport, path: Path) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(report.to_dict(), indent=2, default=_json_default) + "\n")
    os.replace(tmp, path)


def _json_default(value: object) -> object:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, float) and value != value:
        return None
    raise TypeError(f"cannot serialize {type(value).__name__}")
