"""Host limits: locked memory, open files, free disk and memory, clock skew between hosts."""
from __future__ import annotations

from .context import Check, DoctorContext, hung
from .facts import HostFacts
from .parsers import ParseError, parse_df, parse_meminfo, parse_ulimit
from .result import TOPOLOGY_SUBJECT, CheckResult, Evidence, fail, ok, skip, warn

GIB = 1024**3
OPEN_FILES_WANTED = 65535  # vLLM raises its soft limit to this when the hard limit allows
VLLM_CPU_RSS_GIB = 3  # measured: one CPU vLLM server without its KV cache
DEFAULT_CPU_KV_GIB = 4  # vLLM's default VLLM_CPU_KVCACHE_SPACE
GPU_HOST_RAM_GIB = 8  # per instance: weights staging, tokenizer, pinned buffers
DISK_FAIL_GIB, DISK_WARN_GIB = 1, 5
SKEW_WARN_S = 1.0


def _unparsable(check: str, host: str, section, exc: Exception) -> CheckResult:
    return fail(
        check, host, f"cannot read: {exc}", "run the command by hand on the host to see why", section.evidence()
    )


def check_memlock(ctx: DoctorContext) -> list[CheckResult]:
    def decide(facts: HostFacts) -> CheckResult:
        section = facts.asked("ulimit_l")
        try:
            limit = parse_ulimit(section.stdout)
        except ParseError as exc:
            return _unparsable("memlock", facts.host, section, exc)
        shown = "unlimited" if limit is None else f"{limit} KiB"
        ev = section.evidence()
        if limit is None:
            return ok("memlock", facts.host, "locked memory unlimited", ev)
        if ctx.rdma:
            return fail(
                "memlock",
                facts.host,
                f"locked memory limited to {shown}: RDMA registration of the KV cache fails",
                f"set 'memlock unlimited' for the user in /etc/security/limits.conf on {facts.host} (or "
                "LimitMEMLOCK=infinity) and log in again",
                ev,
            )
        return ok("memlock", facts.host, f"{shown} (fine: no RDMA NIC registers the KV cache on this platform)", ev)

    return ctx.each_host("memlock", ctx.vllm_hosts(), decide)


def check_open_files(ctx: DoctorContext) -> list[CheckResult]:
    def decide(facts: HostFacts) -> CheckResult:
        soft_s, hard_s = facts.asked("ulimit_n"), facts.asked("ulimit_hn")
        try:
            soft, hard = parse_ulimit(soft_s.stdout), parse_ulimit(hard_s.stdout)
        except ParseError as exc:
            return _unparsable("open-files", facts.host, soft_s, exc)
        ev = Evidence("ulimit -Sn; ulimit -Hn", (f"soft {soft or 'unlimited'}", f"hard {hard or 'unlimited'}"))
        if hard is not None and hard < OPEN_FILES_WANTED:
            return warn(
                "open-files",
                facts.host,
                f"open-files hard limit {hard} < {OPEN_FILES_WANTED}: many concurrent requests may hit EMFILE",
                f"raise 'nofile' to {OPEN_FILES_WANTED}+ in /etc/security/limits.conf on {facts.host}",
                ev,
            )
        return ok("open-files", facts.host, f"soft {soft or 'unlimited'}, hard {hard or 'unlimited'}", ev)

    return ctx.each_host("open-files", ctx.probed_hosts(), decide)


def check_disk(ctx: DoctorContext) -> list[CheckResult]:
    def decide(facts: HostFacts) -> CheckResult:
        if stuck := hung("disk", facts, "df"):
            return stuck
        section = facts.asked("df")
        try:
            rows = parse_df(section.stdout)
        except ParseError as exc:
            return _unparsable("disk", facts.host, section, exc)
        lowest = min(rows, key=lambda r: r.available_bytes)
        free_gib = lowest.available_bytes / GIB
        ev = section.evidence([r.line for r in rows])
        if free_gib < DISK_FAIL_GIB:
            return fail(
                "disk",
                facts.host,
                f"{free_gib:.2f} GiB free on {lowest.mount}",
                f"free space on {lowest.mount} ({facts.host}): logs and the model live there",
                ev,
            )
        if free_gib < DISK_WARN_GIB:
            return warn(
                "disk",
                facts.host,
                f"only {free_gib:.1f} GiB free on {lowest.mount}",
                f"free space on {lowest.mount} ({facts.host})",
                ev,
            )
        return ok("disk", facts.host, f"{free_gib:.0f} GiB free on {lowest.mount}", ev)

    return ctx.each_host("disk", ctx.probed_hosts(), decide)


