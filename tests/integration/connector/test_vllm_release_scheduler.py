"""kvpush's connector inside a vLLM release's real scheduler (vllm_compat.py's differences): the
installed release, and another one where KVPUSH_OTHER_VLLM names a folder holding its `vllm`
package (e.g. vLLM 0.25.1's wheel unpacked: `pip install --no-deps --target DIR vllm==0.25.1`,
keeping only DIR/vllm*). That release's Scheduler runs on this interpreter (its other
dependencies come from this venv) in a subprocess."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvpush.connector import vllm_compat

HERE = Path(__file__).parent
OTHER = os.environ.get("KVPUSH_OTHER_VLLM")


@pytest.mark.parametrize("release", ["installed", pytest.param("other", marks=pytest.mark.skipif(
    not OTHER, reason="KVPUSH_OTHER_VLLM names no other vLLM release"))])
def test_pushes_name_the_blocks_the_releases_kv_cache_manager_holds(model_dir, release):
    first = [OTHER] if release == "other" else []
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [*first, os.environ.get("PYTHONPATH")])))
    done = subprocess.run([sys.executable, str(HERE / "vllm_release_scheduler.py"), str(model_dir)], env=env,
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    # before 0.30 vLLM binds no KVCacheManager: the connector tracks block ids itself
    assert (result["blocks_view"] == "ScheduledBlocks") == (vllm_compat.release(result["vllm"]) < (0, 30)), result
    assert [p["req"] for p in result["pushes"]] == ["r0", "r1"], result
    assert all(p["blocks"] == p["manager"] and p["blocks"] for p in result["pushes"]), result
