"""Accelerators: the GPUs (or CPU cores) each instance is given exist, are free, and TP fits."""
from __future__ import annotations

from kvpush.deploy.topology.topology import core_list_text, parse_core_list, rank_core_lists

from .context import Check, DoctorContext, hung
from .facts import HostFacts, Section
from .parsers import ParseError, parse_nvidia_apps, parse_nvidia_gpus
from .result import CheckResult, Evidence, fail, ok, skip, warn

BUSY_MEMORY_MIB = 1024  # more than a driver context: someone else holds this GPU


BF16_INSTRUCTIONS = frozenset({"avx512_bf16", "amx_bf16"})


def bf16_is_emulated(flags: list[str] | None) -> bool:
    """True for an x86 CPU (its flags name sse2) without bf16 instructions; False where unknown."""
    return flags is not None and "sse2" in flags and not BF16_INSTRUCTIONS & set(flags)


def _instances_on(ctx: DoctorContext, host: str):
    return [s for _, _, s in ctx.topo.instances() if s.host == host]


def _nvidia_smi_failure(check: str, host: str, section: Section | None) -> CheckResult | None:
    if section is None:
        return skip(check, host, "nvidia-smi was not run")
    if section.missing_tool or section.timed_out or section.exit_code != 0:
        why = ("nvidia-smi not found" if section.missing_tool else "nvidia-smi hung" if section.timed_out
               else "nvidia-smi failed (driver not loaded?)")
        return fail(
            check,
            host,
            why,
            f"install/load the NVIDIA driver on {host} (nvidia-smi must work) or use platform: cpu",
            section.evidence(),
        )
    return None


def check_accelerators(ctx: DoctorContext) -> list[CheckResult]:
    def decide_cpu(facts: HostFacts) -> CheckResult:
        have = set(facts.cpus)
        ev = Evidence("python: os.sched_getaffinity(0)", (f"usable cores: {_ranges(sorted(have))}",))
        lines = []
        for spec in _instances_on(ctx, facts.host):
            if spec.cpu_cores is None:
                lines.append(f"{spec.name}: no cpu_cores (all {len(have)} cores)")
                continue
            wanted = parse_core_list(spec.cpu_cores)
            absent = sorted(wanted - have)
            if absent:
                return fail(
                    "accelerators",
                    facts.host,
                    f"{spec.name} is given cores {_ranges(absent)} that {facts.host} lacks",
                    f"set {spec.name}'s cpu_cores within {_ranges(sorted(have))}",
                    ev,
                )
            ranks = rank_core_lists(spec.cpu_cores)
            lines.append(
                f"{spec.name}: cores {spec.cpu_cores}"
                if len(ranks) == 1
                else f"{spec.name}: TP{len(ranks)} on "
                + ", ".join(f"rank {r} cores {core_list_text(c)}" for r, c in enumerate(ranks))
            )
        summary = "CPU mode; " + "; ".join(lines)
        if ctx.topo.model.dtype == "bfloat16" and bf16_is_emulated(facts.cpu_flags):
            return warn(
                "accelerators",
                facts.host,
                f"{summary}; this CPU has no bf16 instructions (avx512_bf16, amx_bf16), "
                "so vLLM computes bf16 by converting",
                "set model.dtype: float32 (on an AVX2 CPU float32 prefilled "
                "2.5-5x faster; its KV takes twice the bytes per token)",
                ev,
                Evidence("/proc/cpuinfo: flags", ("avx512_bf16: absent", "amx_bf16: absent")),
            )
        return ok("accelerators", facts.host, summary, ev)

    def decide_cuda(facts: HostFacts) -> CheckResult:
        if stuck := hung("accelerators", facts, "nvidia_gpus"):
            return stuck
        section = facts.section("nvidia_gpus")
        failure = _nvidia_smi_failure("accelerators", facts.host, section)
        if failure:
            return failure
        assert section is not None, "_nvidia_smi_failure skips a host without the section"
        try:
            gpus = {g.index: g for g in parse_nvidia_gpus(section.stdout)}
        except ParseError as exc:
            return fail(
                "accelerators", facts.host, str(exc), "check the NVIDIA driver on this host", section.evidence()
            )
        ev = section.evidence([g.line for g in gpus.values()][:8])
        for spec in _instances_on(ctx, facts.host):
            absent = [d for d in spec.devices if d not in gpus]
            if absent:
                return fail(
                    "accelerators",
                    facts.host,
                    f"{spec.name} is given GPUs {absent}; {facts.host} has {len(gpus)} (0-{len(gpus) - 1})",
                    f"give {spec.name} devices that exist, or lower tensor_parallel_size",
                    ev,
                )
        used = sum(len(s.devices) for s in _instances_on(ctx, facts.host))
        return ok(
            "accelerators",
            facts.host,
            f"{len(gpus)} GPUs ({next(iter(gpus.values())).name if gpus else '-'}), {used} assigned",
            ev,
        )

    decide = decide_cpu if ctx.topo.platform == "cpu" else decide_cuda
    return ctx.each_host("accelerators", ctx.vllm_hosts(), decide)


