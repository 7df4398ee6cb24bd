"""Rules between the topology's fields, on the fully defaulted topology: port clashes on a host
(HTTP, side channel, and the ports that data-parallel ranks derive), a GPU or CPU core given to two
instances, unknown hosts, roles with no instances, and TP sizes the model's KV heads allow."""
from __future__ import annotations

from pathlib import Path

from kvpush.common.errors import field_path
from kvpush.connector.settings import ConnectorExtraConfig

from .process_specs import InstanceSpec
from .topology_defaults import listening_side_channel_ports
from .topology_schema import NAME_PATTERN, ROUTER_PROCESS_NAME, Role, Topology, TopologyError
from .topology_values import KVPUSH_SECURITY_KEYS, rank_core_lists
from .yaml_source import SourceDocument


class Problems:
    """Raises the first problem found, as `file:line:col: field: message`."""

    def __init__(self, doc: SourceDocument):
        self.doc = doc

    def fail(self, path: tuple, message: str) -> None:
        raise TopologyError(f"{self.doc.where(path)}: {field_path(path)}: {message}")


def _check_connector_settings(topo: Topology, problems: Problems) -> None:
    """kvpush's connector refuses at start-up an extra_config entry it does not know or cannot take:
    refuse it here, where the topology can say which line."""
    tunable = [name for name in ConnectorExtraConfig.model_fields if name not in KVPUSH_SECURITY_KEYS]
    for name, value in topo.connector.extra_config.items():
        if name in KVPUSH_SECURITY_KEYS:
            continue  # topology_security.py says why
        problem = ConnectorExtraConfig.entry_problem(name, value)
        if problem:
            known = f"; the settings are {', '.join(tunable)}" if name not in tunable else f", not {value!r}"
            problems.fail(("connector", "extra_config", name), problem + known)


def check_cross_fields(topo: Topology, problems: Problems) -> None:
    if topo.connector.type != "colocated":
        for role in ("prefill", "decode"):
            if not getattr(topo, role):
                problems.fail(
                    (role,),
                    f"has no instances; a disaggregated deployment needs at least one {role} instance (or set "
                    "connector.type: colocated)",
                )
    elif not topo.instances():
        problems.fail(("decode",), "has no instances; add at least one instance")
    if topo.connector.type == "kvpush":
        _check_connector_settings(topo, problems)
    if topo.connector.stock_vllm and topo.connector.type not in ("nixl-push", "nixl-pull"):
        problems.fail(("connector", "stock_vllm"), f"applies to connector types nixl-push and nixl-pull only, not "
                                                   f"{topo.connector.type}; remove it or change connector.type")
    for name in topo.hosts:
        if not NAME_PATTERN.match(name):
            problems.fail(("hosts", name), "host names must be lowercase letters, digits and '-'")
    if topo.router.host not in topo.hosts:
        problems.fail(
            ("router", "host"),
            f"unknown host '{topo.router.host}'; define it under hosts: or use one of {', '.join(topo.hosts)}",
        )

    seen_names: dict[str, tuple] = {}
    ports: dict[tuple[str, int], tuple[tuple, str]] = {}
    devices: dict[tuple[str, int], tuple] = {}
    cores: dict[tuple[str, int], tuple] = {}

    def claim_port(host: str, port: int, path: tuple, what: str) -> None:
        key = (host, port)
        if key in ports:
            other_path, other_what = ports[key]
            if path not in problems.doc.value_positions and other_path in problems.doc.value_positions:
                # The clash is with a defaulted port: point at the port the user actually wrote.
                path, other_path, other_what = other_path, path, what
            problems.fail(
                path,
                f"port {port} on host '{host}' is also used by {field_path(other_path)} ({other_what}); give each "
                "process its own port",
            )
        ports[key] = (path, what)

    router_path = ("router", "port")
    claim_port(topo.router.resolved_host, topo.router.port, router_path, "router HTTP")
    for role, index, spec in topo.instances():
        base = (role, index)
        name, host = spec.resolved_name, spec.resolved_host
        if name in seen_names:
            problems.fail(
                base + ("name",),
                f"name '{name}' is already used by {field_path(seen_names[name])}; names must be unique",
            )
        if not NAME_PATTERN.match(name):
            problems.fail(base + ("name",), f"'{name}' must be lowercase letters, digits and '-'")
        if name == ROUTER_PROCESS_NAME:
            problems.fail(
                base + ("name",), f"'{ROUTER_PROCESS_NAME}' is the router process's name; choose another name"
            )
        seen_names[name] = base
        if host not in topo.hosts:
            problems.fail(
                base + ("host",),
                f"unknown host '{host}'; define it under hosts: or use one of {', '.join(topo.hosts)}",
            )
        claim_port(host, spec.resolved_http_port, base + ("http_port",), f"{name} HTTP")
        for rank, port in enumerate(listening_side_channel_ports(role, spec, topo.connector.type)):
            if port > 65535:
                problems.fail(
                    base + ("side_channel_port",),
                    f"rank {rank} would listen on port {port} > 65535; lower side_channel_port",
                )
            what = f"{name} side channel" + (f" rank {rank}" if rank else "")
            claim_port(host, port, base + ("side_channel_port",), what)

        ranks = spec.tensor_parallel_size * spec.data_parallel_size
        if topo.platform == "cuda":
            if spec.cpu_cores is not None:
                problems.fail(base + ("cpu_cores",), "applies to platform cpu only; remove it or set platform: cpu")
            if not spec.devices:
                problems.fail(base, "lists no devices; add 'devices: [0, ...]' with one GPU per TP x DP rank")
            if len(spec.devices) != ranks:
                problems.fail(
                    base + ("devices",),
                    f"lists {len(spec.devices)} GPUs but tensor_parallel_size x data_parallel_size = "
                    f"{spec.tensor_parallel_size} x {spec.data_parallel_size} = {ranks}; list exactly {ranks} devices "
                    "or change the sizes",
                )
            for dev in spec.devices:
                key = (host, dev)
                other = devices.get(key)
                if other is not None and not (spec.share_gpus and getattr(topo, other[0])[other[1]].share_gpus):
                    problems.fail(
                        base + ("devices",),
                        f"GPU {dev} on host '{host}' is also given to {field_path(other)}; give "
                        "each GPU to one instance, or set share_gpus: true on every instance that shares it",
                    )
                devices[key] = base
        else:
            if spec.devices:
                problems.fail(
                    base + ("devices",), "GPU devices need platform: cuda; remove devices or set platform: cuda"
                )
            if spec.share_gpus:
                problems.fail(base + ("share_gpus",), "applies to platform cuda only; remove it or set platform: cuda")
            if spec.data_parallel_size != 1:
                problems.fail(
                    base + ("data_parallel_size",),
                    f"CPU instances run one data-parallel rank (got {spec.data_parallel_size}); "
                    "set data_parallel_size: 1 and run one instance per rank",
                )
            if spec.cpu_cores is not None:
                _claim_cores(topo, role, index, spec, cores, problems)
    _check_unpinned_prefill_beside_tp_decode(topo, problems)
    _check_tp_sizes(topo, problems)
    _check_upstream_tp_pairs(topo, problems)
    if topo.connector.backend == "LIBFABRIC" and topo.platform == "cpu":
        problems.fail(
            ("connector", "backend"),
            "LIBFABRIC (EFA) needs platform: cuda hosts with EFA; use backend: UCX for CPU deployments",
        )


