"""kvpush.bench.modes: one topology per mode, derived without touching the input."""
from __future__ import annotations

import pytest

from kvpush.bench.modes import (
    KV_HEAVY_SPEC, MODE_PORT_STRIDE, MODES, bench_topology, kv_bytes_per_token, mode_label, parse_modes, parse_rates,
    ports_of, topology_hash,
)
from kvpush.common.errors import UsageError
from kvpush.deploy.plan.plan import build_plan
from kvpush.deploy.topology.topology import parse_topology
from kvpush.templates import DEFAULT_TEMPLATE, template_text


@pytest.fixture
def local_cpu():
    return parse_topology(template_text(DEFAULT_TEMPLATE))


@pytest.mark.parametrize("mode", MODES)
def test_each_mode_sets_the_connector_and_plans(local_cpu, mode):
    topo = bench_topology(local_cpu, mode)
    connector = mode.removesuffix("-stock")
    assert topo.connector.type == connector
    assert topo.connector.stock_vllm == mode.endswith("-stock")
    plan = build_plan(topo)
    assert plan.connector == connector
    decode_argv = " ".join(plan.process("decode-0").argv)
    assert ("--kv-transfer-config" in decode_argv) == (mode != "colocated")
    if connector == "nixl-push":
        assert "NixlPushConnector" in decode_argv
    if mode == "kvpush":
        assert "KVPushConnector" in decode_argv
    # the tuned NIXL modes load vLLM's classes through kvpush's module on CPU; the stock ones never do
    assert ("kvpush.connector.vllm_nixl" in decode_argv) == (mode in ("nixl-push", "nixl-pull"))


def test_stock_and_tuned_modes_are_labelled_apart_on_cpu_and_alike_on_gpu():
    assert mode_label("nixl-pull-stock") == "nixl-pull (stock vLLM)"
    assert mode_label("nixl-pull") == "nixl-pull (kvpush-tuned)"
    assert mode_label("nixl-pull", "cuda") == "nixl-pull"
    assert mode_label("kvpush") == "kvpush"


def test_stock_vllm_applies_to_nixl_connectors_only():
    from kvpush.deploy.topology.topology import TopologyError
    text = template_text(DEFAULT_TEMPLATE).replace("connector:", "connector:\n  stock_vllm: true", 1)
    assert "stock_vllm" in text
    with pytest.raises(TopologyError, match="connector.stock_vllm: applies to connector types nixl-push and nixl-pull only"):
        parse_topology(text)


def test_input_is_untouched_and_name_is_its_own(local_cpu):
    before = local_cpu.model_dump()
    topo = bench_topology(local_cpu, "colocated", kv_heavy=True, port_base=15000)
    assert local_cpu.model_dump() == before
    assert topo.name == "local-cpu-bench"  # never restarts a running local-cpu deployment


def test_port_base_renumbers_every_port_consecutively(local_cpu):
    topo = bench_topology(local_cpu, "kvpush", port_base=15000)
    assert topo.router.port == 15000
    assert [topo.prefill[0].http_port, topo.decode[0].http_port] == [15001, 15002]
    assert [topo.prefill[0].side_channel_port, topo.decode[0].side_channel_port] == [15003, 15004]
    plan = build_plan(topo)
    assert plan.router_url == "http://127.0.0.1:15000"


def test_kv_heavy_model_is_32_kib_per_token_with_long_context(local_cpu):
    topo = bench_topology(local_cpu, "nixl-pull", kv_heavy=True)
    assert topo.model.tiny == KV_HEAVY_SPEC
    assert kv_bytes_per_token(topo.model.tiny) == 32 * 1024
    assert topo.model.max_model_len >= 4096
    assert topo.model.tiny.max_position_embeddings >= topo.model.max_model_len
    assert topo.model.path.endswith("/tiny-llama-kv-heavy") and topo.model.path != local_cpu.model.path


