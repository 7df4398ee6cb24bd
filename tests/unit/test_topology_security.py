"""kvpush.deploy.topology.topology_security and the schema's security fields: the connector's security
entries stay kvpush's, secrets are given in one place, the instances' open paths are a known few."""
from __future__ import annotations

import pytest

from kvpush.deploy.topology.topology import TopologyError, load_topology

BASE = "model: {path: /m}\nprefill: [{}]\ndecode: [{}]\n"


def _load(tmp_path, text: str):
    path = tmp_path / "t.yaml"
    path.write_text(BASE + text)
    return load_topology(path)


@pytest.mark.parametrize("key,value", [("peer_side_channels", "null"), ("peer_side_channels", "{}"),
                                       ("allowed_engines", "[]"), ("secret_file", "/tmp/x"),
                                       ("side_channel_host", "0.0.0.0"), ("side_channel_port", "1")])
def test_the_connectors_security_entries_cannot_come_from_extra_config(tmp_path, key, value):
    with pytest.raises(TopologyError) as caught:
        _load(tmp_path, f"connector:\n  extra_config:\n    stream_writes: false\n    {key}: {value}\n")
    message = str(caught.value)
    assert message.startswith(f"{tmp_path / 't.yaml'}:7:") and "\n" not in message
    assert f": connector.extra_config.{key}: {key} is set by kvpush (" in message and message.endswith("; remove it")


def test_other_extra_config_entries_pass(tmp_path):
    topo = _load(tmp_path, "connector: {extra_config: {stream_writes: false, late_write_hold_s: 3}}\n")
    assert topo.connector.extra_config == {"stream_writes": False, "late_write_hold_s": 3}


@pytest.mark.parametrize("text,where,message", [
    ("env: {HF_TOKEN: x}\nsecrets: {HF_TOKEN: {env: H}}\n", "secrets.HF_TOKEN", "HF_TOKEN is also set by env.HF_TOKEN; keep it in secrets only"),
    ("secrets: {HF_TOKEN: {env: H}}\n", "secrets.HF_TOKEN", None),
    ("secrets: {VLLM_API_KEY: {env: H}}\n", "secrets.VLLM_API_KEY", "VLLM_API_KEY is set by kvpush"),
    ("secrets: {KVPUSH_INSTANCE_PUBLIC_PATHS: {env: H}}\n", "secrets.KVPUSH_INSTANCE_PUBLIC_PATHS", "is set by kvpush"),
    ("secrets: {'1BAD': {env: H}}\n", "secrets.1BAD", "is not an environment variable name"),
    ("secrets: {S: {}}\n", "secrets.S", "gives neither or both of env and file"),
    ("secrets: {S: {env: H, file: /f}}\n", "secrets.S", "gives neither or both of env and file"),
    ("secrets: {S: {env: 'not a name'}}\n", "secrets.S.env", "is not an environment variable name"),
    ("env: {KVPUSH_INSTANCE_PUBLIC_PATHS: /}\n", "env", "give the open paths in instance_public_paths"),
    ("instance_public_paths: [/health, /invocations]\n", "instance_public_paths[1]", "/health"),
])
def test_secret_and_open_path_mistakes_are_one_line_naming_the_field(tmp_path, text, where, message):
    if message is None:
        assert _load(tmp_path, text).secrets["HF_TOKEN"].env == "H"
        return
    with pytest.raises(TopologyError) as caught:
        _load(tmp_path, text)
    assert f": {where}: " in str(caught.value) and message in str(caught.value) and "\n" not in str(caught.value)


def test_an_instances_own_env_clashing_with_a_secret_is_named(tmp_path):
    path = tmp_path / "t.yaml"
    path.write_text("model: {path: /m}\nprefill: [{}]\ndecode: [{env: {T: x}}]\nsecrets: {T: {env: H}}\n")
    with pytest.raises(TopologyError, match=r":4:\d+: secrets\.T: T is also set by decode\[0\]\.env\.T; keep it in secrets only"):
        load_topology(path)


def test_open_paths_default_to_health_and_metrics(tmp_path):
    assert _load(tmp_path, "").instance_public_paths == ["/health", "/metrics"]
    assert _load(tmp_path, "instance_public_paths: []\n").instance_public_paths == []
