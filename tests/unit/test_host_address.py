"""One host address type for topology, plan, state and runners, and the URLs derived from it."""
from __future__ import annotations

import pytest

from kvpush.deploy.topology.host_address import HostAddress, base_url, http_url
from kvpush.deploy.plan.plan import build_plan
from kvpush.deploy.lifecycle.state import HostRecord
from kvpush.deploy.topology.topology import parse_topology

TOPOLOGY = """
model: {path: /m}
hosts:
  here: {address: 127.0.0.1}
  there: {address: 10.0.0.7, ssh_port: 2200, user: ops, key: /k, ssh_host: gpu7}
prefill: [{host: here}]
decode: [{host: there}]
router: {host: there, bind: 0.0.0.0, port: 9000}
"""


def test_the_topology_the_plan_and_the_state_carry_the_same_address():
    topo = parse_topology(TOPOLOGY)
    plan_host = build_plan(topo).host("there")
    record = HostRecord.from_plan(plan_host)
    assert topo.hosts["there"].address_fields() == plan_host.address_fields() == record.address_fields() == {
        "address": "10.0.0.7", "ssh_port": 2200, "user": "ops", "key": "/k", "ssh_host": "gpu7"}
    assert record.workdir == "~/.kvpush/kvpush"


@pytest.mark.parametrize("fields, local", [
    ({"address": "127.0.0.1"}, True), ({"address": "localhost", "ssh_port": 22}, True),
    ({"address": "127.0.0.1", "ssh_port": 2222}, False), ({"address": "127.0.0.1", "user": "root"}, False),
    ({"address": "127.0.0.1", "ssh_host": "box"}, False), ({"address": "10.0.0.1"}, False),
])
def test_only_this_machine_without_ssh_settings_is_local(fields, local):
    assert HostAddress(**fields).is_local is local


def test_describe_says_what_the_topology_gave():
    assert HostAddress(address="10.0.0.7").describe() == "10.0.0.7"
    assert HostAddress(address="10.0.0.7", ssh_port=2200, user="ops", ssh_host="gpu7").describe() == "ops@gpu7:2200"


def test_urls_from_an_address_and_from_a_health_url():
    assert http_url("::1", 8000, "/health") == "http://[::1]:8000/health"
    assert base_url("http://10.0.0.7:8100/health") == "http://10.0.0.7:8100"
    with pytest.raises(ValueError, match="not a health URL"):
        base_url("http://10.0.0.7:8100/metrics")


def test_a_client_here_reaches_a_remote_router_at_its_hosts_address():
    plan = build_plan(parse_topology(TOPOLOGY))
    assert plan.router_url == "http://127.0.0.1:9000"  # as the router's own host reaches it
    assert plan.router_url_from_here() == "http://10.0.0.7:9000"
    local = build_plan(parse_topology(TOPOLOGY.replace("router: {host: there", "router: {host: here")))
    assert local.router_url_from_here() == local.router_url == "http://127.0.0.1:9000"
