"""The options several commands share: the topology named by --file everywhere (and first where a
command has no other argument), and `logs`/`request` naming a topology given in their argument's
place."""
from __future__ import annotations

import json

from cli_in_process import run_cli as kvpush


def test_every_topology_command_takes_the_file_as_file_option_too(tmp_path):
    kvpush("init", str(tmp_path / "t.yaml"), "--template", "xpyd")
    by_option = kvpush("plan", "--file", str(tmp_path / "t.yaml"), "--json", cwd=tmp_path)
    assert by_option.returncode == 0, by_option.stderr
    assert json.loads(by_option.stdout)["deployment"] == "xpyd"
    both = kvpush("plan", "t.yaml", "--file", str(tmp_path / "t.yaml"), "--json", cwd=tmp_path)
    assert both.returncode == 0 and json.loads(both.stdout)["deployment"] == "xpyd"  # one file, named two ways
    for command in ("up", "down", "status", "provision", "doctor", "bench", "plan", "logs", "request", "router"):
        assert "--file" in kvpush(command, "--help").stdout, command


def test_two_different_topology_files_are_one_line_exit_2(tmp_path):
    kvpush("init", str(tmp_path / "a.yaml"), "--template", "xpyd")
    result = kvpush("plan", str(tmp_path / "a.yaml"), "--file", str(tmp_path / "b.yaml"))
    assert result.returncode == 2
    assert result.stderr.strip() == (f"error: the topology is given twice ({tmp_path / 'a.yaml'} and --file "
                                     f"{tmp_path / 'b.yaml'}); give one of them")


def test_a_topology_where_logs_or_request_take_their_argument_is_named_with_the_command_meant(tmp_path):
    kvpush("init", str(tmp_path / "my.yaml"), "--template", "local-cpu")
    for args, meant in [(("logs", "my.yaml", "decode"), "kvpush logs --file my.yaml decode"),
                        (("logs", "my.yaml"), "kvpush logs --file my.yaml PROCESS"),
                        (("request", "my.yaml"), "kvpush request --file my.yaml PROMPT"),
                        (("request", "my.yaml", "hello there"), "kvpush request --file my.yaml 'hello there'")]:
        result = kvpush(*args, cwd=tmp_path)
        assert result.returncode == 2, args
        assert result.stderr.strip() == f"error: my.yaml is a topology file; {args[0]} takes it as --file: {meant}"


def test_logs_and_request_take_one_argument(tmp_path):
    result = kvpush("request", "hello", "there", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip() == "error: request takes one PROMPT, got 2 arguments (hello there); quote it if it has spaces"
    assert kvpush("logs", "prefill", "decode", cwd=tmp_path).returncode == 2
