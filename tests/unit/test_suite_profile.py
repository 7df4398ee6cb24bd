"""benchmarks/suite_profile.py: what it reads from pytest's output and /proc/stat."""
from __future__ import annotations

import pytest
from benchmark_scripts import load_benchmark

pytestmark = pytest.mark.unit

profile = load_benchmark("suite_profile")


def test_seconds_per_module_add_every_phase_of_every_test_of_a_file_largest_first():
    log = "\n".join([
        "============ slowest durations ============",
        "12.50s call     tests/e2e/test_a.py::test_one[x]",
        "3.00s setup    tests/e2e/test_b.py::test_two",
        "2.00s teardown tests/e2e/test_a.py::test_one[x]",
        "1.25s call     tests/e2e/test_b.py::test_three",
        "(12 durations < 0.005s hidden.)",
        "0.5s something else entirely",
    ])
    assert profile.per_module(log) == {"tests/e2e/test_a.py": 14.5, "tests/e2e/test_b.py": 4.25}
    assert list(profile.per_module(log)) == ["tests/e2e/test_a.py", "tests/e2e/test_b.py"]


def test_cpu_times_count_busy_jiffies_within_the_total():
    busy, total = profile.cpu_times()
    assert 0 < busy < total
