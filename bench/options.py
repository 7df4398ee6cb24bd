"""What a bench is asked to do (its options), and what it tells the user while it runs (its events)."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from kvpush.common.errors import UsageError
from kvpush.deploy.lifecycle.lifecycle import Events, LifecycleOptions
from kvpush.deploy.topology.topology import Topology

from .conversations import Workload
from .modes import DEFAULT_BASELINE, ROUNDS_NEED_PORT_BASE, bench_topology
from .results import RatePoint
from .tails import Slo

MAX_ROUNDS = 50
ROUND_SEED_STRIDE = 100_000


@dataclass(frozen=True)
class BenchOptions:
    modes: list[str]
    rates: list[float]
    input_len: int
    output_len: int
    num_prompts: int
    out_dir: Path
    kv_heavy: bool = False
    # tokens every prompt of a load level starts with (the same ones), before its own input_len: from
    # the second request on, prefill's and decode's prefix caches hold them and only the rest moves
    prefix_len: int = 0
    input_len_spread: float = 0.0  # each prompt's own part is input_len x [1 - spread, 1 + spread], uniform
    # > 0: each rate runs this many multi-turn conversations (conversations.py) instead of num_prompts
    # single requests; rates are then conversations started per second
    conversations: int = 0
    turns: int = 1
    turn_tokens: int | None = None  # new tokens in each turn after the first (default: input_len)
    baseline: str = DEFAULT_BASELINE
    port_base: int | None = None
    rounds: int = 1  # > 1: every mode up at once, the rates run `rounds` times with the modes interleaved
    seed: int = 0
    tokenizer: str | None = None
    client_timeout_s: float = 900.0
    slo: Slo = Slo()  # goodput counts the requests meeting both
    engine_timings: bool = True  # every instance sends its per-request spans, for the handoff diagnostic
    traces_endpoint: str | None = None  # where they go: the bench's receiver, set while it runs
    lifecycle: LifecycleOptions = field(default_factory=LifecycleOptions)

    def workload(self) -> Workload | None:
        if not self.conversations:
            return None
        return Workload(self.conversations, self.turns, self.input_len,
                        self.input_len if self.turn_tokens is None else self.turn_tokens, self.prefix_len)

    def validate(self) -> None:
        for name in ("input_len", "output_len", "num_prompts"):
            if getattr(self, name) < 1:
                raise UsageError(f"--{name.replace('_', '-')} must be at least 1 (got {getattr(self, name)})")
        if self.conversations < 0:
            raise UsageError(f"--conversations must be 0 (single requests) or more (got {self.conversations})")
        workload = self.workload()
        if workload is not None and workload.problem():
            raise UsageError(workload.problem())
        if workload is None and (self.turns != 1 or self.turn_tokens is not None):
            raise UsageError("--turns and --turn-tokens describe conversations: give --conversations N too")
        if workload is not None and self.input_len_spread:
            raise UsageError("--input-len-spread applies to single requests, not to --conversations; leave it out")
        if self.prefix_len < 0:
            raise UsageError(f"--prefix-len must be 0 or more (got {self.prefix_len})")
        if not 0.0 <= self.input_len_spread < 1.0:
            raise UsageError(f"--input-len-spread must be in [0, 1) (got {self.input_len_spread:g})")
        if not 1 <= self.rounds <= MAX_ROUNDS:
            raise UsageError(f"--rounds must be between 1 and {MAX_ROUNDS} (got {self.rounds})")
        if self.rounds > 1 and self.port_base is None:
            raise UsageError(ROUNDS_NEED_PORT_BASE)
        if self.slo.problem():
            raise UsageError(self.slo.problem())
        if self.baseline not in self.modes:
            raise UsageError(
                f"--baseline {self.baseline} is not among --modes {','.join(self.modes)}; add it or choose "
                f"another baseline"
            )


class BenchEvents:
    """What a bench tells the user while it runs; the CLI renders it. Default: silent."""

    def mode(self, mode: str, status: str) -> None: ...

    def rate_started(self, mode: str, rate: float, expected_s: float) -> None: ...

    def rate_done(self, mode: str, point: RatePoint) -> None: ...

    def mode_failed(self, mode: str, error: str) -> None: ...

    def lifecycle(self) -> Events:
        return Events()


def seed_for(base: int, rate_index: int, round_index: int = 0) -> int:
    """Every rate (and every round) gets its own prompts; every mode gets the same prompts at the same rate
    and round (fair comparison: each mode has its own servers, so nothing is cached from another mode)."""
    return base + 1000 * (rate_index + 1) + ROUND_SEED_STRIDE * round_index


def mode_topology(topo: Topology, options: BenchOptions, mode: str) -> Topology:
    """What the bench deploys for `mode`: with --rounds every mode has a name and ports of its own."""
    index = options.modes.index(mode) if options.rounds > 1 else None
    return bench_topology(topo, mode, kv_heavy=options.kv_heavy, port_base=options.port_base, mode_index=index,
                          traces_endpoint=options.traces_endpoint)
