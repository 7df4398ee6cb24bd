"""kvpush.bench.client_worker: each job runs the entry point with its argv, output into its
log, exit status answered; the answers channel carries nothing else."""
from __future__ import annotations

import io
import json
import sys

from kvpush.bench.client_worker import run_job, serve


def _entry():
    print("running", " ".join(sys.argv[1:]))
    if "--fail" in sys.argv:
        raise SystemExit(4)
    if "--crash" in sys.argv:
        raise RuntimeError("boom")


def test_jobs_run_with_their_argv_and_log_and_answer_their_status(tmp_path, capfd):
    jobs = io.StringIO("\n".join(json.dumps({"argv": ["vllm", *args], "log": str(tmp_path / f"{i}.log")})
                                 for i, args in enumerate((["bench", "serve"], ["--fail"], ["--crash"]))) + "\n")
    answers = io.StringIO()
    argv_before = list(sys.argv)
    serve(_entry, jobs, answers)
    lines = [json.loads(line) for line in answers.getvalue().splitlines()]
    assert lines == [{"ready": True}, {"rc": 0}, {"rc": 4}, {"rc": 1}]
    assert (tmp_path / "0.log").read_text() == "running bench serve\n"
    assert "RuntimeError: boom" in (tmp_path / "2.log").read_text()
    assert sys.argv == argv_before
    assert "running" not in capfd.readouterr().out  # nothing leaked to the real stdout


def test_exit_with_a_message_is_status_1_and_the_message_is_logged(tmp_path):
    def entry():
        raise SystemExit("usage: vllm bench serve: bad option")
    assert run_job(entry, ["vllm"], str(tmp_path / "x.log")) == 1
    assert "bad option" in (tmp_path / "x.log").read_text()


def test_a_jobs_environment_holds_for_that_job_only(tmp_path, monkeypatch):
    import os

    monkeypatch.setenv("OPENAI_API_KEY", "the-users-own")
    seen = []
    entry = lambda: seen.append(os.environ.get("OPENAI_API_KEY"))
    assert run_job(entry, ["vllm"], str(tmp_path / "a.log"), {"OPENAI_API_KEY": "router-key"}) == 0
    assert run_job(entry, ["vllm"], str(tmp_path / "b.log"), {"OPENAI_API_KEY": None}) == 0
    assert seen == ["router-key", None] and os.environ["OPENAI_API_KEY"] == "the-users-own"


def test_a_job_naming_another_program_runs_that_one(tmp_path):
    def conversations():
        print("conversations", " ".join(sys.argv[1:]))

    jobs = io.StringIO(json.dumps({"argv": ["kvpush-conversations", "--turns", "3"], "log": str(tmp_path / "c.log")})
                       + "\n" + json.dumps({"argv": ["vllm", "bench"], "log": str(tmp_path / "v.log")}) + "\n")
    answers = io.StringIO()
    serve(_entry, jobs, answers, {"kvpush-conversations": conversations})
    assert (tmp_path / "c.log").read_text() == "conversations --turns 3\n"
    assert (tmp_path / "v.log").read_text() == "running bench\n"
