"""README's "Using it" shows the commands a cluster user looks for first, each as a line they can
run, and every command it shows exists."""
from __future__ import annotations

import re
from pathlib import Path

from kvpush.cli.main import app

README = Path(__file__).resolve().parents[2] / "README.md"


def _using_it_lines() -> list[str]:
    section = README.read_text().split("## Using it", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, re.DOTALL)
    assert block, "README's Using it has no bash block"
    return [line.split("#", 1)[0].strip() for line in block.group(1).splitlines() if line.startswith("kvpush")]


def test_using_it_shows_the_expected_commands():
    shown = {line.split()[1] for line in _using_it_lines()}
    for command in ("ls", "schema", "--install-completion", "monitor", "tunnel", "exec", "plan", "up", "status", "down"):
        assert command in shown, f"README's Using it does not show `kvpush {command}`"


def test_every_command_shown_exists():
    names = {c.name for c in app.registered_commands} | {"--install-completion", "--version"}
    assert {line.split()[1] for line in _using_it_lines()} <= names
