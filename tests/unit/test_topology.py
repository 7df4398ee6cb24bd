"""Topology validation: every mistake gives one line naming file:line:col and the field."""
from __future__ import annotations


import pytest

from kvpush.deploy.topology.topology import TopologyError, check_key_files, load_topology, parse_topology, side_channel_ports

MINIMAL = """\
model:
  path: /models/tiny
prefill:
  - {}
decode:
  - {}
"""


def test_minimal_file_gets_sensible_defaults():
    topo = parse_topology(MINIMAL)
    assert topo.connector.type == "kvpush"
    assert list(topo.hosts) == ["local"]
    (p,), (d,) = topo.prefill, topo.decode
    assert (p.name, p.host, p.http_port) == ("prefill-0", "local", 8100)
    assert (d.name, d.host, d.http_port) == ("decode-0", "local", 8200)
    assert p.side_channel_port != d.side_channel_port
    assert topo.router.host == "local" and topo.router.bind == "127.0.0.1"


def test_default_side_channel_ports_leave_room_for_parallel_ranks():
    topo = parse_topology(
        """
platform: cuda
model: {path: /m}
prefill: [{devices: [0, 1, 2, 3], tensor_parallel_size: 4}]
decode: [{devices: [4, 5, 6, 7], tensor_parallel_size: 4}]
"""
    )
    p_ports = set(side_channel_ports(topo.prefill[0]))
    d_ports = set(side_channel_ports(topo.decode[0]))
    assert len(p_ports) == 4 and not p_ports & d_ports


