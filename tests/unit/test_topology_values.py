"""Single topology values from a hostile file: addresses, binds, names, paths, env, extra config."""
from __future__ import annotations

import re

import pytest

from kvpush.deploy.topology import topology_values as values
from kvpush.deploy.plan.plan import build_plan
from kvpush.deploy.topology.topology import TopologyError, parse_topology

BASE = "name: t\nmodel: {path: /m}\nprefill: [{}]\ndecode: [{}]\n"


@pytest.mark.parametrize("address", ["10.0.0.1", "127.0.0.1", "localhost", "gpu-01.cluster.example", "gpu-01.", "a" * 63])
def test_ipv4_addresses_and_dns_names_are_host_addresses(address):
    assert values.host_address(address) == address


@pytest.mark.parametrize("address,why", [
    ("::1", "IPv6"), ("fe80::1", "IPv6"), ("hóst", "non-ASCII"), ("host:22", "not an IPv4 address or a DNS name"),
    ("user@host", "not an IPv4"), ("-host", "not an IPv4"), ("a" * 64, "not an IPv4"), ("a..b", "not an IPv4"),
    ("1.2.3.256", "not a valid IPv4"), ("1.2.3", "not a valid IPv4"), ("a b", "not an IPv4"),
])
def test_other_host_addresses_are_refused(address, why):
    with pytest.raises(ValueError, match=why):
        values.host_address(address)


@pytest.mark.parametrize("bind", ["127.0.0.1", "0.0.0.0", "::", "::1", "10.1.2.3"])
def test_binds_are_ip_addresses(bind):
    assert values.bind_address(bind) == bind


@pytest.mark.parametrize("bind", ["not-an-ip", "localhost", "127.0.0.1:80", ""])
def test_other_binds_are_refused(bind):
    with pytest.raises(ValueError, match="not an IP address"):
        values.bind_address(bind)


def test_an_ipv6_router_bind_gets_brackets_in_the_plan_urls():
    plan = build_plan(parse_topology(BASE + 'router: {bind: "::1"}'))
    assert plan.router_url == "http://[::1]:8000"


@pytest.mark.parametrize("name", ["PATH", "_X", "a1_B"])
def test_posix_env_names_pass(name):
    assert values.env_map({name: "v"}) == {name: "v"}


@pytest.mark.parametrize("name", ["-i", "1A", "A=B", "A B", "", "A-B"])
def test_other_env_names_are_refused(name):
    with pytest.raises(ValueError, match="not an environment variable name"):
        values.env_map({name: "v"})


def test_kvpush_owns_the_instances_api_key_and_the_secret_file():
    with pytest.raises(ValueError, match="VLLM_API_KEY is set by kvpush"):
        values.env_map({"VLLM_API_KEY": "x"})
    for args in (["--api-key", "x"], ["--api-key=x"]):
        with pytest.raises(ValueError, match="--api-key is set by kvpush"):
            values.extra_args(args)
    assert values.extra_args(["--api-key-ish"]) == ["--api-key-ish"]
    with pytest.raises(ValueError, match="KVPUSH_INSTANCE_PUBLIC_PATHS is set by kvpush"):
        values.env_map({"KVPUSH_INSTANCE_PUBLIC_PATHS": "/"})
    for key in ("secret_file", "allowed_engines", "peer_side_channels", "side_channel_host", "side_channel_port"):
        assert values.kvpush_security_key_problem(key).startswith(f"{key} is set by kvpush")
    assert values.kvpush_security_key_problem("stream_writes") is None


@pytest.mark.parametrize("config,why", [({"a": float("inf")}, "finite"), ({"a": {"b": [float("nan")]}}, r"a\.b\[0\] is nan"),
                                        ({"a": {1: 2}}, "keys must be text"), ({"a": b"x"}, "is a bytes")])
def test_extra_config_takes_json_values_only(config, why):
    with pytest.raises(ValueError, match=why):
        values.extra_config(config)


@pytest.mark.parametrize("value", ["/a\nb", "/a\tb", "/a\x7fb", "/" + "a" * 5000])
def test_paths_refuse_control_characters_and_absurd_lengths(value):
    with pytest.raises(ValueError):
        values.path(value)


@pytest.mark.parametrize("text,field", [
    ("prefill: [{kv_cache_gib: 1.0e+26}]\ndecode: [{}]", "prefill[0].kv_cache_gib"),
    ("prefill: [{kv_cache_gib: 0.001}]\ndecode: [{}]", "prefill[0].kv_cache_gib"),
    ("prefill: [{kv_cache_gib: true}]\ndecode: [{}]", "prefill[0].kv_cache_gib"),
    ("prefill: [{kv_cache_gib: .nan}]\ndecode: [{}]", "prefill[0].kv_cache_gib"),
    ("connector: {transfer_timeout_s: .inf}\nprefill: [{}]\ndecode: [{}]", "connector.transfer_timeout_s"),
    ("router: {decode_timeout_s: .nan}\nprefill: [{}]\ndecode: [{}]", "router.decode_timeout_s"),
    ("prefill: [{tensor_parallel_size: 100000}]\ndecode: [{}]", "prefill[0].tensor_parallel_size"),
])
def test_numbers_must_be_finite_and_below_their_bounds(text, field):
    with pytest.raises(TopologyError, match=rf"<string>:\d+:\d+: {re.escape(field)}: "):
        parse_topology("name: t\nmodel: {path: /m}\n" + text)
