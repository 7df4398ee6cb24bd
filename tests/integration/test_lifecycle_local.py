"""The same lifecycle on a `localhost` host: LocalRunner (subprocess + psutil), no SSH."""
from __future__ import annotations

import yaml

from kvpush.deploy.lifecycle.lifecycle import LifecycleOptions, down, up
from kvpush.deploy.lifecycle.observe import deployment_status, require_state
from kvpush.deploy.runners import SshOptions
from kvpush.deploy.lifecycle.state import load_state
from kvpush.deploy.topology.topology import parse_topology
from sshd_hosts import write_standin_python

from lifecycle_helpers import kill_leftovers, processes_under


def test_local_host_up_status_down(tmp_path, state_dir):
    python = write_standin_python(tmp_path / "standin-python")
    topo = parse_topology(yaml.safe_dump({
        "name": "loc", "model": {"path": "/nonexistent", "served_name": "tiny"}, "connector": {"type": "nixl-pull"},
        "hosts": {"local": {"address": "127.0.0.1", "python": str(python), "workdir": str(tmp_path / "work")}},
        "prefill": [{"http_port": 19600, "side_channel_port": 19601}],
        "decode": [{"http_port": 19602, "side_channel_port": 19603}],
        "router": {"port": 19604},
    }))
    assert topo.hosts["local"].is_local
    opts = LifecycleOptions(ssh=SshOptions(known_hosts=str(tmp_path / "none")), provision=False, doctor=False, ready_timeout_s=30)
    try:
        result = up(topo, opts)
        assert result.proof.external_kv_tokens > 0
        assert all(r.healthy for r in deployment_status(require_state("loc"), opts.ssh))
        assert up(topo, opts).changes.nothing_to_do
        assert sorted(down("loc", opts).stopped) == ["decode-0", "prefill-0", "router"]
        assert load_state("loc") is None and processes_under(str(python)) == []
    finally:
        down("loc", opts)
        assert kill_leftovers(str(python)) == []
