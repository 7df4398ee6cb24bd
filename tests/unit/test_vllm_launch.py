"""kvpush.deploy.plan.vllm_launch: what every vLLM instance is started with for its access control."""
from __future__ import annotations

import json

from kvpush.common.instance_auth import MIDDLEWARE_PATH
from kvpush.deploy.plan.plan import build_plan
from kvpush.deploy.topology.topology import parse_topology

BASE = "model: {path: /m, extra_args: [--middleware, my.Middleware]}\nprefill: [{}]\ndecode: [{extra_args: [--max-num-seqs, '4']}]\n"


def test_every_instance_loads_the_key_middleware_last_and_gets_its_open_paths():
    for connector in ("kvpush", "nixl-pull", "colocated"):
        text = BASE if connector != "colocated" else BASE.replace("prefill: [{}]\n", "")
        plan = build_plan(parse_topology(text + f"connector: {{type: {connector}}}\n"))
        for proc in plan.processes():
            if proc.role == "router":
                assert MIDDLEWARE_PATH not in proc.argv and "KVPUSH_INSTANCE_PUBLIC_PATHS" not in proc.env
                continue
            # Last: vLLM adds the middleware in argv order, the last added outermost, so the user's
            # own --middleware runs inside it.
            assert proc.argv[-2:] == ["--middleware", MIDDLEWARE_PATH], proc.argv
            assert proc.argv.index("my.Middleware") < len(proc.argv) - 2
            assert proc.env["KVPUSH_INSTANCE_PUBLIC_PATHS"] == "/health,/metrics"
            assert proc.env_file is not None and proc.env_file_names == ["VLLM_API_KEY"]


def test_the_open_paths_come_from_the_topology():
    plan = build_plan(parse_topology(BASE + "instance_public_paths: []\n"))
    assert {p.env.get("KVPUSH_INSTANCE_PUBLIC_PATHS") for p in plan.processes() if p.role != "router"} == {""}
    plan = build_plan(parse_topology(BASE + "instance_public_paths: [/health, /ping]\n"))
    assert plan.process("decode-0").env["KVPUSH_INSTANCE_PUBLIC_PATHS"] == "/health,/ping"


def test_kvpush_s_security_entries_win_over_extra_config_even_past_the_loader():
    topo = parse_topology(BASE)
    topo.connector.extra_config = {"peer_side_channels": None, "allowed_engines": [], "secret_file": "/x", "stream_writes": False}
    argv = build_plan(topo).process("decode-0").argv
    extra = json.loads(argv[argv.index("--kv-transfer-config") + 1])["kv_connector_extra_config"]
    assert extra["peer_side_channels"] == {"kvpush.prefill-0": "127.0.0.1:5600"} and extra["allowed_engines"] == ["kvpush.prefill-0"]
    assert extra["secret_file"] == "~/.kvpush/kvpush/deployment.secret" and extra["stream_writes"] is False
