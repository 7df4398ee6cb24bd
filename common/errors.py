"""Errors a user sees as one line. The CLI maps them to exit codes; nothing else prints them."""
from __future__ import annotations


class KvpushError(Exception):
    """An operation failed (exit code 1). str() is the one-line message."""

    exit_code = 1


class UsageError(KvpushError):
    """Bad input: a flag, a file, a field (exit code 2)."""

    exit_code = 2


def field_path(loc: tuple) -> str:
    """('prefill', 0, 'http_port') -> 'prefill[0].http_port', as the user wrote the field."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(top level)"


def validation_message(err: dict) -> str:
    """One pydantic error (an item of ValidationError.errors()) as the words after its field's
    name: what is wrong, and the fix."""
    kind = err["type"]
    if kind in ("extra_forbidden", "unexpected_keyword_argument"):
        return "is not a known field; check its spelling or remove it"
    if kind == "missing":
        return "is required; add it"
    if kind == "literal_error":
        expected = err.get("ctx", {}).get("expected", "")
        return f"got {err.get('input')!r}, expected one of {expected}"
    msg = err["msg"]
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    return f"{msg} (got {err.get('input')!r})" if "input" in err and not isinstance(err.get("input"), (dict, list)) else msg


def validation_problem(exc) -> str:
    """`field: what is wrong` for the first error of a pydantic ValidationError (no pydantic import here:
    the router loads this module on hosts where only the router runs)."""
    first = exc.errors()[0]
    return f"{field_path(tuple(first['loc']))}: {validation_message(first)}"
