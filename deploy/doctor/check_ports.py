"""Ports: every configured port is free on its host, and the hosts that must talk can connect."""
from __future__ import annotations

from collections import defaultdict

from .context import Check, DoctorContext
from .facts import HostFacts
from .result import CheckResult, Evidence, fail, ok, pair_subject, skip

PROBE_COMMAND = "python facts_probe.py: bind(addr, port) then listen; connect from peers"


def _bind_results(facts: HostFacts) -> list[dict]:
    return facts.raw.get("bind", [])


def check_ports_free(ctx: DoctorContext) -> list[CheckResult]:
    claimed_hosts = sorted({c.host for c in ctx.claims})

    def decide(facts: HostFacts) -> CheckResult:
        results = _bind_results(facts)
        taken = [r for r in results if not r["ok"]]
        lines = [f"{r['addr']}:{r['port']} ({r['label']}): " + ("free" if r["ok"] else f"{r['error']} (errno {r['errno']})") for r in results]
        ev = Evidence(PROBE_COMMAND, tuple((lines if not taken else [ln for ln in lines if not ln.endswith("free")])[:8]))
        if taken:
            first = taken[0]
            more = f" (+{len(taken) - 1} more)" if len(taken) > 1 else ""
            return fail("ports-free", facts.host,
                        f"port {first['port']} on host {facts.host} ({first['label']}) is taken: {first['error']}{more}",
                        f"stop what listens on {first['addr']}:{first['port']} on {facts.host} (ss -ltnp 'sport = :{first['port']}') "
                        "or choose another port in the topology", ev)
        return ok("ports-free", facts.host, f"{len(results)} port(s) free: " + ", ".join(str(r["port"]) for r in results[:6]), ev)

    if not claimed_hosts:
        return [skip("ports-free", "(all)", "every process is already running")]
    return ctx.each_host("ports-free", claimed_hosts, decide)


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
            out.append(skip("reachability", subject, f"no listener: {target}'s probe failed (see its probe row)", scope="pair"))
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
            out.append(fail("reachability", subject,
                            f"{source} cannot reach {target} port {t.port} ({t.label}, {t.why}): {r['error'] if r else 'not attempted'}",
                            f"open TCP {t.port} from {source} to {t.addr} (security group / firewall) or fix {target}'s address",
                            ev, scope="pair"))
        elif len(not_tested) == len(targets):
            out.append(skip("reachability", subject, f"all ports taken on {target} (see ports-free)", scope="pair"))
        else:
            out.append(ok("reachability", subject, f"{len(targets) - len(not_tested)} port(s) reachable", ev, scope="pair"))
    return out


CHECKS = [
    Check("ports-free", "host", "every HTTP, side-channel and router port is free on its host", check_ports_free),
    Check("reachability", "pair", "decode <-> prefill side channels and router -> instances connect", check_reachability),
]
