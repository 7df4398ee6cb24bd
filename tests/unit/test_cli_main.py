"""The entry point's error handling: one line on stderr, the right exit code, text printed as written."""
from __future__ import annotations

import pytest

from kvpush.cli import main
from kvpush.common.errors import UsageError


def _run_raising(monkeypatch, capsys, exc: Exception) -> tuple[int, str]:
    def app(args=None):
        raise exc

    monkeypatch.setattr(main, "app", app)
    with pytest.raises(SystemExit) as info:
        main.run(["plan"])
    return info.value.code, capsys.readouterr().err


def test_error_with_markup_like_text_is_printed_as_written(monkeypatch, capsys):
    code, stderr = _run_raising(monkeypatch, capsys, UsageError("hosts.a.user: 'ops[/x]' and [bold]on"))
    assert code == 2
    assert stderr.strip() == "error: hosts.a.user: 'ops[/x]' and [bold]on"


def test_unexpected_error_says_where_debug_goes(monkeypatch, capsys):
    code, stderr = _run_raising(monkeypatch, capsys, RuntimeError("boom [/tmp]"))
    assert code == 1
    assert "unexpected RuntimeError: boom [/tmp]" in stderr
    assert "rerun as `kvpush --debug <command> ...`" in stderr
