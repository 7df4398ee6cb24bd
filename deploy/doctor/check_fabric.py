"""Network fabric: EFA where LIBFABRIC is asked for, GPUDirect RDMA, GPU<->NIC affinity, UCX env."""
from __future__ import annotations

from .context import Check, DoctorContext, hung
from .facts import HostFacts
from .parsers import (
    LINK_RANK,
    ParseError,
    fi_info_error,
    parse_fi_info,
    parse_ls_lines,
    parse_nvidia_topo,
    parse_proc_modules,
    parse_ucx_tls,
)
from .result import CheckResult, Evidence, fail, ok, skip, warn

EFA_REMEDY = ("run on EFA-enabled instances with the EFA driver and aws-efa-installer's libfabric (fi_info -p efa "
              "must list the provider), or set connector.backend: UCX")


def efa_devices(facts: HostFacts) -> tuple[bool, list[Evidence]]:
    """Whether the host has an EFA device: libfabric lists the efa provider, or (fi_info not run
    or not installed) /sys/class/infiniband has EFA-named devices (rdmapXsY)."""
    evidence = []
    fi = facts.section("fi_info_efa")
    if fi is not None:
        providers = [p for p in parse_fi_info(fi.stdout) if p.provider.startswith("efa")]
        evidence.append(fi.evidence(list(providers[0].lines) if providers else None))
        if fi.exit_code == 0 and providers:
            return True, evidence
    ib = facts.section("infiniband")
    if ib is not None:
        names = parse_ls_lines(ib.stdout) if ib.exit_code == 0 else []
        evidence.append(ib.evidence())
        # Without a usable fi_info, EFA devices are recognised by their sysfs names.
        if (fi is None or fi.missing_tool) and any(n.startswith(("rdmap", "efa")) for n in names):
            return True, evidence
    return False, evidence


def check_efa(ctx: DoctorContext) -> list[CheckResult]:
    if ctx.topo.connector.backend != "LIBFABRIC":
        return [skip("efa", h, f"connector.backend is {ctx.topo.connector.backend}; EFA is needed only for LIBFABRIC")
                for h in ctx.vllm_hosts()]

    def decide(facts: HostFacts) -> CheckResult:
        if stuck := hung("efa", facts, "fi_info_efa", "ibv_devices"):
            return stuck
        fi = facts.section("fi_info_efa")
        present, evidence = efa_devices(facts)
        if fi is not None and fi.missing_tool:
            return fail(
                "efa", facts.host, "fi_info not found: libfabric's tools are not installed", EFA_REMEDY, *evidence
            )
        if not present:
            code = fi_info_error(fi.stdout, fi.stderr) if fi else None
            why = (
                f"no EFA provider ({code}: no EFA device or driver)" if code else "fi_info -p efa lists no efa provider"
            )
            return fail("efa", facts.host, why, EFA_REMEDY, *evidence)
        ib = facts.section("infiniband")
        if ib is not None and not parse_ls_lines(ib.stdout):
            return fail("efa", facts.host, "libfabric lists efa but /sys/class/infiniband is empty",
                        "load the efa kernel module (modprobe efa) and check the ENIs", *evidence)
        provider = ctx.topo.env.get("FI_PROVIDER")
        if provider and provider != "efa":
            return warn(
                "efa",
                facts.host,
                f"EFA present but FI_PROVIDER={provider}",
                "set env FI_PROVIDER: efa in the topology",
                *evidence,
            )
        devices = parse_ls_lines(ib.stdout) if ib else []
        return ok("efa", facts.host, f"efa provider; {len(devices)} device(s) {', '.join(devices[:4])}", *evidence)

    return ctx.each_host("efa", ctx.vllm_hosts(), decide)


def check_ucx_on_efa(ctx: DoctorContext) -> list[CheckResult]:
    if ctx.topo.connector.backend != "UCX" or not ctx.disaggregated:
        return [skip("ucx-on-efa", h, "the connector does not use UCX") for h in ctx.vllm_hosts()]

    def decide(facts: HostFacts) -> CheckResult:
        if stuck := hung("ucx-on-efa", facts, "fi_info_efa"):
            return stuck
        present, evidence = efa_devices(facts)
        if present:
            return warn("ucx-on-efa", facts.host, "EFA host but NIXL uses UCX: transfers fall back to TCP",
                        "set connector.backend: LIBFABRIC to use EFA", *evidence)
        return ok("ucx-on-efa", facts.host, "no EFA device; UCX is the right backend here", *evidence)

    return ctx.each_host("ucx-on-efa", ctx.vllm_hosts(), decide)


