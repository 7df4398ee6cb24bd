"""Doctor's orchestration: probe every host in parallel, then let each check decide.

(1) One facts probe per host (tools, model, versions, and the port work: bind, listen and
connect at once); as a host's probe returns, the NIXL backend probe starts for its (machine,
interpreter, env) unless another host of the same machine already runs it. (2) With --transfer,
one WRITE per prefill/decode host pair. Every step is cut off at a deadline. Checks are pure
functions of the facts gathered, so they are tested on recorded outputs.
"""
from __future__ import annotations

import errno
import json
import secrets
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any, Mapping

from kvpush.common.errors import UsageError
from kvpush.deploy.plan.plan import build_plan
from kvpush.deploy.runners.base import parse_port_holders, port_holders_command
from kvpush.deploy.topology.placement import bind_address
from kvpush.deploy.topology.topology import Topology

from . import (
    check_accelerators,
    check_fabric,
    check_limits,
    check_model,
    check_nixl,
    check_ports,
    check_software,
    check_transfer,
)
from .context import Check, DoctorContext, TransferOutcome, df_paths, tool_commands
from .facts import HostFacts, NixlProbe
from .port_map import expected_incoming, port_claims, reach_targets
from .probes import CommandRunner, ProbeFailure, in_parallel, python_command, run_host_probe, run_nixl_probe
from .result import CheckResult, Status, fail

CHECKS: list[Check] = [
    *check_software.CHECKS, *check_model.CHECKS, *check_accelerators.CHECKS, *check_fabric.CHECKS,
    *check_nixl.CHECKS, *check_limits.CHECKS, *check_ports.CHECKS, *check_transfer.CHECKS,
]
CHECK_NAMES = [c.name for c in CHECKS]
PROBE_CHECK = "probe"  # always reported when a host could not be probed
NIXL_ENV_PREFIXES = ("UCX_", "FI_", "NIXL_", "LD_LIBRARY_PATH", "CUDA_VISIBLE_DEVICES")
# The fast subset `up` runs before launching: everything that needs no real transfer.
FAST_CHECKS = frozenset(n for n in CHECK_NAMES if n != "transfer")


@dataclass(frozen=True)
class DoctorOptions:
    only: frozenset[str] = frozenset()
    skip: frozenset[str] = frozenset()
    transfer: bool = False
    timeout_s: float = 20.0  # one host's probe, end to end
    command_timeout_s: float = 5.0  # each tool inside the probe (nvidia-smi, fi_info, ...)
    nixl_timeout_s: float = 15.0
    # How long connects retry and listeners wait. Each host counts it from its own probe's start, so
    # it must also cover how far apart the probes start (SSH sessions or srun steps opened at once,
    # an interpreter starting on a loaded host). A peer that answers ends the wait at once: only a
    # pair that cannot reach each other waits it out.
    reach_window_s: float = 10.0
    transfer_bytes: int = 64 * 2**20
    running: frozenset[str] = frozenset()  # processes already up: their ports are expected taken
    # The deployment's own live processes, per host: PID -> process name (process_view.deployment_pids).
    # A port one of them holds is "in use by this deployment", not taken.
    own_pids: Mapping[str, Mapping[int, str]] = field(default_factory=dict)


@dataclass
class DoctorReport:
    results: list[CheckResult]
    seconds: float
    hosts: list[str] = field(default_factory=list)

    @property
    def failed(self) -> bool:
        return any(r.status is Status.FAIL for r in self.results)

    def failures(self) -> list[CheckResult]:
        return [r for r in self.results if r.status is Status.FAIL]

    def counts(self) -> dict[str, int]:
        return {s.value: sum(1 for r in self.results if r.status is s) for s in Status}

    def first_failure_line(self) -> str | None:
        """One line for an error message: the first failure, its remedy, and how many more."""
        failures = self.failures()
        if not failures:
            return None
        first = failures[0]
        more = f" (+{len(failures) - 1} more failed checks; run `kvpush doctor` for all)" if len(failures) > 1 else ""
        return f"doctor: {first.check} on {first.subject}: {first.summary}; {first.remedy}{more}"

    def to_dict(self) -> dict:
        return {"ok": not self.failed, "seconds": round(self.seconds, 3), "counts": self.counts(), "hosts": self.hosts,
                "results": [r.to_dict() for r in self.results]}