# (name, yaml text, expected line, field text that must appear, phrase that must appear)
BAD_FILES = [
    ("yaml syntax", "model: {path: /m\nprefill: [}\n", 2, "invalid YAML", "fix the syntax"),
    ("duplicate key", "model: {path: /m}\nmodel: {path: /n}\n", 2, "duplicate key 'model'", "once"),
    ("not a mapping", "- a\n- b\n", 1, "YAML mapping", "kvpush init"),
    ("missing model", "prefill: [{}]\ndecode: [{}]\n", 1, "model", "is required"),
    ("missing model path", "model: {served_name: x}\nprefill: [{}]\ndecode: [{}]\n", 1, "model.path", "is required"),
    ("typo in field", MINIMAL + "routr: {port: 1}\n", 7, "routr", "not a known field"),
    ("typo in nested field", MINIMAL.replace("  - {}\ndecode", "  - {htp_port: 9000}\ndecode"), 4, "prefill[0].htp_port", "not a known field"),
    ("typo names the field meant", MINIMAL + "router: {prot: 1}\n", 7, "router.prot", "is not a known field; did you mean 'port'?"),
    ("misspelt required field", MINIMAL + "hosts:\n  local: {adress: 127.0.0.1}\n", 8, "hosts.local.adress",
     "did you mean 'address'?"),
    ("bad connector type", MINIMAL + "connector: {type: mooncake}\n", 7, "connector.type", "'kvpush'"),
    ("bad backend", MINIMAL + "connector: {backend: RDMA}\n", 7, "connector.backend", "'UCX'"),
    ("port out of range", MINIMAL.replace("  - {}\ndecode", "  - {http_port: 70000}\ndecode"), 4, "prefill[0].http_port", "65535"),
    ("port not a number", MINIMAL + "router: {port: eighty}\n", 7, "router.port", "integer"),
    ("no decode instances", "model: {path: /m}\nprefill: [{}]\n", 1, "decode", "at least one decode"),
    ("empty prefill list", "model: {path: /m}\nprefill: []\ndecode: [{}]\n", 2, "prefill", "at least one prefill"),
    ("unknown host", MINIMAL.replace("  - {}\ndecode", "  - {host: gpu9}\ndecode"), 4, "prefill[0].host", "unknown host 'gpu9'"),
    ("same http port twice", MINIMAL.replace("  - {}\ndecode:\n  - {}", "  - {http_port: 9000}\ndecode:\n  - {http_port: 9000}"), 6, "decode[0].http_port", "port 9000"),
    ("router port collides", MINIMAL + "router: {port: 8100}\n", 7, "router.port", "prefill-0 HTTP"),
    ("side channel collides with http", MINIMAL.replace("  - {}\ndecode", "  - {side_channel_port: 8200}\ndecode"), 4, "prefill[0].side_channel_port", "decode-0 HTTP"),
    ("dp rank side channel collides", """platform: cuda
model: {path: /m}
prefill:
  - {devices: [0, 1], data_parallel_size: 2, side_channel_port: 6000}
  - {devices: [2, 3], data_parallel_size: 2, side_channel_port: 6001}
decode: [{devices: [4]}]
""", 5, "prefill[1].side_channel_port", "rank"),
    ("device given twice", """platform: cuda
model: {path: /m}
prefill: [{devices: [1]}]
decode: [{devices: [1]}]
""", 4, "decode[0].devices", "GPU 1"),
    ("tp does not fit devices", """platform: cuda
model: {path: /m}
prefill: [{devices: [0, 1, 2], tensor_parallel_size: 4}]
decode: [{devices: [4, 5, 6, 7], tensor_parallel_size: 4}]
""", 3, "prefill[0].devices", "list exactly 4"),
    ("gpu devices on cpu platform", MINIMAL.replace("  - {}\ndecode", "  - {devices: [0]}\ndecode"), 4, "prefill[0].devices", "platform: cuda"),
    ("core given twice", MINIMAL.replace("  - {}\ndecode:\n  - {}", "  - {cpu_cores: '0-1'}\ndecode:\n  - {cpu_cores: '1'}"), 6, "decode[0].cpu_cores", "core 1"),
    ("bad core list", MINIMAL.replace("  - {}\ndecode", "  - {cpu_cores: 'zero'}\ndecode"), 4, "prefill[0].cpu_cores", "core list"),
    ("bad router core list", MINIMAL + "router: {cpu_cores: '1-'}\n", 7, "router.cpu_cores", "core list"),
    ("no router workers", MINIMAL + "router: {workers: 0}\n", 7, "router.workers", "greater than or equal to 1"),
    ("duplicate instance name", MINIMAL.replace("  - {}\ndecode:\n  - {}", "  - {name: a}\ndecode:\n  - {name: a}"), 6, "decode[0].name", "already used"),
    ("router without host among many", """model: {path: /m}
hosts:
  a: {address: 10.0.0.1}
  b: {address: 10.0.0.2}
prefill: [{host: a}]
decode: [{host: b}]
""", 1, "router", "names no host"),
    ("instance without host among many", """model: {path: /m}
hosts:
  a: {address: 10.0.0.1}
  b: {address: 10.0.0.2}
prefill: [{}]
decode: [{host: b}]
router: {host: a}
""", 5, "prefill[0]", "names no host"),
    ("tp size does not split the kv heads", """platform: cuda
model: {path: /m, kv_heads: 8}
prefill: [{devices: [0, 1], tensor_parallel_size: 2}]
decode: [{devices: [2, 3, 4], tensor_parallel_size: 3}]
""", 4, "decode[0].tensor_parallel_size", "decode-0 uses TP size 3 but the model has 8 KV heads"),
    ("upstream connector with tp sizes it cannot pair", """platform: cuda
model: {path: /m, kv_heads: 24}
connector: {type: nixl-pull}
prefill: [{devices: [0, 1, 2, 3, 4, 5, 6, 7], tensor_parallel_size: 8}]
decode: [{devices: [8, 9, 10], tensor_parallel_size: 3}]
""", 5, "decode[0].tensor_parallel_size",
     "decode-0 with prefill prefill-0: vLLM's NixlConnector pairs TP sizes only when one divides the other (prefill TP 8, decode TP 3)"),
    ("one core list for two ranks", MINIMAL.replace("  - {}\ndecode", "  - {cpu_cores: '0-1', tensor_parallel_size: 2}\ndecode"),
     4, "prefill[0].cpu_cores", "gives 1 core list(s) for 2 TP rank(s); give one per rank, '|'-separated, e.g. '0|1'"),
    ("instances share cores unasked", MINIMAL.replace("  - {}\ndecode:\n  - {}",
                                                      "  - {cpu_cores: '0|1', tensor_parallel_size: 2, share_cores: true}\n"
                                                      "decode:\n  - {cpu_cores: '0|1', tensor_parallel_size: 2}"),
     6, "decode[0].cpu_cores", "core 0 on host 'local' is also given to prefill[0] (prefill-0); give each instance and rank its own cores, or set share_cores: true"),
    ("two ranks on one core", MINIMAL.replace("  - {}\ndecode", "  - {cpu_cores: '0|0', tensor_parallel_size: 2}\ndecode"),
     4, "prefill[0].cpu_cores", "core 0 on host 'local' is also given to its rank 0"),
    ("empty rank core list", MINIMAL.replace("  - {}\ndecode", "  - {cpu_cores: '0|', tensor_parallel_size: 2}\ndecode"),
     4, "prefill[0].cpu_cores", "empty rank core list"),
    ("data parallel on cpu", MINIMAL.replace("  - {}\ndecode", "  - {data_parallel_size: 2}\ndecode"),
     4, "prefill[0].data_parallel_size", "set data_parallel_size: 1"),
    ("per-rank lists for the router", MINIMAL + "router: {cpu_cores: '0|1'}\n", 7, "router.cpu_cores", "one core list like"),
    ("libfabric on cpu", MINIMAL + "connector: {backend: LIBFABRIC}\n", 7, "connector.backend", "UCX"),
    ("bad deployment name", "name: My_Deploy\n" + MINIMAL, 1, "name", "lowercase"),
    ("bad dtype", MINIMAL.replace("path: /models/tiny", "path: /models/tiny\n  dtype: fp8"), 3, "model.dtype", "'bfloat16'"),
    ("host ssh port zero", MINIMAL + "hosts: {local: {address: 127.0.0.1, ssh_port: 0}}\n", 7, "hosts.local.ssh_port", "greater than or equal to 1"),
    ("core number too high", MINIMAL.replace("  - {}\ndecode", "  - {cpu_cores: '4090-4096'}\ndecode"), 4, "prefill[0].cpu_cores", "above 4095"),
    ("instance named router", MINIMAL.replace("  - {}\ndecode", "  - {name: router}\ndecode"), 4, "prefill[0].name", "router process"),
    ("empty host address", MINIMAL + "hosts: {local: {address: ''}}\n", 7, "hosts.local.address", "is empty; give the host's IP address"),
    ("empty model path", MINIMAL.replace("path: /models/tiny", "path: ''"), 2, "model.path", "is empty; give the model directory"),
    ("empty workdir", MINIMAL + "hosts: {local: {address: 127.0.0.1, workdir: ' '}}\n", 7, "hosts.local.workdir", "is empty"),
    ("list as a key", MINIMAL + "? [a, b]\n: 1\n", 7, "list or mapping used as a key", "plain names"),
    ("boolean port", MINIMAL + "router: {port: true}\n", 7, "router.port", "true/false, not a number"),
    ("boolean core list", MINIMAL.replace("  - {}\ndecode", "  - {cpu_cores: true}\ndecode"), 4, "prefill[0].cpu_cores", "true/false, not a core list"),
    ("boolean device", "platform: cuda\nmodel: {path: /m}\nprefill: [{devices: [true]}]\ndecode: [{devices: [2]}]\n", 3, "prefill[0].devices[0]", "true/false"),
    ("no hosts", MINIMAL + "hosts: {}\n", 7, "hosts", "defines no hosts"),
    ("tp size against the tiny model's heads", MINIMAL.replace("path: /models/tiny", "path: /models/tiny\n  tiny: {heads: 8, kv_heads: 4}")
     .replace("  - {}\ndecode", "  - {tensor_parallel_size: 3, cpu_cores: '0|1|2'}\ndecode"), 5, "prefill[0].tensor_parallel_size",
     "prefill-0 uses TP size 3 but the model has 4 KV heads"),
    ("tiny model heads", MINIMAL.replace("path: /models/tiny", "path: /models/tiny\n  tiny: {heads: 3, kv_heads: 2}"), 3, "model.tiny", "multiple of kv_heads"),
    ("prefill on a core of a tp decode rank", MINIMAL.replace("  - {}\ndecode:\n  - {}",
                                                             "  - {cpu_cores: '1'}\ndecode:\n  - {cpu_cores: '0|1', tensor_parallel_size: 2}"),
     6, "decode[0].cpu_cores", "core 1 on host 'local' is also given to prefill[0] (prefill-0); give each instance and rank its own "
     "cores, or set share_cores: true on every instance that shares them (prefill prefill-0 would share it with rank 1 of decode "
     "decode-0 (TP 2), which it writes KV into: decode's ranks spin in every layer's all-reduce"),
    ("unpinned prefill beside a tp decode", MINIMAL.replace("  - {}\ndecode:\n  - {}",
                                                           "  - {}\ndecode:\n  - {cpu_cores: '0|1', tensor_parallel_size: 2}"),
     4, "prefill[0]", "prefill-0 has no cpu_cores, so on host 'local' prefill prefill-0 and the ranks of decode decode-0 (TP 2), "
     "which it writes KV into, may share core 0, which rank 0 of decode decode-0 (TP 2) runs on"),
    ("unpinned tp decode beside a prefill", MINIMAL.replace("  - {}\ndecode:\n  - {}",
                                                           "  - {cpu_cores: '1'}\ndecode:\n  - {tensor_parallel_size: 2}"),
     6, "decode[0]", "decode-0 has no cpu_cores, so on host 'local' prefill prefill-0 and the ranks of decode decode-0 (TP 2), "
     "which it writes KV into, may share core 1, which prefill prefill-0 runs on"),
    ("neither pinned beside a tp decode", MINIMAL.replace("  - {}\ndecode:\n  - {}",
                                                         "  - {}\ndecode:\n  - {tensor_parallel_size: 2, share_cores: true}"),
     4, "prefill[0]", "may share any core: decode's ranks spin in every layer's all-reduce waiting for each other, so a prefill "
     "on one of their cores can keep a rank from running until decode gives up; give both cpu_cores of their own, or set "
     "share_cores: true on both"),
]


