"""benchmarks/cma_ceiling.py runs small: one line per chunk size, each with both rates and their ratio."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "cma_ceiling.py"


def test_prints_process_vm_writev_against_memcpy_per_chunk_size():
    result = subprocess.run([sys.executable, str(SCRIPT), "--mib", "4", "--writer-core", "0", "--receiver-core", "0"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 5
    for line, chunk in zip(lines, ("4096", "4096", "512", "128", "64")):
        m = re.fullmatch(rf"4 MiB in +{chunk} KiB calls: process_vm_writev ([\d.]+) GB/s, memcpy ([\d.]+) GB/s -> (\d+)% "
                         r"\(medians of 5\)", line)
        assert m, line
        assert float(m.group(1)) > 0 and float(m.group(2)) > 0
