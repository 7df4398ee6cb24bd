"""Errors a user sees as one line. The CLI maps them to exit codes; nothing else prints them."""
from __future__ import annotations


class KvpushError(Exception):
    """An operation failed (exit code 1). str() is the one-line message."""

    exit_code = 1


class UsageError(KvpushError):
    """Bad input: a flag, a file, a field (exit code 2)."""

    exit_code = 2