@pytest.mark.parametrize("name,text,line,field,phrase", BAD_FILES, ids=[b[0] for b in BAD_FILES])
def test_bad_topology_names_line_and_field(tmp_path, name, text, line, field, phrase):
    path = tmp_path / "topo.yaml"
    path.write_text(text)
    with pytest.raises(TopologyError) as info:
        load_topology(path)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"{path}:{line}:"), message
    assert field in message, message
    assert phrase in message, message


def test_missing_file_says_how_to_create_one(tmp_path):
    with pytest.raises(TopologyError, match="kvpush init"):
        load_topology(tmp_path / "nope.yaml")


@pytest.mark.parametrize("make, phrase", [
    (lambda p: p.mkdir(), "is a directory"),
    (lambda p: p.write_bytes(b"model: {path: /m\xff}\n"), "not UTF-8"),
], ids=["directory", "not utf-8"])
def test_unreadable_topology_file_is_one_line(tmp_path, make, phrase):
    path = tmp_path / "topo.yaml"
    make(path)
    with pytest.raises(TopologyError, match=phrase) as info:
        load_topology(path)
    assert str(info.value).startswith(f"{path}: ") and "\n" not in str(info.value)


def test_device_file_is_not_called_missing():
    with pytest.raises(TopologyError, match="/dev/null: is not a regular file"):
        load_topology("/dev/null")


