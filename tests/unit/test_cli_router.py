"""`kvpush router`'s bad input: one line and exit 2, before anything listens."""
from __future__ import annotations

import socket

import pytest

from cli_in_process import run_cli as kvpush


@pytest.mark.parametrize("args, message", [
    (["--log-level", "bogus"], "--log-level: unknown level 'bogus'; choose one of DEBUG, INFO"),
    (["--config", "."], ".: cannot read it (Is a directory); pass the router.json"),
], ids=["log level", "config is a directory"])
def test_bad_router_input_is_one_line_exit_2(tmp_path, args, message):
    result = kvpush("router", *args, cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_router_reads_its_topology_from_file_like_every_command(tmp_path):
    """The router of the --file topology is started: here its port is taken, which it says."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        (tmp_path / "t.yaml").write_text(f"model: {{path: /m}}\nprefill: [{{}}]\ndecode: [{{}}]\nrouter: {{port: {port}}}\n")
        result = kvpush("router", "--file", str(tmp_path / "t.yaml"), cwd=tmp_path)
    assert result.returncode == 1, result.stderr
    assert f"router: cannot listen on 127.0.0.1:{port}" in result.stderr


def test_router_takes_a_topology_or_a_config_not_both(tmp_path):
    result = kvpush("router", "--file", "t.yaml", "--config", "router.json", cwd=tmp_path)
    assert result.returncode == 2 and "give a topology (FILE or --file FILE) or --config FILE, not both" in result.stderr
