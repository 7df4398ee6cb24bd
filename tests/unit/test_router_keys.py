"""router/keys.py: the API keys from the environment or from an owner-only file."""
from __future__ import annotations

import pytest
from pydantic import ValidationError

from kvpush.common.errors import UsageError
from kvpush.router.config import RouterConfig, Upstream
from kvpush.router.keys import Keys, resolve_keys

D = Upstream(name="d0", url="http://127.0.0.1:1", engine_id="e", side_channel_host="127.0.0.1", side_channel_port=2)


def config(**keys) -> RouterConfig:
    return RouterConfig(protocol="colocated", served_model_name="m", decode=[D], **keys)


def key_file(tmp_path, text: str, mode: int = 0o600):
    path = tmp_path / "key"
    path.write_text(text)
    path.chmod(mode)
    return str(path)


def test_no_key_configured_means_no_check_and_nothing_sent():
    assert resolve_keys(config()) == Keys(None, None)


def test_keys_from_env_and_from_an_owner_only_file(tmp_path, monkeypatch):
    monkeypatch.setenv("ROUTER_KEY_T", "client-key")
    assert resolve_keys(config(api_key_env="ROUTER_KEY_T")) == Keys("client-key", "client-key")
    both = config(api_key_file=key_file(tmp_path, "file-key\n"), instance_api_key_env="ROUTER_KEY_T")
    assert resolve_keys(both) == Keys("file-key", "client-key")


@pytest.mark.parametrize("text,mode,message", [
    ("k", 0o640, "chmod 600"),
    ("k", 0o604, "chmod 600"),
    ("", 0o600, "the key file is empty"),
    ("two words", 0o600, "printable ASCII"),
    ("k\x01", 0o600, "printable ASCII"),
    ("k" * 5000, 0o600, "larger than 4096 bytes"),
])
def test_an_unsafe_or_unusable_key_file_is_one_line_naming_it(tmp_path, text, mode, message):
    path = key_file(tmp_path, text, mode)
    with pytest.raises(UsageError, match=message) as info:
        resolve_keys(config(api_key_file=path))
    assert path in str(info.value) and "\n" not in str(info.value)


def test_a_missing_key_file_or_unset_variable_is_a_usage_error(tmp_path, monkeypatch):
    with pytest.raises(UsageError, match="no such key file"):
        resolve_keys(config(api_key_file=str(tmp_path / "absent")))
    monkeypatch.delenv("ROUTER_KEY_UNSET", raising=False)
    with pytest.raises(UsageError, match="ROUTER_KEY_UNSET"):
        resolve_keys(config(instance_api_key_env="ROUTER_KEY_UNSET"))


def test_only_a_key_files_first_line_is_the_key(tmp_path):
    """Nothing after it can reach a header line (the file is the deployment's, kvpush writes one line)."""
    assert resolve_keys(config(api_key_file=key_file(tmp_path, "k\r\nX-Injected: 1"))).client == "k"


def test_one_source_per_key():
    with pytest.raises(ValidationError, match="not both"):
        config(api_key_env="A", api_key_file="/x")
