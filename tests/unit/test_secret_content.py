"""kvpush.deploy.lifecycle.secret_content: the secret files a standalone Slurm job derives for itself."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvpush.common import deployment_secret as ds
from kvpush.common.errors import KvpushError, UsageError
from kvpush.deploy.lifecycle.secret_content import content, main


@pytest.fixture
def secret_file(tmp_path):
    path = tmp_path / "secret"
    path.write_bytes(content("new", None))
    path.chmod(0o600)
    return path


def test_new_is_a_fresh_secret_each_time(secret_file):
    assert ds.read_secret(secret_file) != ds.parse_secret(content("new", None).decode(), "x")


def test_each_kind_is_derived_from_the_secret_as_up_derives_it(secret_file, monkeypatch):
    secret = ds.read_secret(secret_file)
    key = ds.derive_token(secret, ds.INSTANCE_API_KEY)
    assert content("deployment-secret", str(secret_file)) == secret_file.read_bytes()
    assert content("instance-env", str(secret_file)) == f"VLLM_API_KEY={key}\n".encode()
    assert content("router-upstream-key", str(secret_file)) == f"{key}\n".encode()
    monkeypatch.setenv("THE_KEY", " client-key \n")
    assert content("router-client-key", str(secret_file), client_key_env="THE_KEY") == b"client-key\n"


def test_the_client_key_file_is_read_when_it_runs(secret_file, tmp_path):
    key_file = tmp_path / "client.key"
    with pytest.raises(UsageError, match=r"^router.api_key_file: .*client.key: no such key file; give the path of a file the job's first node"):
        content("router-client-key", str(secret_file), client_key_file=str(key_file))
    key_file.write_text("from-the-file\n")
    key_file.chmod(0o600)
    assert content("router-client-key", str(secret_file), client_key_file=str(key_file)) == b"from-the-file\n"


def test_bad_input_is_one_line_naming_what_to_fix(secret_file, monkeypatch):
    monkeypatch.delenv("UNSET_KEY", raising=False)
    with pytest.raises(UsageError, match=r"^router.api_key_env: UNSET_KEY is unset or empty in the job's environment; export it before `sbatch`"):
        content("router-client-key", str(secret_file), client_key_env="UNSET_KEY")
    with pytest.raises(KvpushError, match=r"^router-client-key: needs --client-key-env or --client-key-file"):
        content("router-client-key", str(secret_file))
    with pytest.raises(KvpushError, match=r"^bogus: not a secret file kind; kinds are new, deployment-secret"):
        content("bogus", str(secret_file))
    with pytest.raises(KvpushError, match=r"^instance-env: needs --secret"):
        content("instance-env", None)
    secret_file.chmod(0o644)
    with pytest.raises(ds.SecretFileError, match="readable by other users"):
        content("instance-env", str(secret_file))


def test_run_as_a_module_it_prints_the_file_or_one_error_line(secret_file, capsys):
    assert main(["router-upstream-key", "--secret", str(secret_file)]) == 0
    assert capsys.readouterr().out == content("router-upstream-key", str(secret_file)).decode()
    env = {k: v for k, v in os.environ.items() if k != "NOT_SET_ANYWHERE"}
    ran = subprocess.run([sys.executable, "-m", "kvpush.deploy.lifecycle.secret_content", "router-client-key", "--secret", str(secret_file),
                          "--client-key-env", "NOT_SET_ANYWHERE"], env=env, capture_output=True, text=True)
    assert ran.returncode == 1 and ran.stdout == ""
    assert ran.stderr.splitlines() == ["kvpush: router.api_key_env: NOT_SET_ANYWHERE is unset or empty in the job's "
                                       "environment; export it before `sbatch` (the job takes the submitter's environment)"]


def test_instance_env_carries_the_topologys_secrets_read_in_the_job(secret_file, tmp_path, monkeypatch):
    secret = ds.read_secret(secret_file)
    key = ds.derive_token(secret, ds.INSTANCE_API_KEY)
    monkeypatch.setenv("JOB_HF", "from the job's environment")
    value_file = tmp_path / "db"
    value_file.write_text("from-a-file\n")
    value_file.chmod(0o600)
    made = content("instance-env", str(secret_file), user_secrets=["HF_TOKEN=env:JOB_HF", f"DB=file:{value_file}"])
    assert made == f"VLLM_API_KEY={key}\nDB=from-a-file\nHF_TOKEN='from the job'\"'\"'s environment'\n".encode()
    monkeypatch.delenv("JOB_HF")
    with pytest.raises(UsageError, match=r"^secrets\.HF_TOKEN: JOB_HF is unset or empty in the job's environment; export it before"):
        content("instance-env", str(secret_file), user_secrets=["HF_TOKEN=env:JOB_HF"])
    for word in ("HF_TOKEN", "HF_TOKEN=pipe:x", "=env:X", "HF_TOKEN=env:", "HF_TOKEN=env:not a name"):
        with pytest.raises(KvpushError, match=f"^--user-secret {word}: "):
            content("instance-env", str(secret_file), user_secrets=[word])