def test_topology_hash_is_stable_and_sensitive(local_cpu):
    a = topology_hash(bench_topology(local_cpu, "kvpush"))
    assert a == topology_hash(bench_topology(local_cpu, "kvpush"))
    assert a != topology_hash(bench_topology(local_cpu, "nixl-pull"))
    assert a != topology_hash(bench_topology(local_cpu, "kvpush", kv_heavy=True))


def test_disaggregated_mode_needs_both_roles():
    colocated_only = parse_topology("model: {path: /m}\nconnector: {type: colocated}\ndecode: [{}]\n")
    assert bench_topology(colocated_only, "colocated").connector.type == "colocated"
    with pytest.raises(UsageError, match="needs prefill and decode"):
        bench_topology(colocated_only, "nixl-pull")


def test_parse_modes_and_rates():
    assert parse_modes("kvpush, nixl-pull") == ["kvpush", "nixl-pull"]
    with pytest.raises(UsageError, match="unknown mode 'push'"):
        parse_modes("push")
    with pytest.raises(UsageError, match="twice"):
        parse_modes("kvpush,kvpush")
    assert parse_rates("2,0.5,1") == [0.5, 1.0, 2.0]
    for bad in ("", "0", "-1", "x", "inf"):
        with pytest.raises(UsageError):
            parse_rates(bad)


def test_modes_up_at_once_get_names_and_port_ranges_of_their_own(local_cpu):
    topos = [bench_topology(local_cpu, m, port_base=15200, mode_index=i) for i, m in enumerate(MODES)]
    assert len({t.name for t in topos}) == len(MODES)
    assert all(t.name.endswith(f"-bench-{m}") for t, m in zip(topos, MODES))
    ranges = [set(ports_of(t)) for t in topos]
    assert all(min(r) >= 15200 + i * MODE_PORT_STRIDE and max(r) < 15200 + (i + 1) * MODE_PORT_STRIDE
               for i, r in enumerate(ranges))
    with pytest.raises(UsageError, match="--rounds keeps every mode's deployment up at once.*give --port-base"):
        bench_topology(local_cpu, "kvpush", mode_index=0)


def test_a_mode_may_name_the_routers_policy_after_a_plus(local_cpu):
    assert parse_modes("kvpush,kvpush+least-loaded,nixl-pull+round-robin") == [
        "kvpush", "kvpush+least-loaded", "nixl-pull+round-robin"]
    with pytest.raises(UsageError, match="unknown router policy 'nearest'.*prefix-aware"):
        parse_modes("kvpush+nearest")
    with pytest.raises(UsageError, match="unknown mode"):
        parse_modes("push+least-loaded")
    plain, least = bench_topology(local_cpu, "kvpush"), bench_topology(local_cpu, "kvpush+least-loaded")
    assert plain.router.policy == local_cpu.router.policy == "prefix-aware"
    assert least.router.policy == "least-loaded" and least.connector.type == "kvpush"
    stock = bench_topology(local_cpu, "nixl-pull-stock+round-robin")
    assert (stock.connector.type, stock.connector.stock_vllm, stock.router.policy) == ("nixl-pull", True, "round-robin")
    assert mode_label("kvpush+least-loaded") == "kvpush, least-loaded router"
    assert mode_label("nixl-pull+least-loaded") == "nixl-pull (kvpush-tuned), least-loaded router"


def test_policy_modes_up_at_once_get_valid_names_of_their_own(local_cpu):
    long_name = local_cpu.model_copy(update={"name": "a-rather-long-deployment-name-for-a-bench-x"})
    modes = ["kvpush", "kvpush+least-loaded", "nixl-push-stock+least-loaded", "nixl-push-stock+round-robin"]
    topos = [bench_topology(long_name, m, port_base=15200, mode_index=i) for i, m in enumerate(modes)]
    assert len({t.name for t in topos}) == len(modes)
    assert all(len(t.name) <= 63 and "+" not in t.name for t in topos)
    build_plan(topos[2])  # a valid deployment name
