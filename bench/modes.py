"""Which deployments a bench runs: one topology per connector mode, derived from the user's (pure)."""
from __future__ import annotations

import hashlib
import json
import math
from pathlib import PurePosixPath
from typing import get_args

from kvpush.common.errors import UsageError
from kvpush.deploy.topology.topology import (
    ConnectorType,
    TinyModelSpec,
    Topology,
    TracingSpec,
    listening_side_channel_ports,
    side_channel_ports,
)
from kvpush.router.config import Policy

# A bench mode is a connector type, or a `-stock` control: vLLM's connector exactly as vLLM ships it
# (connector.stock_vllm), beside the variant kvpush tunes for shared CPU cores; either may name the
# router's policy after a `+` (kvpush+least-loaded), else the topology's applies.
STOCK_SUFFIX = "-stock"
POLICY_SEPARATOR = "+"
POLICIES: tuple[str, ...] = get_args(Policy)
MODES: tuple[str, ...] = ("kvpush", "nixl-push", "nixl-pull", "colocated", "nixl-push-stock", "nixl-pull-stock")
DEFAULT_MODES: tuple[str, ...] = ("kvpush", "nixl-push", "nixl-pull", "colocated")
DEFAULT_BASELINE = "nixl-pull"
MODE_LABELS = {
    "nixl-push": "nixl-push (kvpush-tuned)", "nixl-pull": "nixl-pull (kvpush-tuned)",
    "nixl-push-stock": "nixl-push (stock vLLM)", "nixl-pull-stock": "nixl-pull (stock vLLM)",
}

# 8 layers x 8 KV heads x 128 in bf16 is 32 KiB of KV per token, so a 3,000-token prompt moves 96 MiB
# and transfer is a visible share of TTFT.
KV_HEAVY_SPEC = TinyModelSpec(seed=0, layers=8, hidden_size=256, heads=8, kv_heads=8, head_dim=128,
                              max_position_embeddings=8192)
KV_HEAVY_MAX_MODEL_LEN = 4096
KV_HEAVY_MODEL_DIR = "tiny-llama-kv-heavy"
SPAN_EXPORT_DELAY_MS = 200  # how often each instance sends its finished requests' spans while benched
KV_DTYPE_BYTES = 2  # bf16
MODE_PORT_STRIDE = 100  # ports per mode when every mode's deployment is up at once
ROUNDS_NEED_PORT_BASE = ("--rounds keeps every mode's deployment up at once, so each needs ports of its own: "
                         "give --port-base, e.g. --port-base 15200")


def kv_bytes_per_token(spec: TinyModelSpec) -> int:
    """K and V for every layer and KV head, in bf16."""
    return 2 * spec.layers * spec.kv_heads * spec.head_dim * KV_DTYPE_BYTES


def policy_of(mode: str) -> str | None:
    """The router policy a bench mode names (kvpush+least-loaded), or None: the topology's."""
    _, _, policy = mode.partition(POLICY_SEPARATOR)
    return policy or None


def connector_of(mode: str) -> tuple[ConnectorType, bool]:
    """A bench mode's connector type, and whether it runs vLLM's connector stock."""
    kind = mode.partition(POLICY_SEPARATOR)[0]
    stock = kind.endswith(STOCK_SUFFIX)
    return kind.removesuffix(STOCK_SUFFIX), stock  # type: ignore[return-value]


def mode_label(mode: str, platform: str = "cpu") -> str:
    """How tables name a mode: on a CPU platform the tuned and stock NIXL variants differ; on GPU the
    plain modes are stock too (the tuning applies to CPU platforms only)."""
    kind, policy = mode.partition(POLICY_SEPARATOR)[0], policy_of(mode)
    label = kind if platform != "cpu" and kind in ("nixl-push", "nixl-pull") else MODE_LABELS.get(kind, kind)
    return f"{label}, {policy} router" if policy else label


def parse_modes(text: str) -> list[str]:
    modes = [m.strip() for m in text.split(",") if m.strip()]
    if not modes:
        raise UsageError("--modes is empty; give e.g. --modes kvpush,nixl-push,nixl-pull,colocated")
    for m in modes:
        kind, policy = m.partition(POLICY_SEPARATOR)[0], policy_of(m)
        if kind not in MODES:
            raise UsageError(f"--modes: unknown mode '{m}'; choose from {','.join(MODES)}")
        if policy is not None and policy not in POLICIES:
            raise UsageError(f"--modes: unknown router policy '{policy}' in '{m}'; after '{POLICY_SEPARATOR}' choose "
                             f"from {','.join(POLICIES)}")
    if len(set(modes)) != len(modes):
        raise UsageError(f"--modes lists a mode twice ({text}); give each mode once")
    return modes