def memory_needed_gib(ctx: DoctorContext, host: str) -> tuple[float, list[str]]:
    """What the instances on `host` that are to start need; those already running hold theirs
    (it is no longer in MemAvailable), so counting them again would refuse to revive one of them."""
    total: float = 0
    parts: list[str] = []
    for _, _, spec in ctx.topo.instances():
        if spec.host != host or spec.name in ctx.running:
            continue
        if ctx.topo.platform == "cpu":
            kv = (
                spec.kv_cache_gib or DEFAULT_CPU_KV_GIB
            ) * spec.tensor_parallel_size  # every rank allocates kv_cache_gib
            total += kv + VLLM_CPU_RSS_GIB
            parts.append(f"{spec.name}: {kv:g} GiB KV + {VLLM_CPU_RSS_GIB} GiB process")
        else:
            total += GPU_HOST_RAM_GIB
            parts.append(f"{spec.name}: ~{GPU_HOST_RAM_GIB} GiB host RAM")
    return total, parts


def check_memory(ctx: DoctorContext) -> list[CheckResult]:
    def decide(facts: HostFacts) -> CheckResult:
        section = facts.asked("meminfo")
        try:
            info = parse_meminfo(section.stdout)
        except ParseError as exc:
            return _unparsable("memory", facts.host, section, exc)
        available = info.get("MemAvailable", 0) / GIB
        needed, parts = memory_needed_gib(ctx, facts.host)
        ev = Evidence(
            section.command,
            tuple(section.stdout.strip().splitlines()) + tuple(f"needs {p}" for p in parts),
            section.exit_code,
        )
        if needed > available:
            return fail("memory", facts.host, f"needs ~{needed:g} GiB, {available:.1f} GiB available",
                        "lower kv_cache_gib, move an instance to another host, or free memory", ev)
        if needed > 0.9 * available:
            return warn(
                "memory",
                facts.host,
                f"needs ~{needed:g} GiB of {available:.1f} GiB available (tight)",
                "lower kv_cache_gib or free memory",
                ev,
            )
        return ok("memory", facts.host, f"needs ~{needed:g} GiB, {available:.1f} GiB available", ev)

    return ctx.each_host("memory", ctx.vllm_hosts(), decide)


def skew_interval(facts: HostFacts) -> tuple[float, float] | None:
    """Bounds on (host clock - this clock): `date` ran between sending and receiving the probe."""
    section = facts.section("date")
    if section is None:
        return None
    try:
        remote = float(section.stdout.strip())
    except ValueError:
        return None
    return remote - facts.received_at, remote - facts.sent_at


def check_clock_skew(ctx: DoctorContext) -> list[CheckResult]:
    probed = ctx.probed_hosts()
    hosts = [h for h in probed if h in ctx.facts]
    if len(probed) < 2:
        return [skip("clock-skew", TOPOLOGY_SUBJECT, "one host: no skew", scope="topology")]
    if len(hosts) < 2:
        return [
            skip(
                "clock-skew",
                TOPOLOGY_SUBJECT,
                f"{len(probed)} hosts, clocks read on {', '.join(hosts) or 'none'}: "
                "nothing to compare (see the probe rows)",
                scope="topology",
            )
        ]
    lines, skewed = [], []
    for h in hosts:
        bounds = skew_interval(ctx.facts[h])
        if bounds is None:
            lines.append(f"{h}: date printed nothing usable")
            continue
        lo, hi = bounds
        lines.append(f"{h}: {lo:+.3f} .. {hi:+.3f} s")
        if lo > SKEW_WARN_S or hi < -SKEW_WARN_S:  # certainly off, whatever the command latency
            skewed.append(h)
    ev = Evidence("date +%s.%N on each host, bracketed by this machine's clock", tuple(lines[:10]))
    if skewed:
        return [
            warn(
                "clock-skew",
                TOPOLOGY_SUBJECT,
                f"clocks off by more than {SKEW_WARN_S:g} s on {', '.join(skewed)}",
                "enable NTP/chrony on those hosts (timeouts and log timelines compare clocks)",
                ev,
                scope="topology",
            )
        ]
    return [
        ok(
            "clock-skew",
            TOPOLOGY_SUBJECT,
            f"{len(hosts)} hosts within {SKEW_WARN_S:g} s of this clock",
            ev,
            scope="topology",
        )
    ]


CHECKS = [
    Check("memlock", "host", "locked-memory limit (unlimited for RDMA)", check_memlock),
    Check("open-files", "host", "open-files limit", check_open_files),
    Check("disk", "host", "free disk for logs and the model", check_disk),
    Check("memory", "host", "free memory for the instances and their KV cache", check_memory),
    Check("clock-skew", "topology", "clocks agree between hosts", check_clock_skew),
]
