"""Runs the WRITE benchmark small: byte-exact, and prints GB/s vs memcpy (speed not asserted)."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from bench_write import run  # noqa: E402


def test_write_benchmark_prints_numbers(capsys):
    results = run(mib=64, block_kib=64, rounds=1)
    assert {r["pattern"] for r in results} == {"contiguous", "random"}
    for r in results:
        assert r["bytes"] == 64 * 2**20 and r["write_gbps"] > 0
        with capsys.disabled():
            print(f"\n{r['pattern']}: WRITE {r['write_gbps']:.2f} GB/s vs memcpy {r['memcpy_gbps']:.2f} GB/s")