def select_checks(only: frozenset[str] = frozenset(), skip: frozenset[str] = frozenset()) -> list[str]:
    for flag, names in (("--only", only), ("--skip", skip)):
        unknown = sorted(set(names) - set(CHECK_NAMES))
        if unknown:
            raise UsageError(f"{flag}: unknown check {', '.join(unknown)}; checks are: {', '.join(CHECK_NAMES)}")
    return [n for n in CHECK_NAMES if (not only or n in only) and n not in skip]


def _nixl_env(env: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(NIXL_ENV_PREFIXES)}


class _NixlProbes:
    """One backend probe per distinct (machine, interpreter, env, backend), started by the first
    host of that machine whose host probe finishes, while the other hosts' probes still run.
    Hosts reached at several addresses of one machine share its answer (the probe's cost is
    the NIXL import and backend creation, ~0.5 s of CPU)."""

    def __init__(self, ctx: DoctorContext, runners: Mapping[str, CommandRunner], options: DoctorOptions):
        self.ctx, self.runners, self.options = ctx, runners, options
        self.lock = threading.Lock()
        self.slots: dict[str, tuple[str, threading.Event, dict]] = {}

    def for_host(self, host: str, facts: HostFacts) -> list[NixlProbe]:
        backend = self.ctx.topo.connector.backend
        interpreter = self.ctx.plan.host(host).python
        probes = []
        for env_text in sorted({json.dumps(_nixl_env(p.env), sort_keys=True) for p in self.ctx.vllm_processes(host)}):
            key = f"{facts.machine_key or host}|{interpreter}|{env_text}|{backend}"
            with self.lock:
                owner = key not in self.slots
                if owner:
                    self.slots[key] = (host, threading.Event(), {})
                first_host, done, box = self.slots[key]
            if owner:
                try:
                    box["probe"] = run_nixl_probe(self.runners[host], interpreter, backend, json.loads(env_text),
                                                  self.options.nixl_timeout_s)
                except Exception as exc:
                    box["probe"] = NixlProbe(
                        backend, False, [], [], f"{type(exc).__name__}: {exc}", "python nixl_probe.py", None
                    )
                finally:
                    done.set()
                probes.append(box["probe"])
            elif done.wait(self.options.nixl_timeout_s + 5) and "probe" in box:
                probes.append(replace(box["probe"], shared_from=first_host))
            else:
                probes.append(
                    NixlProbe(
                        backend,
                        False,
                        [],
                        [],
                        f"the probe on {first_host} (same machine) did not finish",
                        "python nixl_probe.py",
                        None,
                    )
                )
        return probes


