"""kvpush.deploy.redact: secret-looking values of a topology are hidden wherever a plan is shown."""
from __future__ import annotations

import json

import pytest

from kvpush.deploy.plan import build_plan
from kvpush.deploy.redact import REDACTED, is_secret_env_name, redact_argv, redact_plan
from kvpush.deploy.topology import parse_topology


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
