"""Shared rendering: one console for tables and progress (stderr for messages, stdout for data)."""
from __future__ import annotations

import json
import sys
from typing import Any

from rich.console import Console

out = Console(soft_wrap=True)  # data: tables, JSON, plans
err = Console(stderr=True, soft_wrap=True)  # messages: progress, notes, errors


def print_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, default=str) + "\n")
    sys.stdout.flush()


def note(message: str) -> None:
    err.print(f"[dim]{message}[/dim]", highlight=False)
