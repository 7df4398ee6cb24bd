"""The CLI as a user or a script runs it: exit codes, one-line errors, JSON. In the test process
(cli_in_process), but for the tests about the process itself: a real pipe, click's own usage errors."""
from __future__ import annotations

import json

import pytest

from cli_in_process import run_cli as kvpush
from cli_in_process import run_cli_process
from kvpush.templates import template_names


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
    assert run_cli_process("plan", "--nope").returncode == 2


def test_templates_json():
    result = kvpush("templates", "--json")
    names = {t["name"] for t in json.loads(result.stdout)}
    assert {"local-cpu", "p5en-1p1d", "xpyd"} <= names


def test_square_brackets_in_an_error_are_printed_as_written(tmp_path):
    path = tmp_path / "m.yaml"
    path.write_text('model: {path: /m}\nprefill: [{}]\ndecode: [{name: "a[/b]"}]\n')
    result = kvpush("plan", str(path))
    assert result.returncode == 2, result.stderr
    lines = [l for l in result.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and "'a[/b]' must be lowercase" in lines[0]


def test_square_brackets_in_a_plan_are_printed_as_written(tmp_path):
    path = tmp_path / "cfg[prod].yaml"
    path.write_text('model: {path: /m, extra_args: ["[/x]"]}\nprefill: [{env: {MY_OPT: "[bold]on"}}]\ndecode: [{}]\n')
    result = kvpush("plan", str(path))
    assert result.returncode == 0, result.stderr
    assert f"topology: {path}" in result.stderr
    assert "MY_OPT='[bold]on'" in result.stdout and "'[/x]'" in result.stdout


@pytest.mark.parametrize("args, message", [
    (["--layers", "0"], "make-model: --layers: Input should be greater than or equal to 1 (got 0)"),
    (["--hidden-size", "8"], "make-model: --hidden-size: Input should be greater than or equal to 32 (got 8)"),
    (["--heads", "3", "--kv-heads", "2"], "make-model: heads (3) must be a multiple of kv_heads (2)"),
], ids=["layers", "hidden size", "heads"])
def test_make_model_bad_options_are_one_line_exit_2(tmp_path, args, message):
    result = kvpush("make-model", str(tmp_path / "model"), *args)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "model").exists()


def test_make_model_refuses_a_file_as_its_directory(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("keep me")
    result = kvpush("make-model", str(path))
    assert result.returncode == 2 and f"{path}: is a file; give a directory" in result.stderr
    assert path.read_text() == "keep me"


@pytest.mark.parametrize("target, message", [
    ("nodir/x.yaml", "nodir: no such directory; create it first"),
    (".", ": is a directory; give a file path such as"),
], ids=["missing directory", "directory"])
def test_init_bad_path_is_one_line_exit_2(tmp_path, target, message):
    result = kvpush("init", target, cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("target, message", [(".", "is a directory"), ("/dev/null", "is not a regular file")],
                         ids=["directory", "device"])
def test_plan_of_something_not_a_file_says_what_it_is(tmp_path, target, message):
    result = kvpush("plan", target, cwd=tmp_path)
    assert result.returncode == 2 and message in result.stderr and "no such" not in result.stderr


def test_plan_shows_each_srun_line_and_the_sbatch_script_and_prints_a_standalone_script(tmp_path):
    assert kvpush("init", str(tmp_path / "s.yaml"), "--template", "slurm-cpu").returncode == 0
    shown = kvpush("plan", str(tmp_path / "s.yaml"))
    assert shown.returncode == 0, shown.stderr
    assert "srun srun --overlap --whole --nodes=1 --ntasks=1 --mpi=none --nodelist=n1 --job-name=prefill-0 bash -c" in shown.stdout
    assert "#SBATCH --nodelist=n1,n2" in shown.stdout and "exec sleep infinity" in shown.stdout
    script = kvpush("plan", str(tmp_path / "s.yaml"), "--slurm-script")
    assert script.returncode == 0 and script.stdout.startswith("#!/bin/bash\n#SBATCH --job-name=kvpush-slurm-cpu\n")
    assert json.loads(kvpush("plan", str(tmp_path / "s.yaml"), "--json").stdout)["slurm"]["steps"].keys() == {"prefill-0", "decode-0", "router"}
    assert kvpush("init", str(tmp_path / "l.yaml"), "--template", "local-cpu").returncode == 0
    refused = kvpush("plan", str(tmp_path / "l.yaml"), "--slurm-script")
    assert refused.returncode == 2 and refused.stderr.strip().startswith("error: --slurm-script: ") and "launcher ssh" in refused.stderr


def test_plan_into_a_pipe_has_plain_section_lines_and_whole_values(tmp_path):
    result = run_cli_process("plan", cwd=tmp_path)
    assert result.returncode == 0 and "…" not in result.stdout
    assert "== host local (127.0.0.1, local)  workdir ~/.kvpush/local-cpu" in result.stdout.splitlines()
    assert "    supervisor " in result.stdout and "-m kvpush.deploy.lifecycle.supervise --name prefill-0" in result.stdout


def test_plan_names_each_ssh_host_as_it_is_reached_with_a_port_only_where_the_topology_gives_one(tmp_path):
    path = tmp_path / "p.yaml"
    assert kvpush("init", str(path), "--template", "p5en-1p1d").returncode == 0
    without_port = kvpush("plan", str(path)).stdout
    assert "== host p5en-a (ubuntu@10.0.0.11, ssh)" in without_port and "None" not in without_port
    path.write_text(path.read_text().replace("address: 10.0.0.11", "address: 10.0.0.11, ssh_port: 2222", 1))
    assert "== host p5en-a (ubuntu@10.0.0.11:2222, ssh)" in kvpush("plan", str(path)).stdout

