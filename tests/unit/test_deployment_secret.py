"""kvpush.common.deployment_secret: the secret file's format, who may read it, and the keys made from it."""
from __future__ import annotations

import hashlib
import hmac
import os

import pytest

from kvpush.common import deployment_secret as ds


def _write(path, text: str, mode: int = 0o600):
    path.write_text(text)
    path.chmod(mode)
    return path


def test_a_new_secret_round_trips_through_its_file(tmp_path):
    secret = ds.new_secret()
    path = _write(tmp_path / "s", ds.secret_file_text(secret))
    assert len(secret) == ds.SECRET_BYTES and ds.read_secret(path) == secret
    assert ds.secret_file_text(secret) == f"kvpush-secret-v1 {secret.hex()}\n"
    assert ds.new_secret() != secret


def test_a_leading_tilde_is_this_users_home(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    secret = ds.new_secret()
    _write(tmp_path / "s", ds.secret_file_text(secret))
    assert ds.read_secret("~/s") == secret


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o644, 0o660])
def test_a_file_others_may_read_is_refused_with_the_fix(tmp_path, mode):
    path = _write(tmp_path / "s", ds.secret_file_text(ds.new_secret()), mode)
    with pytest.raises(ds.SecretFileError, match=f"readable by other users .*chmod 600 {path}"):
        ds.read_secret(path)


@pytest.mark.skipif(os.geteuid() != 0, reason="handing a file to another user needs root")
def test_a_file_of_another_user_is_refused(tmp_path):
    path = _write(tmp_path / "s", ds.secret_file_text(ds.new_secret()))
    os.chown(path, 1, 1)
    with pytest.raises(ds.SecretFileError, match="belongs to uid 1"):
        ds.read_secret(path)


def test_a_directory_or_fifo_or_missing_file_is_one_line(tmp_path):
    (tmp_path / "d").mkdir(mode=0o700)
    with pytest.raises(ds.SecretFileError, match="not a regular file"):
        ds.read_secret(tmp_path / "d")
    os.mkfifo(tmp_path / "f", 0o600)
    with pytest.raises(ds.SecretFileError, match="not a regular file"):  # and the open did not block
        ds.read_secret(tmp_path / "f")
    with pytest.raises(ds.SecretFileError, match="no such deployment secret file; `kvpush up` writes it"):
        ds.read_secret(tmp_path / "missing")


@pytest.mark.parametrize("text", ["", "kvpush-secret-v1", "kvpush-secret-v1 abcd", "kvpush-secret-v2 " + "00" * 32,
                                  "kvpush-secret-v1 " + "zz" * 32, "x " * 3000])
def test_anything_but_the_one_line_format_is_refused(tmp_path, text):
    path = _write(tmp_path / "s", text)
    with pytest.raises(ds.SecretFileError, match=f"{path}: .*"):
        ds.read_secret(path)


def test_keys_are_hmac_sha256_of_the_purpose_and_differ_per_purpose():
    secret = bytes(range(32))
    expected = hmac.new(secret, b"kvpush/side-channel", hashlib.sha256).digest()
    assert ds.derive_key(secret, ds.SIDE_CHANNEL) == expected
    assert ds.derive_token(secret, ds.INSTANCE_API_KEY) == hmac.new(secret, b"kvpush/instance-api-key", hashlib.sha256).hexdigest()
    assert ds.derive_key(secret, ds.SIDE_CHANNEL) != ds.derive_key(secret, ds.INSTANCE_API_KEY)
    assert ds.derive_key(secret, ds.SIDE_CHANNEL) != ds.derive_key(bytes(32), ds.SIDE_CHANNEL)
    assert len(ds.fingerprint(secret)) == 12 and ds.fingerprint(secret) not in secret.hex()
    with pytest.raises(ValueError):
        ds.derive_key(secret, "")


def test_a_key_file_gives_its_first_line(tmp_path):
    assert ds.read_key_file(_write(tmp_path / "k", "  the-key \nignored\n")) == "the-key"
    with pytest.raises(ds.SecretFileError, match="key file is empty"):
        ds.read_key_file(_write(tmp_path / "e", "\n\n"))
    with pytest.raises(ds.SecretFileError, match="larger than 4096 bytes"):
        ds.read_key_file(_write(tmp_path / "big", "k" * 5000))
    with pytest.raises(ds.SecretFileError, match="readable by other users"):
        ds.read_key_file(_write(tmp_path / "open", "k", 0o644))