def parse_rates(text: str) -> list[float]:
    rates = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            rate = float(part)
        except ValueError:
            raise UsageError(f"--rates: '{part}' is not a number; write e.g. --rates 0.5,1,2,4") from None
        if not (rate > 0 and math.isfinite(rate)):
            raise UsageError(f"--rates: {part} must be a positive, finite request rate (req/s)")
        rates.append(rate)
    if not rates:
        raise UsageError("--rates is empty; give e.g. --rates 0.5,1,2,4")
    return sorted(set(rates))


def kv_heavy_model(topo: Topology) -> Topology:
    """The same deployment serving the KV-heavy tiny model, in its own directory beside the configured one."""
    path = str(PurePosixPath(topo.model.path).parent / KV_HEAVY_MODEL_DIR)
    max_len = max(topo.model.max_model_len or 0, KV_HEAVY_MAX_MODEL_LEN)
    model = topo.model.model_copy(update={"path": path, "tiny": KV_HEAVY_SPEC, "max_model_len": max_len,
                                          "served_name": topo.model.served_name})
    return topo.model_copy(update={"model": model})


def renumber_ports(topo: Topology, port_base: int) -> Topology:
    """Router at port_base, then each instance's HTTP port, then side-channel ports, consecutively."""
    next_port = port_base + 1
    router = topo.router.model_copy(update={"port": port_base})
    renumbered = {}
    for role in ("prefill", "decode"):
        specs = []
        for spec in getattr(topo, role):
            specs.append(spec.model_copy(update={"http_port": next_port}))
            next_port += 1
        renumbered[role] = specs
    for role in ("prefill", "decode"):
        for i, spec in enumerate(renumbered[role]):
            renumbered[role][i] = spec.model_copy(update={"side_channel_port": next_port})
            next_port += len(side_channel_ports(renumbered[role][i]))
    if next_port > 65536:
        raise UsageError(
            f"--port-base {port_base} leaves no room for {next_port - port_base} ports; choose a lower one"
        )
    return topo.model_copy(update={"router": router, **renumbered})


def ports_of(topo: Topology) -> list[int]:
    """Every port a deployment listens on: router, instances' HTTP, side channels."""
    ports = [topo.router.port]
    for role, _, spec in topo.instances():
        ports.append(spec.resolved_http_port)
        ports.extend(listening_side_channel_ports(role, spec, topo.connector.type))
    return ports


def bench_topology(topo: Topology, mode: str, *, kv_heavy: bool = False, port_base: int | None = None,
                   mode_index: int | None = None, traces_endpoint: str | None = None) -> Topology:
    """The topology the bench deploys for one mode: connector.type = mode, a deployment name of its own
    (so a running deployment of the same file is never restarted), optionally the KV-heavy model, other
    ports, and every instance's request spans sent to `traces_endpoint`. The input is not modified.

    `mode_index` is for benches that keep every mode's deployment up at once (`--rounds`): each mode
    then gets a name of its own and the port range port_base + mode_index * MODE_PORT_STRIDE."""
    kind, stock = connector_of(mode)
    if topo.connector.type == "colocated" and kind != "colocated" and (not topo.prefill or not topo.decode):
        raise UsageError(f"mode {mode} needs prefill and decode instances, but topology '{topo.name}' has "
                         f"{len(topo.prefill)} prefill and {len(topo.decode)} decode; add both or bench only colocated")
    suffix = "-bench" if mode_index is None else f"-bench-{mode.replace(POLICY_SEPARATOR, '-')}"
    name = f"{topo.name[:min(50 if mode_index is None else 40, 63 - len(suffix))]}{suffix}"
    out = topo.model_copy(deep=True)
    out = out.model_copy(
        update={"name": name, "connector": out.connector.model_copy(update={"type": kind, "stock_vllm": stock})}
    )
    if policy_of(mode) is not None:
        out = out.model_copy(update={"router": out.router.model_copy(update={"policy": policy_of(mode)})})
    if kv_heavy:
        out = kv_heavy_model(out)
    if traces_endpoint is not None:
        out = out.model_copy(update={"tracing": TracingSpec(otlp_endpoint=traces_endpoint,
                                                            export_delay_ms=SPAN_EXPORT_DELAY_MS)})
    if mode_index is not None:
        if port_base is None:
            raise UsageError(ROUNDS_NEED_PORT_BASE)
        start = port_base + mode_index * MODE_PORT_STRIDE
        out = renumber_ports(out, start)
        if max(ports_of(out)) >= start + MODE_PORT_STRIDE:
            raise UsageError(f"topology '{topo.name}' needs more than {MODE_PORT_STRIDE} ports per deployment; "
                             f"--rounds cannot place {len(ports_of(out))} ports per mode side by side")
    elif port_base is not None:
        out = renumber_ports(out, port_base)
    return out


def topology_hash(topo: Topology) -> str:
    """Stable across runs and field order; changes whenever anything deployed changes (where the
    instances' spans go is the measurement's, and its port differs from run to run)."""
    dumped = topo.model_dump(mode="json", exclude={"tracing"})
    return hashlib.sha256(json.dumps(dumped, sort_keys=True).encode()).hexdigest()[:16]