def test_prefill_and_decode_may_use_different_tp_sizes_that_split_the_heads():
    topo = parse_topology("""platform: cuda
model: {path: /m, kv_heads: 8}
prefill: [{devices: [0, 1]}, {devices: [2, 3, 4, 5], tensor_parallel_size: 4}]
decode: [{devices: [6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], tensor_parallel_size: 16}]
""".replace("[0, 1]}", "[0], tensor_parallel_size: 1}"))
    assert [s.tensor_parallel_size for _, _, s in topo.instances()] == [1, 4, 16]


def test_instances_that_ask_share_cores_and_each_rank_gets_its_list():
    topo = parse_topology(MINIMAL.replace("  - {}\ndecode:\n  - {}",
                                          "  - {cpu_cores: '0|1', tensor_parallel_size: 2, share_cores: true}\n"
                                          "decode:\n  - {cpu_cores: '0-1', share_cores: true}"))
    assert [s.cpu_cores for _, _, s in topo.instances()] == ["0|1", "0-1"]
    # kvpush's connector listens once per TP rank; vLLM's NIXL connectors once per instance
    assert side_channel_ports(topo.prefill[0]) == [5600, 5601]
    assert side_channel_ports(topo.prefill[0], "nixl-pull") == [5600]


@pytest.mark.parametrize("instances", [
    "  - {share_cores: true}\ndecode:\n  - {tensor_parallel_size: 2, share_cores: true}",  # asked for
    "  - {cpu_cores: '1', share_cores: true}\ndecode:\n  - {cpu_cores: '0|1', tensor_parallel_size: 2, share_cores: true}",
    "  - {host: other}\ndecode:\n  - {host: local, tensor_parallel_size: 2}",  # another host
    "  - {}\ndecode:\n  - {}",  # a TP 1 decode has no all-reduce to spin in
    "  - {cpu_cores: '2'}\ndecode:\n  - {cpu_cores: '0|1', tensor_parallel_size: 2}",  # cores of their own
], ids=["share_cores", "pinned share_cores", "other host", "tp1 decode", "own cores"])
def test_a_prefill_may_run_beside_a_tp_decode_on_its_own_cores_or_when_asked(instances):
    hosts = ("hosts:\n  local: {address: 127.0.0.1}\n  other: {address: 127.0.0.2}\nrouter: {host: local}\n"
             if "other" in instances else "")
    parse_topology(MINIMAL.replace("  - {}\ndecode:\n  - {}", instances) + hosts)