def _claim_cores(topo: Topology, role: Role, index: int, spec: InstanceSpec, cores: dict, problems: Problems) -> None:
    """One core list per rank; a core given twice (two instances, or two ranks of one) only where
    every instance involved says share_cores."""
    base = (role, index)
    assert spec.cpu_cores is not None, "only an instance given cpu_cores claims them"
    groups = rank_core_lists(spec.cpu_cores)
    ranks = spec.tensor_parallel_size
    if len(groups) != ranks:
        example = "|".join(str(i) for i in range(ranks)) if ranks > 1 else "0-3"
        problems.fail(
            base + ("cpu_cores",),
            f"gives {len(groups)} core list(s) for {ranks} TP rank(s); give one per rank, "
            f"'|'-separated, e.g. '{example}'",
        )
    for rank, group in enumerate(groups):
        for core in sorted(group):
            key = (spec.host, core)
            if key in cores:
                other_path, other_rank = cores[key]
                other = getattr(topo, other_path[0])[other_path[1]]
                if not (spec.share_cores and other.share_cores):
                    whom = f"its rank {other_rank}" if other is spec else f"{field_path(other_path)} ({other.name})"
                    why = _prefill_on_tp_decode(topo, (spec, rank), (other, other_rank)) or "(a small machine)"
                    problems.fail(
                        base + ("cpu_cores",),
                        f"core {core} on host '{spec.host}' is also given to {whom}; give each "
                        "instance and rank its own cores, or set share_cores: true on every instance that shares them "
                        f"{why}",
                    )
            cores[key] = (base, rank)


def _prefill_on_tp_decode(topo: Topology, one: tuple[InstanceSpec, int], two: tuple[InstanceSpec, int]) -> str:
    """Why a core shared by these two (instance, rank) is worse than sharing: one is a prefill and
    the other a rank of a TP > 1 decode it writes KV into ("" otherwise)."""
    kinds = {id(s): role for role, _, s in topo.instances()}
    (a, _), (b, _) = one, two
    pair = {kinds.get(id(a)): one, kinds.get(id(b)): two}
    if a is b or "prefill" not in pair or "decode" not in pair or topo.connector.type not in WRITING_CONNECTORS:
        return ""
    (prefill, _), (decode, rank) = pair["prefill"], pair["decode"]
    if decode.tensor_parallel_size < 2:
        return ""
    return (
        f"(prefill {prefill.name} would share it with rank {rank} of decode {decode.name} (TP "
        f"{decode.tensor_parallel_size}), "
        "which it writes KV into: decode's ranks spin in every layer's all-reduce waiting for each other, so a "
        "prefill "
        f"on one of their cores can keep a rank from running, and the prefill from writing, until decode gives up)"
    )