def _transfer_pair(ctx: DoctorContext, runners: Mapping[str, CommandRunner], options: DoctorOptions,
                   source: str, target: str) -> TransferOutcome | None:
    prefill = next(p for p in ctx.topo.prefill if p.host == source)
    port = prefill.side_channel_port  # decode dials prefill's side channel when serving; the probe does too
    source_facts = ctx.facts.get(source)
    if source_facts is None or target not in ctx.facts:
        return None
    if not any(r["ok"] and r["port"] == port for r in source_facts.raw.get("bind", [])):
        return None  # the port is taken (ports-free says so) or was not probed
    nonce = secrets.token_hex(4)
    mem = "VRAM" if ctx.topo.platform == "cuda" else "DRAM"
    timeout_s = options.nixl_timeout_s + options.reach_window_s
    common = {"backend": ctx.topo.connector.backend, "nbytes": options.transfer_bytes, "seed": 1, "mem": mem,
              "nonce": nonce, "repeat": 3, "timeout": timeout_s}
    addr = bind_address(ctx.topo.hosts[source])
    requests = {
        "target": (target, dict(common, role="target", addr=addr, port=port)),
        "initiator": (source, dict(common, role="initiator", bind=addr, port=port)),
    }

    def job(role: str) -> dict[str, Any]:  # the probe's JSON report
        host, req = requests[role]
        proc = next(p for p in ctx.vllm_processes(host))
        command = python_command(
            ctx.plan.host(host).python, "transfer_probe.py", [json.dumps(req)], _nixl_env(proc.env)
        )
        result = runners[host].run(command, timeout=timeout_s + 5)
        line = next((ln for ln in reversed(result.stdout.splitlines()) if ln.startswith("{")), None)
        if line is None:
            tail = (result.stderr.strip() or "no output").splitlines()[-1]
            return {"ok": False, "error": f"{role} on {host} exited {result.exit_code}: {tail}"}
        return json.loads(line)

    outcomes = in_parallel(
        {"target": lambda: job("target"), "initiator": lambda: job("initiator")}, timeout_s + 10
    )
    reports: dict[str, dict[str, Any]] = {
        k: (v if isinstance(v, dict) else {"ok": False, "error": v.message}) for k, v in outcomes.items()}
    init, targ = reports["initiator"], reports["target"]
    lines = (
        f"initiator on {source}: " + json.dumps({k: init.get(k) for k in ("ok", "gbps", "seconds", "error")}),
        f"target on {target}: "
        + json.dumps({k: targ.get(k) for k in ("ok", "byte_exact", "mismatched_bytes", "error")}),
    )
    error = init.get("error") or targ.get("error")
    return TransferOutcome(
        source,
        target,
        ok=bool(init.get("ok")) and targ.get("byte_exact") is not None,
        byte_exact=targ.get("byte_exact"),
        nbytes=options.transfer_bytes,
        seconds=init.get("seconds"),
        gbps=init.get("gbps"),
        error=error,
        evidence=lines,
        command=f"python transfer_probe.py: {mem} WRITE {source} -> {target} (metadata to {source}:{port}) via "
                        f"{common['backend']}",
    )


def _probe_failure_row(failure: ProbeFailure) -> CheckResult:
    if failure.timed_out:
        remedy = "the host (or a tool on it) hangs: log in and check load, NFS mounts, the GPU driver"
    elif (
        "host key" in failure.message
        or "authentication" in failure.message
        or "SSH" in failure.message
        or "refused" in failure.message
        or "unreachable" in failure.message
    ):
        remedy = "fix SSH access to this host (address, ssh_port, user, key; see the message)"
    else:
        remedy = "run the probe by hand on the host: the interpreter or a tool failed"
    return fail(PROBE_CHECK, failure.host, failure.message, remedy)


def probe_requests(ctx: DoctorContext, selected: list[str], options: DoctorOptions) -> dict[str, dict]:
    """What each host's facts probe must do: tools to run, model to inspect, ports to bind and reach."""
    topo, plan = ctx.topo, ctx.plan
    listening = {(c.host, c.port) for c in ctx.claims}
    incoming = expected_incoming(ctx.targets, listening)
    nonce = secrets.token_hex(6)
    requests = {}
    for host_plan in plan.hosts:
        name = host_plan.name
        runs_vllm = any(p.role != "router" for p in host_plan.processes)
        requests[name] = {
            "host": name,
            "nonce": nonce,
            "model_path": topo.model.path if runs_vllm and any(n.startswith("model") for n in selected) else None,
            "commands": tool_commands(topo, plan, name),
            "df_paths": df_paths(topo, plan, name),
            "listen": [{"addr": c.addr, "port": c.port, "label": c.label} for c in ctx.claims if c.host == name],
            "connect": [
                {"addr": t.addr, "port": t.port, "label": t.label, "host": t.target}
                for t in ctx.targets
                if t.source == name
            ],
            "expect_incoming": incoming.get(name, 0),
            "reach_window_s": options.reach_window_s,
            "command_timeout_s": options.command_timeout_s,
        }
    return requests


def evaluate(ctx: DoctorContext, selected: list[str]) -> list[CheckResult]:
    """Every selected check's results on the gathered facts (pure: no host is touched)."""
    results = [_probe_failure_row(f) for f in ctx.probe_failures.values()]
    for check in CHECKS:
        if check.name in selected:
            try:
                results += check.run(ctx)
            except Exception as exc:  # a bug in one check must not hide the others' results
                results.append(fail(check.name, "(doctor)", f"check crashed: {type(exc).__name__}: {exc}",
                                    "report this as a kvpush bug with --json output"))
    return results


