"""The connector settings `kvpush plan` writes are the ones the connector reads: each template's
planned --kv-transfer-config goes through the connector's own parser (Settings.from_vllm), and every
entry of ConnectorExtraConfig is checked against the topology it came from."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from kvpush.connector.settings import (CPU_IDLE_WAIT_MS, GPU_IDLE_WAIT_MS, ConnectorExtraConfig, Settings,
                                       UnsupportedDeployment)
from kvpush.deploy.plan.plan import build_plan
from kvpush.deploy.topology.placement import bind_address, secret_path
from kvpush.deploy.topology.topology import TopologyError, parse_topology
from kvpush.templates import template_names, template_text

KVPUSH_TEMPLATES = [name for name in template_names() if parse_topology(template_text(name)).connector.type == "kvpush"]


def planned_settings(topo):
    """(role, instance spec, the planned extra config, what the connector makes of it) per kvpush instance."""
    plan = build_plan(topo)
    specs = {spec.name: (role, spec) for role, _, spec in topo.instances()}
    out = []
    for proc in plan.processes():
        if proc.role == "router":
            continue
        role, spec = specs[proc.name]
        kv = json.loads(proc.argv[proc.argv.index("--kv-transfer-config") + 1])
        vllm_config = SimpleNamespace(
            kv_transfer_config=SimpleNamespace(**kv),
            model_config=SimpleNamespace(model=topo.model.path, use_mla=False, get_total_num_kv_heads=lambda: 8),
            parallel_config=SimpleNamespace(tensor_parallel_size=spec.tensor_parallel_size, data_parallel_size=1,
                                            pipeline_parallel_size=1),
            cache_config=SimpleNamespace(block_size=16))
        out.append((role, spec, kv["kv_connector_extra_config"], Settings.from_vllm(vllm_config)))
    return out


def expected_entries(topo, role, spec) -> dict:
    """Every entry of ConnectorExtraConfig as the topology implies it: derived, given, or the default."""
    peers = topo.decode if role == "prefill" else topo.prefill
    derived = {
        "side_channel_host": bind_address(topo.hosts[spec.host]),
        "side_channel_port": spec.side_channel_port,
        "allowed_engines": sorted(f"{topo.name}.{p.name}" for p in peers),
        "secret_file": secret_path(topo, topo.hosts[spec.host], "deployment-secret"),
        "peer_side_channels": {f"{topo.name}.{p.name}": f"{bind_address(topo.hosts[p.host])}:{p.side_channel_port}"
                               for p in peers},
        "backend": topo.connector.backend,
        "transfer_timeout_s": topo.connector.transfer_timeout_s,
    }
    defaults = {name: field.default for name, field in ConnectorExtraConfig.model_fields.items()
                if not field.is_required()}
    return {**defaults, **derived, **topo.connector.extra_config}


def as_the_connector_holds(name: str, value, on_cpu: bool):
    if name == "allowed_engines":
        return frozenset(value)
    if name == "peer_side_channels":
        return {engine: (address.rsplit(":", 1)[0], int(address.rsplit(":", 1)[1])) for engine, address in value.items()}
    if name == "idle_wait_ms" and value is None:
        return CPU_IDLE_WAIT_MS if on_cpu else GPU_IDLE_WAIT_MS
    return value


def check_round_trip(topo):
    checked = planned_settings(topo)
    assert checked
    for role, spec, planned, settings in checked:
        expected = expected_entries(topo, role, spec)
        assert set(expected) == set(ConnectorExtraConfig.model_fields)
        assert {k: v for k, v in planned.items()} == {k: v for k, v in expected.items() if v is not None}
        on_cpu = topo.platform == "cpu"
        for name in ConnectorExtraConfig.model_fields:  # each entry reaches the connector's settings unchanged
            assert getattr(settings, name) == as_the_connector_holds(name, expected[name], on_cpu), name
        assert settings.engine_id == f"{topo.name}.{spec.name}"
        assert settings.is_producer == (role == "prefill")
        assert settings.buffer_device == ("cpu" if on_cpu else "cuda")
        assert settings.tp_size == spec.tensor_parallel_size


@pytest.mark.parametrize("name", KVPUSH_TEMPLATES)
def test_each_templates_planned_settings_are_what_the_connector_reads(name):
    check_round_trip(parse_topology(template_text(name)))


def test_settings_given_in_the_topology_reach_the_connector():
    given = {"idle_wait_ms": 0, "progress_delay_us": 250, "huge_pages": False, "stream_writes": False,
             "peer_silence_s": 2.5, "accepted_timeout_s": 20, "late_write_hold_s": 0}
    text = template_text("local-cpu").replace("  type: kvpush\n", "  type: kvpush\n  transfer_timeout_s: 7\n"
                                              f"  extra_config: {json.dumps(given)}\n")
    topo = parse_topology(text)
    assert topo.connector.extra_config == given and topo.connector.transfer_timeout_s == 7
    check_round_trip(topo)
    settings = planned_settings(topo)[0][3]
    assert (settings.idle_wait_ms, settings.progress_delay_us, settings.huge_pages, settings.transfer_timeout_s) == \
        (0.0, 250, False, 7.0)
    assert set(given) < set(ConnectorExtraConfig.model_fields)


def test_the_topology_default_of_transfer_timeout_is_the_connectors():
    topo = parse_topology(template_text("local-cpu"))
    assert topo.connector.transfer_timeout_s == ConnectorExtraConfig.model_fields["transfer_timeout_s"].default


@pytest.mark.parametrize("entry, words", [
    ('{"backends": ["UCX"]}', r"connector\.extra_config\.backends: is not a setting of kvpush's connector; "
                              r"the settings are backend, transfer_timeout_s"),
    ('{"huge_pages": "no"}', r"connector\.extra_config\.huge_pages: must be true or false, not 'no'"),
    ('{"idle_wait_ms": -1}', r"connector\.extra_config\.idle_wait_ms: must be a number >= 0, not -1"),
])
def test_an_entry_the_connector_would_refuse_is_refused_at_its_line(entry, words):
    text = template_text("local-cpu").replace("  type: kvpush\n", f"  type: kvpush\n  extra_config: {entry}\n")
    with pytest.raises(TopologyError, match=words):
        parse_topology(text)


def test_the_connector_refuses_what_the_plan_never_writes():
    topo = parse_topology(template_text("local-cpu"))
    planned = planned_settings(topo)[0][2]
    with pytest.raises(UnsupportedDeployment, match="kv_connector_extra_config.backends is not a setting"):
        ConnectorExtraConfig.parse({**planned, "backends": ["UCX"]})
