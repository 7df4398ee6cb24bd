"""kvpush.deploy.plan.redact: secret-looking values of a topology are hidden wherever a plan is shown."""
from __future__ import annotations

import json

import pytest

from kvpush.deploy.plan.plan import build_plan
from kvpush.deploy.plan.redact import REDACTED, is_secret_env_name, redact_argv, redact_env, redact_plan
from kvpush.deploy.topology.topology import parse_topology


@pytest.mark.parametrize("name", ["HF_TOKEN", "AWS_SECRET_ACCESS_KEY", "OPENAI_API_KEY", "DB_PASSWORD", "KEY", "github_token",
                                  "GOOGLE_APPLICATION_CREDENTIALS"])
def test_secret_names(name):
    assert is_secret_env_name(name)


@pytest.mark.parametrize("name", ["VLLM_CPU_KVCACHE_SPACE", "SSH_AUTH_SOCK", "UCX_TLS", "KEYBOARD", "MONKEY_COUNT", "TOKENIZERS_PARALLELISM"])
def test_plain_names(name):
    assert not is_secret_env_name(name)


def test_flags_keep_their_name_and_lose_their_value():
    assert redact_argv(["--hf-token", "abc", "--port", "1", "--db-password=xyz", "--tokenizer", "/t"]) == \
        ["--hf-token", REDACTED, "--port", "1", f"--db-password={REDACTED}", "--tokenizer", "/t"]


def test_plan_output_hides_the_topologys_secret_values_and_keeps_the_rest():
    topo = parse_topology("name: t\nmodel: {path: /m, extra_args: [--hf-token, hf_abc]}\nenv: {HF_TOKEN: hf_abc, UCX_TLS: tcp}\n"
                          "prefill: [{}]\ndecode: [{}]\n")
    plan = build_plan(topo)
    shown = json.dumps(redact_plan(plan).to_dict())
    assert "hf_abc" not in shown and '"UCX_TLS": "tcp"' in shown and REDACTED in shown
    assert "hf_abc" in json.dumps(plan.to_dict())  # what `up` launches is unchanged


# -- every form a plan is shown in -------------------------------------------------------------

SLURM_TOPOLOGY = """name: sec
launcher: slurm
slurm: {job_id: "123"}
model: {path: /m}
hosts: {a: {node: n1}}
prefill: [{host: a}]
decode: [{host: a, env: {DECODE_TOKEN: decode-token-value}}]
router: {host: a}
"""
PLAIN_SECRETS = {"HF_TOKEN": "hf-token-value", "DB_PASSWORD": "db-password-value",
                 "GITHUB_PAT": "github-pat-value", "SOME_VAR": "ghp_" + "x" * 36}


def _slurm_topology_file(tmp_path, env: dict[str, str] | None = None, secrets: str = ""):
    env_line = "env: " + json.dumps({**(PLAIN_SECRETS if env is None else env), "UCX_TLS": "tcp"}) + "\n"
    path = tmp_path / "sec.yaml"
    path.write_text(SLURM_TOPOLOGY + env_line + secrets)
    return path


def test_slurm_plans_show_no_secret_looking_value_in_any_form_srun_lines_included(tmp_path):
    from cli_in_process import run_cli

    path = _slurm_topology_file(tmp_path)
    values = [*PLAIN_SECRETS.values(), "decode-token-value"]
    text = run_cli("plan", str(path))
    as_json = run_cli("plan", str(path), "--json")
    assert text.returncode == 0 and as_json.returncode == 0, text.stderr + as_json.stderr
    for shown in (text.stdout + text.stderr, as_json.stdout + as_json.stderr):
        assert [v for v in values if v in shown] == []
        assert "UCX_TLS=tcp" in shown and REDACTED in shown
    steps = json.loads(as_json.stdout)["slurm"]["steps"]
    assert "HF_TOKEN=" in steps["prefill-0"] and "DECODE_TOKEN=" in steps["decode-0"]
    assert REDACTED in steps["prefill-0"] and REDACTED in steps["decode-0"]
    assert [line for line in text.stdout.splitlines() if line.strip().startswith("srun ")] and "UCX_TLS=tcp" in steps["router"]


