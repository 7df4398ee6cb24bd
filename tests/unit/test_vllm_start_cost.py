"""benchmarks/vllm_start_cost.py: what it reads from vLLM's log, and the server it starts."""
from __future__ import annotations

import time

import pytest
from benchmark_scripts import load_benchmark

pytestmark = pytest.mark.unit

start_cost = load_benchmark("vllm_start_cost")


def test_first_log_line_of_each_process_kind_in_seconds_after_the_launch():
    launched = time.mktime((2026, 12, 2, 13, 7, 0, 0, 0, -1))
    log = "\n".join([
        "Triton is installed, but doesn't include CPU backend. Disabling Triton.",
        "(APIServer pid=11180) INFO 12-02 13:07:13 [api_utils.py:347] banner",
        "(APIServer pid=11180) INFO 12-02 13:07:14 [api_utils.py:286] non-default args: {}",
        "(EngineCore pid=11192) INFO 12-02 13:07:27 [core.py:133] Initializing a V1 LLM engine",
        "(EngineCore pid=11192) WARNING 12-02 13:07:28 [vllm.py:725] later line",
    ])
    assert start_cost.first_line_seconds(log, launched) == {"APIServer": 13.0, "EngineCore": 27.0}


@pytest.mark.parametrize("template,ranks", [("local-cpu", 1), ("local-cpu-tp2", 2)])
def test_the_server_started_is_the_templates_decode_with_the_plans_launch_and_no_connector(tmp_path, template, ranks):
    plan = start_cost.server_plan(template, tmp_path / "tiny", tmp_path)
    argv = plan.argv
    assert argv[0] == "taskset" and argv[4:6] == start_cost.PLAN_ENTRY  # the instance on its cores, as `up` runs it
    assert argv[argv.index("--model") + 1] == str(tmp_path / "tiny") and "--enforce-eager" in argv
    assert argv[argv.index("--port") + 1] == str(start_cost.PORT)
    assert "--kv-transfer-config" not in argv
    assert ("--tensor-parallel-size" in argv) == (ranks > 1)
    assert len(plan.env["VLLM_CPU_OMP_THREADS_BIND"].split("|")) == ranks
