"""One shell command that writes a file only its owner may read, its content on stdin.

Shared by `up` (through a runner) and the standalone Slurm script (as a job step), so a secret
file is written the same way wherever it goes.
"""
from __future__ import annotations

import shlex
from typing import Callable


def private_write_command(path: str, quote: Callable[[str], str] = shlex.quote) -> str:
    """Shell text writing stdin to path, mode 0600 from the first byte: umask 077 and mktemp make
    the file private before anything is in it; a rename puts it in place whole. `quote` turns a
    path into a shell word (runners.base.shell_word keeps a leading ~/ for the host's $HOME)."""
    directory = path.rsplit("/", 1)[0] or "/"
    return (f"umask 077 && mkdir -p {quote(directory)} && t=$(mktemp {quote(directory + '/.secret.XXXXXX')}) && "
            f"{{ cat >\"$t\" && mv -f \"$t\" {quote(path)}; }} || {{ rm -f \"$t\"; exit 1; }}")
