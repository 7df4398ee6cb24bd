"""Ports: every configured port is free on its host, and the hosts that must talk can connect."""
from __future__ import annotations

import errno
from collections import defaultdict

from .context import Check, DoctorContext
from .facts import HostFacts
from .result import CheckResult, Evidence, fail, ok, pair_subject, skip

PROBE_COMMAND = "python facts_probe.py: bind(addr, port) then listen; connect from peers"


def _bind_results(facts: HostFacts) -> list[dict]:
    return facts.raw.get("bind", [])


def check_ports_free(ctx: DoctorContext) -> list[CheckResult]:
    """Every port a process will bind is free, or held by this deployment's own process already."""
    claimed_hosts = sorted({c.host for c in ctx.claims})

    def decide(facts: HostFacts) -> CheckResult:
        results = _bind_results(facts)
        holders = ctx.port_holders.get(facts.host, {})
        own = ctx.own_pids.get(facts.host, {})

        def ours(r: dict) -> str | None:
            """The deployment's process holding the port, when every listener on it is the deployment's."""
            listeners = holders.get(r["port"], [])
            if r["ok"] or not listeners or any(p.pid not in own for p in listeners):
                return None
            return ", ".join(sorted({own[p.pid] for p in listeners}))

        in_use = {r["port"]: ours(r) for r in results if ours(r)}
        taken = [r for r in results if not r["ok"] and r["port"] not in in_use]

        def line(r: dict) -> str:
            if r["ok"]:
                return f"{r['addr']}:{r['port']} ({r['label']}): free"
            if r["port"] in in_use:
                return f"{r['addr']}:{r['port']} ({r['label']}): in use by this deployment ({in_use[r['port']]})"
            return f"{r['addr']}:{r['port']} ({r['label']}): {r['error']} (errno {r['errno']}){_held_by(holders, r)}"

        lines = [line(r) for r in results]
        ev = Evidence(
            PROBE_COMMAND, tuple((lines if not taken else [ln for ln in lines if not ln.endswith("free")])[:8])
        )
        if taken:
            first = taken[0]
            more = f" (+{len(taken) - 1} more)" if len(taken) > 1 else ""
            listeners = holders.get(first["port"], [])
            stop = (
                f"stop {', '.join(f'pid {p.pid}' for p in listeners)} on {facts.host} (listening on "
                f"{first['addr']}:{first['port']})"
                if listeners
                else f"stop what listens on {first['addr']}:{first['port']} on {facts.host} "
                f"(ss -ltnp 'sport = :{first['port']}')"
            )
            return fail(
                "ports-free",
                facts.host,
                f"port {first['port']} on host {facts.host} ({first['label']}) is taken{_held_by(holders, first)}: "
                f"{first['error']}{more}",
                f"{stop} or choose another port in the topology",
                ev,
            )
        free = [r for r in results if r["ok"]]
        summary = f"{len(free)} port(s) free" + (": " + ", ".join(str(r["port"]) for r in free[:6]) if free else "")
        if in_use:
            summary += f"; {len(in_use)} in use by this deployment: " + ", ".join(
                f"{p} ({n})" for p, n in list(in_use.items())[:6]
            )
        return ok("ports-free", facts.host, summary, ev)

    if not claimed_hosts:
        return [skip("ports-free", "(all)", "every process is already running")]
    return ctx.each_host("ports-free", claimed_hosts, decide)


def _held_by(holders: dict, r: dict) -> str:
    """' by pid N (name)' for a port in use, as far as this user can see who listens on it."""
    if r["errno"] != errno.EADDRINUSE:
        return ""
    listeners = holders.get(r["port"])
    if listeners is None:
        return ""  # not looked up (the lookup failed)
    if not listeners:
        return " by a process this user cannot see (another user's?)"
    return " by " + ", ".join(f"pid {p.pid} ({p.command or '?'})" for p in listeners)


def check_reachability(ctx: DoctorContext) -> list[CheckResult]:
    by_pair: dict[tuple[str, str], list] = defaultdict(list)
    for t in ctx.targets:
        by_pair[(t.source, t.target)].append(t)
    out = []
    for (source, target), targets in by_pair.items():
        subject = pair_subject(source, target)
        facts = ctx.facts.get(source)
        if facts is None:
            out.append(skip("reachability", subject, f"no facts from {source} (see its probe row)", scope="pair"))
            continue
        if target not in ctx.facts:
            # The target's listener never ran; a connect proves nothing either way.
            out.append(
                skip("reachability", subject, f"no listener: {target}'s probe failed (see its probe row)", scope="pair")
            )
            continue
        bound = {(r["port"]): r["ok"] for r in _bind_results(ctx.facts[target])}
        reach = {(r["addr"], r["port"]): r for r in facts.raw.get("reach", []) if r}
        lines, failed, not_tested = [], [], []
        for t in targets:
            if not bound.get(t.port, False):
                not_tested.append(t)
                lines.append(f"{t.addr}:{t.port} ({t.label}): not tested, port taken on {target}")
                continue
            r = reach.get((t.addr, t.port))
            if r is None or not r["ok"]:
                failed.append((t, r))
                why = r["error"] if r else "not attempted"
                lines.append(f"{t.addr}:{t.port} ({t.label}): {why}")
            else:
                lines.append(f"{t.addr}:{t.port} ({t.label}): connected")
        ev = Evidence(f"on {source}: connect to a temporary listener on {target}", tuple(lines[:8]))
        if failed:
            t, r = failed[0]
            out.append(
                fail(
                    "reachability",
                    subject,
                    f"{source} cannot reach {target} port {t.port} ({t.label}, {t.why}): "
                    f"{r['error'] if r else 'not attempted'}",
                    f"open TCP {t.port} from {source} to {t.addr} (security group / firewall) or fix {target}'s "
                    "address",
                    ev,
                    scope="pair",
                )
            )
        elif len(not_tested) == len(targets):
            out.append(skip("reachability", subject, f"all ports taken on {target} (see ports-free)", scope="pair"))
        else:
            out.append(
                ok("reachability", subject, f"{len(targets) - len(not_tested)} port(s) reachable", ev, scope="pair")
            )
    return out


CHECKS = [
    Check("ports-free", "host", "every HTTP, side-channel and router port is free on its host", check_ports_free),
    Check(
        "reachability",
        "pair",
        "decode -> prefill side channels (both ways for NIXL) and router -> instances connect",
        check_reachability,
    ),
]
