"""benchmarks/suite_profile.py run as a user runs it, on a small pytest selection of its own, while a
process started exactly as the plan starts a vLLM server (`python -m vllm.entrypoints.openai.api_server`,
here a stand-in package of that name) runs beside it."""
from __future__ import annotations

import json
import textwrap

from benchmark_scripts import run_benchmark


def test_a_profile_counts_the_servers_started_and_sums_each_modules_seconds(tmp_path):
    standin = tmp_path / "standin" / "vllm" / "entrypoints" / "openai"
    standin.mkdir(parents=True)
    for folder in (standin.parents[1], standin.parent, standin):
        (folder / "__init__.py").write_text("")
    (standin / "api_server.py").write_text("import time\ntime.sleep(60)\n")
    tests = tmp_path / "selection"
    tests.mkdir()
    (tests / "test_waits.py").write_text(textwrap.dedent(f"""
        import os, subprocess, sys, time

        def test_a_server_runs_a_while_beside_this_test():
            env = dict(os.environ, PYTHONPATH={str(tmp_path / "standin")!r})
            server = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--port", "1"], env=env)
            try:
                time.sleep(3)  # the profile samples every second
            finally:
                server.kill()
                server.wait()

        def test_quick():
            assert True
    """))
    out = tmp_path / "profile"
    code, output = run_benchmark("suite_profile", [str(tests), "--out", str(out)], timeout_s=120)
    assert code == 0, output
    document = json.loads((out / "profile.json").read_text())
    assert document["exit_code"] == 0 and "2 passed" in document["pytest_summary"]
    assert document["vllm_server_starts"] == 1
    assert 0 <= document["cores_busy_mean"] <= 1 and document["wall_s"] >= 3
    [(module, seconds)] = document["seconds_per_module"].items()
    assert module.endswith("test_waits.py") and seconds >= 3
    samples = [line.split("\t") for line in (out / "cpu.tsv").read_text().splitlines()]
    assert len(samples) >= 3 and all(0 <= float(busy) <= 1 for _, busy in samples)