def check_gpudirect(ctx: DoctorContext) -> list[CheckResult]:
    if ctx.topo.platform != "cuda":
        return [skip("gpudirect-rdma", h, "platform cpu: KV lives in host memory") for h in ctx.vllm_hosts()]
    if len(set(ctx.role_hosts("prefill")) | set(ctx.role_hosts("decode"))) < 2:
        return [
            skip("gpudirect-rdma", h, "prefill and decode share one host: no NIC in the path") for h in ctx.vllm_hosts()
        ]

    def decide(facts: HostFacts) -> CheckResult:
        section = facts.section("kernel_modules")
        modules = parse_proc_modules(section.stdout) if section else set()
        ev = section.evidence() if section else Evidence("/proc/modules", ("(not read)",))
        if modules & {"nvidia_peermem", "nv_peer_mem"}:
            return ok("gpudirect-rdma", facts.host, "nvidia_peermem loaded: the NIC can read/write GPU memory", ev)
        return warn(
            "gpudirect-rdma",
            facts.host,
            "nvidia_peermem not loaded: GPU memory may be staged through host memory",
            "sudo modprobe nvidia_peermem (or confirm the driver's dma-buf path with FI_EFA_USE_DEVICE_RDMA=1)",
            ev,
        )

    return ctx.each_host("gpudirect-rdma", ctx.vllm_hosts(), decide)


def check_gpu_nic_affinity(ctx: DoctorContext) -> list[CheckResult]:
    if ctx.topo.platform != "cuda":
        return [skip("gpu-nic-affinity", h, "platform cpu: no GPUs") for h in ctx.vllm_hosts()]

    def decide(facts: HostFacts) -> CheckResult:
        if stuck := hung("gpu-nic-affinity", facts, "nvidia_topo"):
            return stuck
        section = facts.section("nvidia_topo")
        if section is None or section.exit_code != 0:
            return fail("gpu-nic-affinity", facts.host, "nvidia-smi topo -m failed", "install/load the NVIDIA driver",
                        *( [section.evidence()] if section else []))
        try:
            matrix = parse_nvidia_topo(section.stdout)
        except ParseError as exc:
            return fail("gpu-nic-affinity", facts.host, str(exc), "check nvidia-smi on this host", section.evidence())
        gpus = sorted({d for _, _, s in ctx.topo.instances() if s.host == facts.host for d in s.devices})
        if not matrix.nics():
            return warn("gpu-nic-affinity", facts.host, "no NIC in nvidia-smi topo -m: KV crosses hosts without RDMA",
                        "attach RDMA NICs (EFA) or keep prefill and decode on one host", section.evidence())
        lines, far = [], []
        for g in gpus:
            nearest = matrix.nearest_nic(f"GPU{g}")
            if nearest is None:
                continue
            nic, link = nearest
            name = matrix.nic_names.get(nic, nic)
            lines.append(f"GPU{g} -> {nic} ({name}) {link}, NUMA {matrix.numa_affinity.get(f'GPU{g}', '?')}")
            if LINK_RANK.get(link, 9) >= LINK_RANK["PHB"]:
                far.append(f"GPU{g} ({link})")
        ev = Evidence(section.command, tuple(lines[:8]), section.exit_code)
        if far:
            return warn(
                "gpu-nic-affinity",
                facts.host,
                f"no NIC behind the same PCIe switch for {', '.join(far)}",
                "give instances GPUs that share a PCIe switch with an EFA NIC (PIX/PXB in nvidia-smi topo -m)",
                ev,
            )
        return ok("gpu-nic-affinity", facts.host, f"{len(gpus)} GPUs each share a PCIe switch with a NIC", ev)

    return ctx.each_host("gpu-nic-affinity", ctx.vllm_hosts(), decide)


