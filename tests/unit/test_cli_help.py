"""The CLI's own help: an example in every command's help, --version, and shell completion that a
real bash completes with."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvpush.cli.main import app
from kvpush.deploy.lifecycle.host_probe import source_digest

KVPUSH = Path(sys.executable).parent / "kvpush"  # the console script, as a user's shell runs it
COMMANDS = sorted(c.name for c in app.registered_commands)


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PATH": f"{KVPUSH.parent}{os.pathsep}{os.environ.get('PATH', '')}", **extra}


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_s_help_shows_an_example_of_it(command):
    result = CliRunner().invoke(app, [command, "--help"], terminal_width=200)
    assert result.exit_code == 0, result.output
    examples = result.stdout.split("Examples:", 1)[1]
    assert re.search(rf"^\s*kvpush {re.escape(command)}(\s|$)", examples, re.M), examples


def test_help_keeps_a_paragraph_of_a_docstring_on_one_line():
    """typer's help keeps a docstring's line breaks; kvpush joins them so the help wraps at the terminal."""
    text = CliRunner().invoke(app, ["down", "--help"], env={"COLUMNS": "400"}).stdout
    assert "nothing is left, and remove the deployment's secret files from its hosts. The deployment secret kept" in text


def test_version_names_the_package_version_and_its_source_digest():
    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0
    assert re.fullmatch(r"kvpush \d+\.\d+\.\d+\S* \(source [0-9a-f]{16}\), Python 3\.\d+\.\d+\n", result.stdout)
    assert source_digest() in result.stdout


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_bash_completes_commands_and_options_with_the_script_kvpush_shows():
    script = subprocess.run([str(KVPUSH), "--show-completion", "bash"], capture_output=True, text=True, env=_env(), timeout=60)
    assert script.returncode == 0 and "complete -o default -F _kvpush_completion kvpush" in script.stdout, script.stderr
    cases = {"command": (["kvpush", "sta"], {"status"}), "option": (["kvpush", "status", "--wa"], {"--watch"}),
             "bench option": (["kvpush", "bench", "--no-engine"], {"--no-engine-timings"})}
    shell = script.stdout + "".join(
        f"\nCOMP_WORDS=({' '.join(words)}); COMP_CWORD={len(words) - 1}; _kvpush_completion kvpush; "
        f'echo "{name}: ${{COMPREPLY[*]}}"' for name, (words, _) in cases.items())
    result = subprocess.run(["bash", "--norc", "--noprofile", "-c", shell], capture_output=True, text=True, env=_env(), timeout=60)
    assert result.returncode == 0, result.stderr
    completed = {line.split(": ")[0]: set(line.split(": ", 1)[1].split()) for line in result.stdout.splitlines()}
    assert completed == {name: expected for name, (_, expected) in cases.items()}


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_install_completion_adds_the_script_to_the_users_bashrc(tmp_path):
    result = subprocess.run([str(KVPUSH), "--install-completion", "bash"], capture_output=True, text=True,
                            env=_env(HOME=str(tmp_path)), timeout=60)
    assert result.returncode == 0, result.stderr
    installed = tmp_path / ".bash_completions" / "kvpush.sh"
    assert "_kvpush_completion" in installed.read_text()
    assert str(installed) in (tmp_path / ".bashrc").read_text()