def test_unquoted_core_number_is_a_core_list():
    topo = parse_topology(MINIMAL.replace("  - {}\ndecode", "  - {cpu_cores: 3}\ndecode"))
    assert topo.prefill[0].cpu_cores == "3"


@pytest.mark.parametrize("key_name, phrase", [
    ("missing", "hosts.gpu.key: {key}: no such file; give the private key path"),
    ("id_ed25519.pub", "hosts.gpu.key: {key}: is the public key; give the private key path (without .pub)"),
], ids=["missing", "public key"])
def test_key_files_are_checked_before_connecting(tmp_path, key_name, phrase):
    key = tmp_path / key_name
    if key_name.endswith(".pub"):
        key.write_text("ssh-ed25519 AAAA")
    topo = parse_topology(MINIMAL + f"hosts: {{gpu: {{address: 10.0.0.9, key: '{key}'}}}}\n")  # loading does not look
    with pytest.raises(TopologyError) as info:
        check_key_files(topo)
    assert str(info.value) == phrase.format(key=key)


def test_existing_private_key_passes(tmp_path):
    (tmp_path / "id").write_text("private")
    check_key_files(parse_topology(MINIMAL + f"hosts: {{gpu: {{address: 10.0.0.9, key: '{tmp_path / 'id'}'}}}}\n"))


def test_env_values_become_strings():
    topo = parse_topology(MINIMAL + "env: {A: 1, B: true, C: null}\n")
    assert topo.env == {"A": "1", "B": "true", "C": ""}


def test_colocated_needs_no_prefill():
    topo = parse_topology("model: {path: /m}\nconnector: {type: colocated}\ndecode: [{}, {}]\n")
    assert [d.http_port for d in topo.decode] == [8200, 8201]


def test_kvpush_pairs_tp_sizes_that_only_split_the_heads():
    """Prefill TP 8 -> decode TP 3 over 24 KV heads: kvpush re-shards; only vLLM's own connectors refuse it."""
    topo = parse_topology("""platform: cuda
model: {path: /m, kv_heads: 24}
prefill: [{devices: [0, 1, 2, 3, 4, 5, 6, 7], tensor_parallel_size: 8}]
decode: [{devices: [8, 9, 10], tensor_parallel_size: 3}]
""")
    assert [s.tensor_parallel_size for _, _, s in topo.instances()] == [8, 3]


def test_bad_file_count_meets_the_bar():
    assert len({b[0] for b in BAD_FILES}) >= 15


@pytest.mark.parametrize("written, policy", [("on-failure", "on-failure"), ("no", "never"), ("never", "never"),
                                             ("{policy: on-failure, max_restarts: 5, window_s: 60}", "on-failure")])
def test_restart_policy_takes_a_word_or_a_mapping(written, policy):
    topo = parse_topology(MINIMAL.replace("prefill:\n  - {}", f"prefill:\n  - {{restart: {written}}}"))
    assert topo.prefill[0].restart.policy == policy and topo.decode[0].restart.policy == "never"


def test_unknown_restart_policy_names_the_field():
    text = MINIMAL.replace("prefill:\n  - {}", "prefill:\n  - {restart: always}")
    with pytest.raises(TopologyError, match=r"<string>:\d+:\d+: prefill\[0\]\.restart\.policy: got 'always', expected one of 'never' or 'on-failure'"):
        parse_topology(text)
