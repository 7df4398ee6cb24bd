"""Shared rendering: one console for tables and progress (stderr for messages, stdout for data).

Both consoles print strings literally (markup=False): names, paths, errors, argv and log lines
come from users and hosts, and '[...]' in them must neither style nor crash the output. Styling
is opt-in through `styled()` or rich Text.

Written to a pipe or a file (a script, a CI log), a console has no width to fit: tables and lines
come out at their full width, every name and value whole, instead of cells cut to `pre…`.
"""
from __future__ import annotations

import json
import sys
from typing import Any

from rich.console import Console, ConsoleDimensions
from rich.markup import escape
from rich.text import Text

UNBOUNDED_WIDTH = 100_000  # wider than any row: nothing is wrapped or cut


class _Console(Console):
    @property
    def size(self) -> ConsoleDimensions:
        size = super().size
        # Not a terminal: rich would use the width of whatever terminal stdin or stderr is on, or 80.
        return size if self.is_terminal else ConsoleDimensions(UNBOUNDED_WIDTH, size.height)

    @size.setter
    def size(self, new_size: tuple[int, int]) -> None:
        self.width, self.height = new_size  # what Console.size's own setter does


out = _Console(soft_wrap=True, markup=False)  # data: tables, JSON, plans
err = _Console(stderr=True, soft_wrap=True, markup=False)  # messages: progress, notes, errors


def heading(title: str) -> None:
    """A section title: a rule across a terminal, one plain line elsewhere."""
    if out.is_terminal:
        out.rule(title)
    else:
        out.print(f"== {title}", highlight=False)


def styled(template: str, *values: object) -> Text:
    """Our own Rich markup `template`, its {} filled with `values` shown literally."""
    return Text.from_markup(template.format(*(escape(str(v)) for v in values)))


def print_json(obj: Any, indent: int | None = 2) -> None:
    sys.stdout.write(json.dumps(obj, indent=indent, default=str) + "\n")
    sys.stdout.flush()


def note(message: str) -> None:
    err.print(Text(message, style="dim"), highlight=False)


def warn(message: str) -> None:
    """A warning: one line on stderr, the command goes on."""
    err.print(styled("[yellow]warning:[/yellow] {}", message), highlight=False)