# Connector types where prefill writes into decode's KV cache (in nixl-pull, decode reads)
WRITING_CONNECTORS = ("kvpush", "nixl-push")


def _check_unpinned_prefill_beside_tp_decode(topo: Topology, problems: Problems) -> None:
    """A prefill and a TP > 1 decode it writes into, on one CPU host, one of them without
    cpu_cores: it may run on any core, those of the other too. The pinned case is _claim_cores'."""
    if topo.platform != "cpu" or topo.connector.type not in WRITING_CONNECTORS:
        return
    for p_index, prefill in enumerate(topo.prefill):
        for d_index, decode in enumerate(topo.decode):
            if (
                decode.tensor_parallel_size < 2
                or prefill.host != decode.host
                or prefill.share_cores
                and decode.share_cores
                or prefill.cpu_cores is not None
                and decode.cpu_cores is not None
            ):
                continue
            unpinned, path = (
                (prefill, ("prefill", p_index)) if prefill.cpu_cores is None else (decode, ("decode", d_index))
            )
            if decode.cpu_cores is not None:
                rank, cores = 0, rank_core_lists(decode.cpu_cores)[0]
                where = (f"core {min(cores)}, which rank {rank} of decode {decode.name} "
                         f"(TP {decode.tensor_parallel_size}) runs on")
            elif prefill.cpu_cores is not None:
                where = f"core {min(rank_core_lists(prefill.cpu_cores)[0])}, which prefill {prefill.name} runs on"
            else:
                where = "any core"
            problems.fail(
                path,
                f"{unpinned.name} has no cpu_cores, so on host '{prefill.host}' prefill {prefill.name} and the "
                f"ranks of decode {decode.name} (TP {decode.tensor_parallel_size}), which it writes KV into, may "
                f"share {where}: decode's ranks spin in every layer's all-reduce waiting for each other, so a "
                f"prefill on one of their cores can keep a rank from running until decode gives up; give both "
                f"cpu_cores of their own, or set share_cores: true on both",
            )


def known_kv_heads(topo: Topology) -> int | None:
    """The model's KV heads where known before launch: model.kv_heads, the tiny model's, or the
    config.json of a model present on this machine. None: doctor checks on the hosts."""
    if topo.model.kv_heads is not None:
        return topo.model.kv_heads
    if topo.model.tiny is not None:
        return topo.model.tiny.kv_heads
    from .model_config import kv_heads_of

    return kv_heads_of(Path(topo.model.path).expanduser())


def _check_tp_sizes(topo: Topology, problems: Problems) -> None:
    """Each instance's TP size splits the model's KV heads the way vLLM can; prefill and decode
    may use different sizes (kvpush re-shards the heads at the transfer)."""
    heads = known_kv_heads(topo)
    if heads is None:
        return
    from kvpush.connector.sharding import tp_problem

    for role, index, spec in topo.instances():
        problem = tp_problem(heads, spec.tensor_parallel_size)
        if problem:
            problems.fail(
                (role, index, "tensor_parallel_size"),
                f"{spec.name} uses TP size {spec.tensor_parallel_size} but the model has {heads} KV heads: {problem}",
            )


UPSTREAM_CONNECTORS = ("nixl-push", "nixl-pull")


def upstream_tp_pair_problem(prefill_tp: int, decode_tp: int) -> str:
    """Why vLLM's NixlConnector cannot pair these TP sizes ("" if it can): it maps ranks only when
    one size is a multiple of the other, and otherwise fails an assertion at the first handshake."""
    if max(prefill_tp, decode_tp) % min(prefill_tp, decode_tp):
        return (f"vLLM's NixlConnector pairs TP sizes only when one divides the other (prefill TP {prefill_tp}, "
                f"decode TP {decode_tp}); use such sizes or connector type kvpush")
    return ""


def _check_upstream_tp_pairs(topo: Topology, problems: Problems) -> None:
    """With an upstream connector any prefill may feed any decode: every pair must be one it maps."""
    if topo.connector.type not in UPSTREAM_CONNECTORS:
        return
    for index, decode in enumerate(topo.decode):
        for prefill in topo.prefill:
            problem = upstream_tp_pair_problem(prefill.tensor_parallel_size, decode.tensor_parallel_size)
            if problem:
                problems.fail(
                    ("decode", index, "tensor_parallel_size"), f"{decode.name} with prefill {prefill.name}: {problem}"
                )


def check_key_files(topo: Topology) -> None:
    """Before connecting: each SSH host's `key` is a private key file on this machine.

    Not part of loading: `plan` must work for a topology whose keys live on another machine.
    """
    for name, host in topo.hosts.items():
        if host.key is None or host.is_local:
            continue
        key_file = Path(host.key).expanduser()
        where = f"hosts.{name}.key: {host.key}"
        if not key_file.exists():
            raise TopologyError(f"{where}: no such file; give the private key path")
        if not key_file.is_file():
            raise TopologyError(f"{where}: not a file; give the private key path")
        if key_file.suffix == ".pub":
            raise TopologyError(f"{where}: is the public key; give the private key path (without .pub)")
