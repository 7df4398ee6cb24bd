"""Tables that stay readable at any terminal width, with every name and value whole.

A table is printed as a table where its columns fit the console with each word whole (cells wrap
at spaces). Where they cannot (status's eleven columns in an 80-column terminal), each row becomes
a block: its first cell on a line, then `header=value` pairs wrapped at the console's width. A
word is never shortened to `pre…`: where one is wider than the whole line, it folds onto the next.
"""
from __future__ import annotations

from typing import Iterable

from rich.console import Console, Group, RenderableType
from rich.measure import Measurement
from rich.padding import Padding
from rich.table import Table
from rich.text import Text

from .console import UNBOUNDED_WIDTH, out

PAIR_SEPARATOR = "   "
INDENT = 2


def table(*headers: str, title: str | None = None, right: Iterable[str] = ()) -> Table:
    """A table whose cells fold a word too long for its column instead of cutting it."""
    right = set(right)
    made = Table(title=title, title_justify="left") if title else Table()
    for header in headers:
        made.add_column(header, overflow="fold", justify="right" if header in right else "left")
    return made


def fits(made: Table, console: Console) -> bool:
    """Whether every column gets at least its longest word at the console's width."""
    # Measured without a width bound: rich clamps a measurement to the width it is given.
    return Measurement.get(console, console.options.update_width(UNBOUNDED_WIDTH), made).minimum <= console.width


def _text(cell: RenderableType) -> Text:
    return cell.copy() if isinstance(cell, Text) else Text(str(cell))


def row_blocks(made: Table) -> list[tuple[Text, Text]]:
    """Each row as its first cell (bold) and the other cells as `header=value` pairs on one text
    (`=`: a line is wrapped at spaces, and a header keeps its value on its own line)."""
    columns = made.columns
    cells = [list(c.cells) for c in columns]
    blocks = []
    for i in range(made.row_count):
        first = _text(cells[0][i])
        first.stylize("bold")
        pairs = Text()
        for j, column in enumerate(columns[1:], start=1):
            if j > 1:
                pairs.append(PAIR_SEPARATOR)
            pairs.append(f"{column.header}=", style="dim")
            pairs.append_text(_text(cells[j][i]))
        blocks.append((first, pairs))
    return blocks


def fitted(made: Table, console: Console = out) -> RenderableType:
    """The table where it fits; else a title line and one block per row (for a Live view too)."""
    if fits(made, console):
        return made
    parts: list[RenderableType] = [Text(str(made.title), style="italic")] if made.title else []
    for first, pairs in row_blocks(made):
        first.overflow = pairs.overflow = "fold"
        parts += [first, Padding(pairs, (0, 0, 0, INDENT))]
    return Group(*parts)


def print_table(made: Table, console: Console = out) -> None:
    console.print(fitted(made, console), highlight=False, soft_wrap=False)