@pytest.mark.parametrize("env,extra,field", [
    ({"HF_TOKEN": "v"}, "", "env.HF_TOKEN"),
    ({"GITHUB_PAT": "v"}, "", "env.GITHUB_PAT"),
    ({"SOME_VAR": "hf_" + "a" * 30}, "", "env.SOME_VAR"),
    ({}, "model: {path: /m, extra_args: [--hf-token, v]}\n", "model.extra_args"),
])
def test_a_standalone_script_refuses_a_secret_looking_value_instead_of_holding_it_or_a_placeholder(tmp_path, env, extra,
                                                                                                   field):
    from cli_in_process import run_cli

    path = _slurm_topology_file(tmp_path, env)
    text = path.read_text().replace("decode: [{host: a, env: {DECODE_TOKEN: decode-token-value}}]", "decode: [{host: a}]")
    path.write_text(text.replace("model: {path: /m}\n", extra) if extra else text)
    result = run_cli("plan", str(path), "--slurm-script")
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.strip().splitlines()[-1] == (
        f"error: {field}: looks secret, and a standalone script would have to hold its value; give it in secrets: "
        "(e.g. HF_TOKEN: {env: HF_TOKEN}), which the job reads when it starts")


def test_the_topologys_secrets_are_named_in_every_form_and_their_values_read_by_none(tmp_path, monkeypatch):
    from cli_in_process import run_cli

    monkeypatch.setenv("HF_TOKEN_HERE", "hf-value-from-the-environment")
    value_file = tmp_path / "db.pass"
    value_file.write_text("db-value-from-a-file\n")
    value_file.chmod(0o600)
    path = _slurm_topology_file(tmp_path, {}, f"secrets:\n  HF_TOKEN: {{env: HF_TOKEN_HERE}}\n  DB_PASSWORD: {{file: {value_file}}}\n")
    path.write_text(path.read_text().replace(", env: {DECODE_TOKEN: decode-token-value}", ""))
    outputs = [run_cli("plan", str(path), *args) for args in ([], ["--json"], ["--slurm-script"])]
    assert [r.returncode for r in outputs] == [0, 0, 0], [r.stderr for r in outputs]
    for result in outputs:
        assert "hf-value-from-the-environment" not in result.stdout + result.stderr
        assert "db-value-from-a-file" not in result.stdout + result.stderr
        assert REDACTED not in result.stdout  # nothing needed hiding: the values never came in
    text, as_json, script = (r.stdout for r in outputs)
    assert "env  VLLM_API_KEY, DB_PASSWORD, HF_TOKEN from ~/.kvpush/sec/instance-api-key.env (values not shown)" in text
    assert json.loads(as_json)["hosts"][0]["processes"][0]["env_file_names"] == ["VLLM_API_KEY", "DB_PASSWORD", "HF_TOKEN"]
    assert "--user-secret DB_PASSWORD=file:" in script and "--user-secret HF_TOKEN=env:HF_TOKEN_HERE" in script


@pytest.mark.parametrize("name,value", [("GITHUB_PAT", "x"), ("DB_PASS", "x"), ("X_APIKEY", "x"), ("ANY", "ghp_" + "a" * 36),
                                        ("ANY", "github_pat_" + "a" * 30), ("ANY", "hf_" + "a" * 30), ("ANY", "sk-" + "a" * 40),
                                        ("ANY", "AKIA" + "A" * 16), ("ANY", "-----BEGIN OPENSSH PRIVATE KEY-----\nx")])
def test_names_and_well_known_token_formats_look_secret(name, value):
    assert redact_env({name: value}) == {name: REDACTED}


@pytest.mark.parametrize("name,value", [("PATH", "/usr/bin"), ("SSH_AUTH_SOCK", "/tmp/s"), ("PATTERN", "x"), ("HF_TOKEN", ""),
                                        ("ANY", "hf_short"), ("ANY", "sk-short"), ("TOKENIZERS_PARALLELISM", "false")])
def test_plain_values_stay(name, value):
    assert redact_env({name: value}) == {name: value}
