"""The deployment secret: what every process of one deployment shares and nobody else has.

`kvpush up` makes it (32 random bytes) and writes it, mode 0600, into the deployment's directory on
every host; processes get the path, never the value. A process derives the key it needs for one
purpose with `derive_key(secret, purpose)` (HMAC-SHA256 keyed by the secret over
"kvpush/<purpose>"), so a key that leaks (vLLM's API key sits in a process environment) reveals
neither the secret nor the keys for other purposes.

File format: one line, `kvpush-secret-v1 <64 hex digits>`, owned by the user that reads it and
readable by nobody else.

The connector, for example:

    secret = read_secret(extra_config["secret_file"])
    key = derive_key(secret, SIDE_CHANNEL)
"""
from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat

from .errors import KvpushError

FORMAT = "kvpush-secret-v1"
SECRET_BYTES = 32
MAX_FILE_BYTES = 4096  # a secret or key file is one short line; never read more

# Purposes: each names one use of a derived key. A new use gets a new purpose, never a shared one.
SIDE_CHANNEL = "side-channel"  # the connector's side-channel challenge-response
INSTANCE_API_KEY = "instance-api-key"  # vLLM's --api-key: what the router and kvpush send to the instances
FINGERPRINT = "fingerprint"  # a public name for the secret, safe to print
# The router signs each leg's kv_transfer_params with this key; the connector checks them (common/kv_params.py)
TRANSFER_PARAMS = "kv-transfer-params-v1"


class SecretFileError(KvpushError):
    """A secret or key file is missing, unreadable, too open or malformed; str() names the file and the fix."""


def new_secret() -> bytes:
    return secrets.token_bytes(SECRET_BYTES)


def secret_file_text(secret: bytes) -> str:
    """What a secret file holds."""
    if len(secret) != SECRET_BYTES:
        raise ValueError(f"a deployment secret is {SECRET_BYTES} bytes, not {len(secret)}")
    return f"{FORMAT} {secret.hex()}\n"


def parse_secret(text: str, source: str) -> bytes:
    parts = text.split()
    if len(parts) != 2 or parts[0] != FORMAT or len(parts[1]) != 2 * SECRET_BYTES:
        raise SecretFileError(
            f"{source}: not a kvpush deployment secret (expected one line '{FORMAT} <64 hex digits>'); "
            "make a new one with `kvpush up --rotate-secret`"
        )
    try:
        return bytes.fromhex(parts[1])
    except ValueError:
        raise SecretFileError(
            f"{source}: the deployment secret is not hex; make a new one with `kvpush up --rotate-secret`"
        ) from None


def read_private_text(
    path: str | os.PathLike, what: str = "secret file", missing_hint: str = "`kvpush up` writes it"
) -> str:
    """A small file only its owner may read (a leading ~ is expanded); SecretFileError otherwise."""
    shown = os.fspath(path)
    expanded = os.path.expanduser(shown)
    try:
        fd = os.open(expanded, os.O_RDONLY | os.O_NOCTTY | os.O_NONBLOCK)  # a FIFO must not block the open
    except FileNotFoundError:
        raise SecretFileError(f"{shown}: no such {what}; {missing_hint}") from None
    except OSError as exc:
        raise SecretFileError(f"{shown}: cannot open the {what} ({exc.strerror or exc})") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise SecretFileError(f"{shown}: the {what} is not a regular file; remove it and rerun `kvpush up`")
        if info.st_mode & 0o077:
            raise SecretFileError(
                f"{shown}: the {what} is readable by other users (mode {stat.S_IMODE(info.st_mode):04o}); "
                f"run `chmod 600 {shown}`, and rotate it if others may have read it"
            )
        if info.st_uid != os.geteuid():
            raise SecretFileError(
                f"{shown}: the {what} belongs to uid {info.st_uid}, not to this user ({os.geteuid()}); "
                "it must be this user's own file"
            )
        data = os.read(fd, MAX_FILE_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) > MAX_FILE_BYTES:
        raise SecretFileError(f"{shown}: the {what} is larger than {MAX_FILE_BYTES} bytes; it holds one short line")
    try:
        return data.decode("ascii")
    except UnicodeDecodeError:
        raise SecretFileError(f"{shown}: the {what} is not ASCII text") from None


def read_secret(path: str | os.PathLike) -> bytes:
    """The deployment secret in the file at `path` (a path on this host; a leading ~ is expanded)."""
    return parse_secret(read_private_text(path, "deployment secret file"), os.fspath(path))


def read_key_file(path: str | os.PathLike, missing_hint: str = "`kvpush up` writes it") -> str:
    """An API key: the file's first line, stripped; the file readable by its owner only."""
    lines = read_private_text(path, "key file", missing_hint).strip().splitlines()
    key = lines[0].strip() if lines else ""
    if not key:
        raise SecretFileError(f"{os.fspath(path)}: the key file is empty; put the key on its first line")
    return key


def derive_key(secret: bytes, purpose: str) -> bytes:
    """32 bytes for one purpose; the same secret and purpose give the same key on every host."""
    if not purpose:
        raise ValueError("a derived key needs a purpose")
    return hmac.new(secret, b"kvpush/" + purpose.encode(), hashlib.sha256).digest()


def derive_token(secret: bytes, purpose: str) -> str:
    """A derived key as text (64 hex digits), for places that take a string such as an API key."""
    return derive_key(secret, purpose).hex()


def fingerprint(secret: bytes) -> str:
    """A short public name for the secret: tells two secrets apart, reveals nothing of them."""
    return derive_token(secret, FINGERPRINT)[:12]
