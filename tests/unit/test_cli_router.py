"""`kvpush router`'s bad input: one line and exit 2, before anything listens."""
from __future__ import annotations

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