def check_devices_free(ctx: DoctorContext) -> list[CheckResult]:
    if ctx.topo.platform == "cpu":
        return [
            skip("devices-free", h, "CPU mode: cores are time-shared, nothing holds them exclusively")
            for h in ctx.vllm_hosts()
        ]

    def decide(facts: HostFacts) -> CheckResult:
        if stuck := hung("devices-free", facts, "nvidia_gpus", "nvidia_apps"):
            return stuck
        gpus_section, apps_section = facts.section("nvidia_gpus"), facts.section("nvidia_apps")
        failure = _nvidia_smi_failure("devices-free", facts.host, gpus_section) or _nvidia_smi_failure(
            "devices-free", facts.host, apps_section
        )
        if failure:
            return failure
        assert gpus_section is not None and apps_section is not None, "_nvidia_smi_failure skips a missing section"
        try:
            gpus = {g.index: g for g in parse_nvidia_gpus(gpus_section.stdout)}
            apps = parse_nvidia_apps(apps_section.stdout)
        except ParseError as exc:
            return fail(
                "devices-free", facts.host, str(exc), "check the NVIDIA driver on this host", gpus_section.evidence()
            )
        wanted = {d: s.name for s in _instances_on(ctx, facts.host) for d in s.devices}
        busy_lines = []
        for index, name in sorted(wanted.items()):
            gpu = gpus.get(index)
            if gpu is None:
                continue
            holders = [a for a in apps if a.gpu_uuid == gpu.uuid]
            if holders:
                busy_lines += [f"GPU {index} ({name}): pid {a.pid} {a.name} uses {a.used_mib} MiB" for a in holders]
            elif gpu.memory_used_mib > BUSY_MEMORY_MIB:
                busy_lines.append(f"GPU {index} ({name}): {gpu.memory_used_mib} MiB already used")
        if busy_lines:
            return fail("devices-free", facts.host, f"{len(busy_lines)} assigned GPU(s) in use by other processes",
                        f"stop those processes on {facts.host} (nvidia-smi shows them) or assign other devices",
                        Evidence(apps_section.command, tuple(busy_lines[:6]), apps_section.exit_code))
        return ok(
            "devices-free",
            facts.host,
            f"{len(wanted)} assigned GPUs idle",
            apps_section.evidence(["(no compute processes)"] if not apps else None),
        )

    return ctx.each_host("devices-free", ctx.vllm_hosts(), decide)


def _ranges(values: list[int]) -> str:
    out, start = [], None
    for i, v in enumerate(values):
        if start is None:
            start = v
        if i + 1 == len(values) or values[i + 1] != v + 1:
            out.append(f"{start}" if start == v else f"{start}-{v}")
            start = None
    return ",".join(out) or "none"


CHECKS = [
    Check("accelerators", "host", "assigned GPUs exist (nvidia-smi) or CPU cores exist; TP fits", check_accelerators),
    Check("devices-free", "host", "no other process uses the assigned GPUs", check_devices_free),
]