def run_doctor(topo: Topology, runners: Mapping[str, CommandRunner], options: DoctorOptions = DoctorOptions(),
               unreachable: Mapping[str, str] = {}) -> DoctorReport:
    """Every selected check on every host that needs it; `unreachable` hosts (host -> why, as
    hosts.connected says it) are reported failed without a probe. Never raises for a host's
    problem: those are results. Raises UsageError for unknown check names."""
    started = time.monotonic()
    selected = select_checks(options.only, options.skip)
    plan = build_plan(topo)
    ctx = DoctorContext(topo, plan, facts={}, probe_failures={}, running=frozenset(options.running))
    port_work = any(n in selected for n in ("ports-free", "reachability", "transfer"))
    ctx.claims = port_claims(topo, options.running) if port_work else []
    listening = {(c.host, c.port) for c in ctx.claims}
    ctx.targets = (
        [t for t in reach_targets(topo) if (t.target, t.port) in listening] if "reachability" in selected else []
    )
    requests = probe_requests(ctx, selected, options)
    ctx.probe_failures.update({h: ProbeFailure(h, why) for h, why in unreachable.items() if h in requests})
    missing = [h for h in requests if h not in runners and h not in unreachable]
    if missing:
        raise UsageError(f"no runner for host(s) {', '.join(missing)}")
    nixl = _NixlProbes(ctx, runners, options) if "nixl-backend" in selected and ctx.disaggregated else None
    vllm_hosts = set(ctx.vllm_hosts())

    def probe(host: str) -> HostFacts:
        facts = run_host_probe(host, runners[host], plan.host(host).python, requests[host], options.timeout_s)
        if nixl is not None and host in vllm_hosts:
            facts.nixl.extend(nixl.for_host(host, facts))
        return facts

    cutoff = options.timeout_s + (options.nixl_timeout_s + 5 if nixl else 0)
    jobs = {h: (lambda h=h: probe(h)) for h in requests if h in runners}
    for host, outcome in in_parallel(jobs, cutoff, shown_timeout=options.timeout_s).items():
        if isinstance(outcome, HostFacts):
            ctx.facts[host] = outcome
        else:
            ctx.probe_failures[host] = outcome
    ctx.own_pids = {h: dict(pids) for h, pids in options.own_pids.items()}
    if "ports-free" in selected:
        ctx.port_holders = _port_holders(ctx, runners, options)
    if options.transfer and "transfer" in selected and ctx.disaggregated:
        ctx.transfers = {}
        for source, target in check_transfer.transfer_pairs(ctx):
            transfer = _transfer_pair(ctx, runners, options, source, target)
            if transfer is not None:
                ctx.transfers[(source, target)] = transfer
    results = evaluate(ctx, selected)
    return DoctorReport(results, time.monotonic() - started, hosts=[h.name for h in plan.hosts])


def _port_holders(ctx: DoctorContext, runners: Mapping[str, CommandRunner], options: DoctorOptions) -> dict:
    """For the hosts where a port was in use: per port, the processes listening on it."""
    taken = {host: [r["port"] for r in facts.raw.get("bind", []) if r.get("errno") == errno.EADDRINUSE]
             for host, facts in ctx.facts.items()}

    def look(host: str) -> dict:
        result = runners[host].run(port_holders_command(), timeout=options.timeout_s)
        return parse_port_holders(taken[host], result.stdout) if result.exit_code == 0 else {}

    jobs = {h: (lambda h=h: look(h)) for h, ports in taken.items() if ports}
    return {h: found for h, found in in_parallel(jobs, options.timeout_s).items() if isinstance(found, dict)}


def fast_checks(topo: Topology, runners: Mapping[str, CommandRunner], running: frozenset[str] = frozenset(),
                timeout_s: float = 20.0) -> DoctorReport:
    """What `up` runs before launching: every check except the transfer proof. Processes named in
    `running` are already up, so their ports are not required to be free."""
    return run_doctor(topo, runners, DoctorOptions(only=FAST_CHECKS, running=frozenset(running), timeout_s=timeout_s))
