"""Shared rendering: one console for tables and progress (stderr for messages, stdout for data).

Both consoles print strings literally (markup=False): names, paths, errors, argv and log lines
come from users and hosts, and '[...]' in them must neither style nor crash the output. Styling
is opt-in through `styled()` or rich Text.
"""
from __future__ import annotations

import json
import sys
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.text import Text

out = Console(soft_wrap=True, markup=False)  # data: tables, JSON, plans
err = Console(stderr=True, soft_wrap=True, markup=False)  # messages: progress, notes, errors


def styled(template: str, *values: object) -> Text:
    """Our own Rich markup `template`, its {} filled with `values` shown literally."""
    return Text.from_markup(template.format(*(escape(str(v)) for v in values)))


def print_json(obj: Any, indent: int | None = 2) -> None:
    sys.stdout.write(json.dumps(obj, indent=indent, default=str) + "\n")
    sys.stdout.flush()


def note(message: str) -> None:
    err.print(Text(message, style="dim"), highlight=False)
