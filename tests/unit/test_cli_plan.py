"""The CLI in a subprocess, as a user or a script runs it: exit codes, one-line errors, JSON."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvpush.templates import template_names


def kvpush(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvpush.cli.main", *args], capture_output=True, text=True, cwd=cwd, timeout=60)


def test_help_lists_commands():
    result = kvpush("--help")
    assert result.returncode == 0
    for command in ("plan", "init", "templates", "make-model"):
        assert command in result.stdout


@pytest.mark.parametrize("name", template_names())
def test_plan_json_parses_for_each_template(tmp_path, name):
    assert kvpush("init", str(tmp_path / "t.yaml"), "--template", name).returncode == 0
    result = kvpush("plan", str(tmp_path / "t.yaml"), "--json")
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    assert plan["deployment"] == name
    assert plan["hosts"] and all(h["processes"] or h["files"] for h in plan["hosts"])


def test_plan_without_file_uses_builtin_default(tmp_path):
    result = kvpush("plan", cwd=tmp_path)
    assert result.returncode == 0
    assert "built-in local-cpu" in result.stderr
    assert "prefill-0" in result.stdout and "--kv-transfer-config" in result.stdout


def test_plan_prefers_kvpush_yaml_in_cwd(tmp_path):
    kvpush("init", str(tmp_path / "kvpush.yaml"), "--template", "xpyd")
    result = kvpush("plan", "--json", cwd=tmp_path)
    assert json.loads(result.stdout)["deployment"] == "xpyd"


def test_bad_topology_is_one_line_exit_2(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("model: {path: /m}\nprefill: [{}]\ndecode: [{htp_port: 1}]\n")
    result = kvpush("plan", str(path))
    assert result.returncode == 2
    lines = [l for l in result.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and f"{path}:3:" in lines[0] and "decode[0].htp_port" in lines[0]
    assert "Traceback" not in result.stderr


def test_missing_file_exit_2(tmp_path):
    result = kvpush("plan", str(tmp_path / "missing.yaml"))
    assert result.returncode == 2 and "kvpush init" in result.stderr


def test_init_refuses_to_overwrite_and_unknown_template(tmp_path):
    target = tmp_path / "k.yaml"
    assert kvpush("init", str(target)).returncode == 0
    again = kvpush("init", str(target))
    assert again.returncode == 2 and "--force" in again.stderr
    unknown = kvpush("init", str(tmp_path / "x.yaml"), "--template", "nope")
    assert unknown.returncode == 2 and "local-cpu" in unknown.stderr


def test_unknown_option_is_usage_error():
    assert kvpush("plan", "--nope").returncode == 2


def test_templates_json():
    result = kvpush("templates", "--json")
    names = {t["name"] for t in json.loads(result.stdout)}
    assert {"local-cpu", "p5en-1p1d", "xpyd"} <= names
