"""NIXL: the configured backend really loads on each host (a listed plugin is not a loaded one)."""
from __future__ import annotations

from .context import Check, DoctorContext
from .facts import HostFacts
from .result import CheckResult, Evidence, fail, ok, skip

NEEDED_MEM = {"cpu": "DRAM_SEG", "cuda": "VRAM_SEG"}


def check_nixl_backend(ctx: DoctorContext) -> list[CheckResult]:
    if not ctx.disaggregated:
        return [skip("nixl-backend", h, "colocated: no NIXL transfers") for h in ctx.vllm_hosts()]
    backend = ctx.topo.connector.backend
    needed = NEEDED_MEM[ctx.topo.platform]

    def decide(facts: HostFacts) -> CheckResult:
        if not facts.nixl:
            return skip("nixl-backend", facts.host, "backend probe not run")
        results = []
        for probe in facts.nixl:
            lines = []
            if probe.shared_from:
                lines.append(f"same machine, interpreter and env as {probe.shared_from}: its result applies")
            lines.append(f"plugins found: {', '.join(probe.plugins) or '-'}")
            lines.append(
                f"create_backend({backend}): "
                + ("ok, mem types " + ", ".join(probe.mem_types) if probe.created else probe.error or "failed")
            )
            lines += list(probe.stderr_tail)
            ev = Evidence(probe.command, tuple(lines), probe.exit_code)
            if not probe.created:
                listed = backend in probe.plugins
                why = f"{backend} plugin is listed but does not load" if listed else f"no {backend} plugin"
                fix = ("install a libfabric with the efa provider that NIXL was built for (aws-efa-installer); "
                       "check the plugin's missing symbols with ldd" if backend == "LIBFABRIC" else
                       "reinstall nixl built for this host's CUDA (nixl-cu12 or nixl-cu13)")
                results.append(fail("nixl-backend", facts.host, f"{why}: {probe.error}", fix, ev))
            elif needed not in probe.mem_types:
                results.append(
                    fail(
                        "nixl-backend",
                        facts.host,
                        f"{backend} cannot register {needed} (has {', '.join(probe.mem_types)})",
                        "use a NIXL build with CUDA support on GPU hosts",
                        ev,
                    )
                )
            else:
                results.append(
                    ok("nixl-backend", facts.host, f"{backend} created; memory {', '.join(probe.mem_types)}", ev)
                )
        return max(results, key=lambda r: ["ok", "skip", "warn", "fail"].index(r.status.value))

    return ctx.each_host("nixl-backend", ctx.vllm_hosts(), decide)


CHECKS = [
    Check(
        "nixl-backend",
        "host",
        "the configured NIXL backend is creatable (subprocess) with the needed memory type",
        check_nixl_backend,
    )
]
