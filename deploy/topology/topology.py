"""The topology file: one YAML document describing a whole disaggregated deployment.

Loading runs in three steps, each in its own module: the schema checks every field on its own
(topology_schema), defaults that depend on other fields are filled (topology_defaults), and the
rules between fields are checked (topology_checks). Every error is one line naming file:line:col,
the field, what is wrong and how to fix it. This module loads files and re-exports the names the
rest of kvpush uses.
"""
from __future__ import annotations

from pathlib import Path

from pydantic import ValidationError

from kvpush.common.errors import field_path, first_problem, validation_message

from .process_specs import HostSpec, InstanceSpec, RestartSpec, RouterSpec
from .slurm_topology import check_slurm_fields  # the Slurm launcher's own rules live with it
from .topology_checks import Problems, check_cross_fields, check_key_files, known_kv_heads
from .topology_defaults import apply_defaults, listening_side_channel_ports, side_channel_ports
from .topology_schema import (
    NAME_PATTERN,
    ROUTER_PROCESS_NAME,
    Backend,
    ConnectorSpec,
    ConnectorType,
    ModelSpec,
    Role,
    SlurmSpec,
    TinyModelSpec,
    Topology,
    TopologyError,
    TracingSpec,
    topology_field_names,
)
from .topology_security import check_security_fields
from .topology_values import core_list_text, parse_core_list, rank_core_lists
from .yaml_source import SourceDocument, YamlSyntaxError, load_yaml_file, parse_yaml

__all__ = [
    "NAME_PATTERN",
    "ROUTER_PROCESS_NAME",
    "Backend",
    "ConnectorSpec",
    "ConnectorType",
    "HostSpec",
    "InstanceSpec",
    "ModelSpec",
    "RestartSpec",
    "Role",
    "RouterSpec",
    "SlurmSpec",
    "TinyModelSpec",
    "Topology",
    "TopologyError",
    "TracingSpec",
    "check_key_files",
    "core_list_text",
    "known_kv_heads",
    "listening_side_channel_ports",
    "load_topology",
    "parse_core_list",
    "parse_topology",
    "rank_core_lists",
    "resolve_topology",
    "side_channel_ports",
    "topology_from_document",
]


def _slurm_host_addresses(data: dict) -> None:
    """launcher slurm: a host's address may be left out; it is its node's name until `up` learns
    the node's NodeAddr from Slurm."""
    hosts = data.get("hosts")
    if data.get("launcher") != "slurm" or not isinstance(hosts, dict):
        return
    for name, host in hosts.items():
        if host is None:
            hosts[name] = host = {}
        if isinstance(host, dict) and "address" not in host:
            host["address"] = str(host.get("node") or name)


def topology_from_document(doc: SourceDocument) -> Topology:
    if not isinstance(doc.data, dict):
        raise TopologyError(
            f"{doc.where(())}: the topology must be a YAML mapping with at least 'model:'; see `kvpush init`"
        )
    _slurm_host_addresses(doc.data)
    try:
        topo = Topology.model_validate(doc.data)
    except ValidationError as exc:
        err = first_problem(exc.errors())
        path = tuple(err["loc"])
        raise TopologyError(
            f"{doc.where(path)}: {field_path(path)}: {validation_message(err, topology_field_names())}"
        ) from None
    problems = Problems(doc)
    apply_defaults(topo, problems.fail)
    check_cross_fields(topo, problems)
    check_security_fields(topo, problems.fail)
    check_slurm_fields(topo, problems.fail)
    return topo


def load_topology(path: str | Path) -> Topology:
    path = Path(path)
    if not path.exists():
        raise TopologyError(f"{path}: no such topology file; create one with `kvpush init {path}`")
    if path.is_dir():
        raise TopologyError(f"{path}: is a directory; give the topology YAML file inside it")
    if not path.is_file():
        raise TopologyError(f"{path}: is not a regular file; give a topology YAML file")
    try:
        doc = load_yaml_file(path)
    except YamlSyntaxError as exc:
        raise TopologyError(str(exc)) from None
    except UnicodeDecodeError as exc:
        raise TopologyError(f"{path}: not UTF-8 text (byte {exc.start}); save the topology as UTF-8") from None
    except OSError as exc:
        raise TopologyError(f"{path}: cannot read it ({exc.strerror or exc}); check its permissions") from None
    return topology_from_document(doc)


def resolve_topology(path: str | Path | None) -> tuple[Topology, str]:
    """The topology a command works on, and a phrase saying where it came from.

    No path: ./kvpush.yaml if present, else the built-in local-cpu template.
    """
    if path is not None:
        return load_topology(path), str(path)
    default_file = Path("kvpush.yaml")
    if default_file.is_file():
        return load_topology(default_file), f"{default_file} (found in the current directory)"
    from kvpush.templates import DEFAULT_TEMPLATE, template_text

    return parse_topology(
        template_text(DEFAULT_TEMPLATE), f"<built-in {DEFAULT_TEMPLATE}>"
    ), f"the built-in {DEFAULT_TEMPLATE} topology (no FILE and no ./kvpush.yaml)"


def parse_topology(text: str, source: str = "<string>") -> Topology:
    try:
        doc = parse_yaml(text, source)
    except YamlSyntaxError as exc:
        raise TopologyError(str(exc)) from None
    return topology_from_document(doc)