def ucx_tls_verdict(value: str | None, platform: str) -> tuple[str, str, str | None]:
    """(status, what, remedy) for an effective UCX_TLS; status is ok, warn or fail."""
    tls = parse_ucx_tls(value)
    if tls is None:
        return "ok", "UCX_TLS unset (UCX picks the transports)", None
    if not tls.names:
        return "fail", "UCX_TLS is empty: NIXL refuses the UCX backend", "unset UCX_TLS or list transports"
    if platform == "cuda":
        if not tls.allows("cuda_copy"):
            return (
                "fail",
                f"UCX_TLS={value} has no cuda_copy: NIXL refuses UCX on a GPU host",
                "add cuda_copy to UCX_TLS (or unset it)",
            )
        if not tls.allows("tcp"):
            return (
                "fail",
                f"UCX_TLS={value} has no tcp: endpoint creation fails without an active-message transport",
                "keep tcp in UCX_TLS",
            )
        if not tls.allows("cuda_ipc"):
            return (
                "warn",
                f"UCX_TLS={value} has no cuda_ipc: GPU KV goes through host memory (tcp-only is the slow path)",
                "add cuda_ipc to UCX_TLS",
            )
        return "ok", f"UCX_TLS={value}", None
    if not tls.negated and tls.names <= {"tcp", "self"}:
        return (
            "warn",
            f"UCX_TLS={value}: data over TCP sockets (1-3 GB/s vs 3-12 with cma/shm)",
            "unset UCX_TLS or add shm/cma",
        )
    if not tls.allows("tcp"):
        return (
            "warn",
            f"UCX_TLS={value} without tcp fails unless NIXL sets ucx_error_handling_mode=none",
            "keep tcp in UCX_TLS",
        )
    return "ok", f"UCX_TLS={value}", None


def check_ucx_env(ctx: DoctorContext) -> list[CheckResult]:
    if ctx.topo.connector.backend != "UCX" or not ctx.disaggregated:
        return [skip("ucx-env", h, "the connector does not use UCX") for h in ctx.vllm_hosts()]

    def decide(facts: HostFacts) -> CheckResult:
        worst, lines, remedy, what_worst = "ok", [], "", ""
        order = {"ok": 0, "warn": 1, "fail": 2}
        for proc in ctx.vllm_processes(facts.host):
            source = "topology" if "UCX_TLS" in proc.env else "host login env" if "UCX_TLS" in facts.env else "unset"
            value = proc.env.get("UCX_TLS", facts.env.get("UCX_TLS"))
            status, what, fix = ucx_tls_verdict(value, ctx.topo.platform)
            lines.append(f"{proc.name}: {what} [{source}]")
            if order[status] > order[worst]:
                worst, remedy, what_worst = status, fix or "", what  # fix: None only when ok
        ev = Evidence("effective UCX_TLS = host env overlaid with the plan's process env", tuple(lines))
        if worst == "fail":
            return fail("ucx-env", facts.host, what_worst, remedy, ev)
        if worst == "warn":
            return warn("ucx-env", facts.host, what_worst, remedy, ev)
        whats = {ln.split(": ", 1)[1].rsplit(" [", 1)[0] for ln in lines}
        return ok("ucx-env", facts.host, whats.pop() if len(whats) == 1 else f"{len(lines)} processes fine", ev)

    return ctx.each_host("ucx-env", ctx.vllm_hosts(), decide)


CHECKS = [
    Check(
        "efa",
        "host",
        "EFA present where connector.backend is LIBFABRIC (fi_info -p efa, /sys/class/infiniband)",
        check_efa,
    ),
    Check("ucx-on-efa", "host", "NIXL over UCX on an EFA host falls back to TCP", check_ucx_on_efa),
    Check("gpudirect-rdma", "host", "the NIC can reach GPU memory (nvidia_peermem)", check_gpudirect),
    Check(
        "gpu-nic-affinity",
        "host",
        "each assigned GPU shares a PCIe switch with a NIC (nvidia-smi topo -m)",
        check_gpu_nic_affinity,
    ),
    Check("ucx-env", "host", "UCX_TLS keeps the fast transports (cuda_copy, cuda_ipc, not tcp-only)", check_ucx_env),
]
