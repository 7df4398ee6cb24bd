"""tests/chaos_topologies.py: every chaos shape is a valid topology comparable with the reference server."""
from __future__ import annotations

import pytest

from chaos_topologies import SHAPES, chaos_topology
from kvpush.deploy.plan.plan import build_plan
from kvpush.deploy.topology.topology import parse_topology

pytestmark = pytest.mark.unit

TP = {"1p1d": ([1], [1]), "p1-d2": ([1], [2]), "2p2d": ([1, 1], [1, 1]), "mixed": ([1, 1], [2, 1])}


@pytest.mark.parametrize("shape", SHAPES)
def test_each_shape_plans_float32_eager_without_prefix_cache_on_its_own_ports(shape):
    topo = parse_topology(chaos_topology(shape, f"chaos-{shape}", "/models/tiny", "/work/chaos", 18500, 0.25))
    assert ([i.tensor_parallel_size for i in topo.prefill], [i.tensor_parallel_size for i in topo.decode]) == TP[shape]
    plan = build_plan(topo)
    for proc in plan.processes():
        assert 18500 <= proc.http_port < 18520 and all(18500 <= p < 18520 for p in proc.side_channel_ports)
        if proc.role != "router":
            argv = " ".join(proc.argv)
            assert "--dtype float32" in argv and "--enforce-eager" in argv and "--no-enable-prefix-caching" in argv


def test_an_unknown_shape_is_refused_naming_the_known_ones():
    with pytest.raises(ValueError, match="1p1d, p1-d2, 2p2d, mixed"):
        chaos_topology("3p3d", "x", "/m", "/w", 18500, 0.25)
