"""Errors a user sees as one line. The CLI maps them to exit codes; nothing else prints them."""
from __future__ import annotations

import difflib
from typing import Any, Iterable, Mapping, Sequence


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


# pydantic's error types for a key the model does not have
UNKNOWN_FIELD_ERRORS = ("extra_forbidden", "unexpected_keyword_argument")


def validation_message(err: Mapping[str, Any], known_fields: Iterable[str] = ()) -> str:
    """One pydantic error (an item of ValidationError.errors()) as the words after its field's
    name: what is wrong, and the fix; an unknown field gets the known one it was likely meant to be."""
    kind = err["type"]
    if kind in UNKNOWN_FIELD_ERRORS:
        meant = (
            difflib.get_close_matches(str(err["loc"][-1]), list(known_fields), n=1, cutoff=0.75) if err["loc"] else []
        )
        return (
            f"is not a known field; did you mean '{meant[0]}'?"
            if meant
            else "is not a known field; check its spelling or remove it"
        )
    if kind == "missing":
        return "is required; add it"
    if kind == "literal_error":
        expected = err.get("ctx", {}).get("expected", "")
        return f"got {err.get('input')!r}, expected one of {expected}"
    msg = err["msg"]
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    return (
        f"{msg} (got {err.get('input')!r})"
        if "input" in err and not isinstance(err.get("input"), (dict, list))
        else msg
    )


def first_problem(errors: Sequence[Mapping[str, Any]]) -> Mapping[str, Any]:
    """The error to report of several: an unknown field first, since a misspelt key also makes the
    field it was meant to be "missing", and the misspelling is what to fix."""
    return next((e for e in errors if e["type"] in UNKNOWN_FIELD_ERRORS), errors[0])


def validation_problem(exc) -> str:
    """`field: what is wrong` for the first error of a pydantic ValidationError (no pydantic import here:
    the router loads this module on hosts where only the router runs)."""
    first = first_problem(exc.errors())
    return f"{field_path(tuple(first['loc']))}: {validation_message(first)}"
