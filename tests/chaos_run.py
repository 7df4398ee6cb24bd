"""One chaos run on a running deployment: `clients` clients send prompts of the set through the
router (half of them streamed) while tests/chaos_faults.py stops and kills instances' processes
(settings None: no faults, the load alone), until `enough(records, seconds)` says so; then every
fault is recovered from and every request is told which faults it met. Used by the CI test
(tests/e2e/test_chaos_real_vllm.py) and by the long benchmark (benchmarks/chaos.py)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from chaos_faults import Chaos, ChaosSettings, Fault, attribute
from chaos_logs import keep_log
from chaos_prompts import PromptSet
from chaos_requests import READ_TIMEOUT_S, RequestRecord, Sender, backs_off, random_job
from fault_load import Load
from kvpush.deploy.lifecycle.lifecycle import LifecycleOptions
from kvpush.deploy.plan.plan import build_plan
from kvpush.deploy.topology.topology import Topology

FAILED_BACK_OFF_S = 1.0  # a client whose request failed waits this long (a dead 1P1D decode fails every request)
PROGRESS_EVERY_S = 30.0


@dataclass
class ChaosOutcome:
    topology: str
    epoch: float  # time.monotonic() at the start: rows are written relative to it
    epoch_wall: float  # time.time() then, to find the rows' moments in the logs
    end: float
    records: list[RequestRecord]
    faults: list[Fault]
    error: str | None = None  # what ended the run early (the deployment could not be brought back)
    kept_logs: list[Path] = field(default_factory=list)

    def request_rows(self) -> list[dict]:
        return [r.to_json(self.epoch) for r in self.records]

    def fault_rows(self) -> list[dict]:
        return [f.to_json(self.epoch) for f in self.faults]


def wait_all_in_rotation(chaos: Chaos, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while (n := chaos.in_rotation()) != len(chaos.instances):
        if time.monotonic() > deadline:
            raise AssertionError(f"{n} of {len(chaos.instances)} instances in rotation after {timeout_s:g} s")
        time.sleep(0.5)


def run_chaos(shape: str, topo: Topology, prompts: PromptSet, *, clients: int, seed: int, settings: ChaosSettings | None,
              options: LifecycleOptions, enough: Callable[[list[RequestRecord], float], bool], log_dir: Path | None = None,
              streamed_share: float = 0.5, log: Callable[[str], None] = print) -> ChaosOutcome:
    plan = build_plan(topo)
    kept: list[Path] = []

    def keep_dead_log(fault: Fault) -> None:  # `up` moved the dead process's log to .log.1
        if log_dir is not None:
            path = keep_log(Path(plan.process(fault.instance).log_path + ".1"), log_dir, f"{fault.instance}.{fault.id}.log")
            kept.extend([path] if path else [])

    chaos = Chaos(topo, plan.router_url, options, settings or ChaosSettings(), seed, after_up=keep_dead_log, log=log)
    wait_all_in_rotation(chaos)
    sender = Sender(shape, prompts, f"chaos{seed}-{shape}")
    epoch, epoch_wall = time.monotonic(), time.time()
    load = Load(plan.router_url, seed, sender, backs_off, clients=clients, job=random_job(prompts, streamed_share),
                back_off_s=FAILED_BACK_OFF_S)
    if settings is not None:  # None: the load alone, no faults
        chaos.start()
    error = None
    next_progress = epoch + PROGRESS_EVERY_S
    try:
        while not enough(load.outcomes, time.monotonic() - epoch) and chaos.error is None:
            time.sleep(0.5)
            if time.monotonic() > next_progress:
                next_progress += PROGRESS_EVERY_S
                done = list(load.outcomes)
                log(f"{shape}: {time.monotonic() - epoch:.0f} s, {len(done)} requests, {sum(r.answered for r in done)} "
                    f"answered, {sum(r.wrong for r in done)} wrong, {len(chaos.faults)} faults")
    finally:
        try:  # the load goes on until the last fault is recovered from: requests meet the recovery too
            faults = chaos.stop() if settings is not None else []
        except Exception as exc:  # noqa: BLE001 - the caller decides; what was measured is kept
            faults, error = chaos.faults, f"{type(exc).__name__}: {exc}"
        finally:
            records = load.stop(READ_TIMEOUT_S + 30)
    end = time.monotonic()
    attribute(records, faults, chaos.instances, end)
    return ChaosOutcome(shape, epoch, epoch_wall, end, records, faults, error, kept)
