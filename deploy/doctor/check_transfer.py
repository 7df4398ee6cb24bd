"""Transfer proof (--transfer): a real NIXL WRITE between each prefill/decode host pair."""
from __future__ import annotations

from .context import Check, DoctorContext, TransferOutcome
from .result import CheckResult, Evidence, fail, ok, pair_subject, skip, warn

# Below this a GPU pair is not using RDMA or CUDA IPC: it moves KV like UCX over TCP does.
GPU_MIN_GBPS = 5.0


def transfer_pairs(ctx: DoctorContext) -> list[tuple[str, str]]:
    """(prefill host, decode host) pairs, each once."""
    return sorted({(p.resolved_host, d.resolved_host) for p in ctx.topo.prefill for d in ctx.topo.decode})


def decide_transfer(outcome: TransferOutcome, platform: str, backend: str) -> CheckResult:
    subject = pair_subject(outcome.source, outcome.target)
    ev = Evidence(outcome.command, outcome.evidence)
    if not outcome.ok:
        return fail("transfer", subject, f"NIXL WRITE {outcome.source} -> {outcome.target} failed: {outcome.error}",
                    "fix the failing checks above (nixl-backend, reachability, memlock), then rerun with --transfer",
                    ev, scope="pair")
    if not outcome.byte_exact:
        return fail("transfer", subject, f"WRITE completed but the bytes differ: {outcome.error}",
                    "report this with the evidence: the NIXL/UCX stack corrupts data on this path", ev, scope="pair")
    rate = f"{outcome.nbytes / 2**20:.0f} MiB byte-exact at {outcome.gbps:.2f} GB/s"
    data = {"gbps": outcome.gbps, "seconds": outcome.seconds, "bytes": outcome.nbytes}
    if platform == "cuda" and outcome.gbps is not None and outcome.gbps < GPU_MIN_GBPS:
        return warn("transfer", subject, f"{rate}: below {GPU_MIN_GBPS:g} GB/s, likely TCP instead of RDMA",
                    "check ucx-env / ucx-on-efa / gpudirect-rdma; on EFA use connector.backend: LIBFABRIC", ev,
                    scope="pair", data=data)
    return ok("transfer", subject, f"{rate} ({backend})", ev, scope="pair", data=data)


def check_transfer(ctx: DoctorContext) -> list[CheckResult]:
    pairs = transfer_pairs(ctx) if ctx.disaggregated else []
    if ctx.transfers is None:
        return [
            skip("transfer", pair_subject(s, t), "pass --transfer to move real bytes", scope="pair") for s, t in pairs
        ]
    out = []
    for s, t in pairs:
        outcome = ctx.transfers.get((s, t))
        if outcome is None:
            out.append(
                skip(
                    "transfer",
                    pair_subject(s, t),
                    "not attempted: a host's probe failed or its port is taken",
                    scope="pair",
                )
            )
        else:
            out.append(decide_transfer(outcome, ctx.topo.platform, ctx.topo.connector.backend))
    return out


CHECKS = [
    Check(
        "transfer",
        "pair",
        "a real NIXL WRITE prefill -> decode, byte-exact, with bandwidth (--transfer)",
        check_transfer,
    )
]
