"""Drive the router with vLLM's own benchmark client, `vllm bench serve`, one process per rate."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ..errors import KvpushError

PERCENTILE_METRICS = "ttft,tpot,itl,e2el"
PERCENTILES = "50,90,99"


@dataclass(frozen=True)
class LoadSpec:
    """One load level against one deployment."""

    base_url: str  # the router, e.g. http://127.0.0.1:8000
    served_model: str
    tokenizer: str  # a local directory with the model's tokenizer
    rate: float  # requests per second, Poisson arrivals
    num_prompts: int
    input_len: int
    output_len: int
    seed: int  # a different seed per mode and rate: fresh prompts, no prefix-cache hits on decode
    result_dir: str
    result_filename: str

    @property
    def result_path(self) -> Path:
        return Path(self.result_dir) / self.result_filename


def bench_command() -> list[str]:
    """The `vllm` console script of this Python environment (the venv's bin/, then PATH)."""
    beside = Path(sys.executable).with_name("vllm")
    if beside.is_file():
        return [str(beside)]
    found = shutil.which("vllm")
    if found:
        return [found]
    raise KvpushError("the `vllm` command was not found beside this Python or on PATH; install vLLM "
                      "(scripts/setup.sh) in the environment that runs kvpush bench")


def bench_serve_argv(load: LoadSpec, command: list[str] | None = None) -> list[str]:
    return [
        *(command if command is not None else bench_command()), "bench", "serve",
        "--backend", "openai",
        "--base-url", load.base_url,
        "--endpoint", "/v1/completions",
        "--model", load.served_model,
        "--served-model-name", load.served_model,
        "--tokenizer", load.tokenizer,
        "--dataset-name", "random",
        "--random-input-len", str(load.input_len),
        "--random-output-len", str(load.output_len),
        "--random-range-ratio", "0.0",
        "--random-prefix-len", "0",  # no shared prefix: every prompt is new to decode
        "--num-prompts", str(load.num_prompts),
        "--request-rate", f"{load.rate:g}",
        "--seed", str(load.seed),
        "--ignore-eos",  # every request produces output_len tokens, so TPOT compares like with like
        "--temperature", "0",
        "--percentile-metrics", PERCENTILE_METRICS,
        "--metric-percentiles", PERCENTILES,
        "--disable-tqdm",
        "--save-result",
        "--result-dir", load.result_dir,
        "--result-filename", load.result_filename,
    ]


def run_bench_serve(load: LoadSpec, log_path: Path, timeout_s: float, command: list[str] | None = None) -> Path:
    """Run one load level; returns the result JSON. The client is killed on timeout or Ctrl-C."""
    argv = bench_serve_argv(load, command)
    Path(load.result_dir).mkdir(parents=True, exist_ok=True)
    load.result_path.unlink(missing_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            raise KvpushError(f"`vllm bench serve` at {load.rate:g} req/s did not finish within {timeout_s:.0f} s; "
                              f"its output is {log_path}; lower --num-prompts or raise --client-timeout") from None
        except BaseException:
            _kill_group(proc)
            raise
    if rc != 0 or not load.result_path.is_file():
        tail = log_path.read_text(errors="replace").strip().splitlines()[-1:] or ["no output"]
        raise KvpushError(f"`vllm bench serve` at {load.rate:g} req/s failed (exit {rc}): {tail[0][:200]}; "
                          f"full output in {log_path}")
    return load.result_path


def _kill_group(proc: subprocess.Popen) -> None:
    for sig, wait_s in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        end = time.monotonic() + wait_s
        while time.monotonic() < end:
            if proc.poll() is not None:
                return
            time.sleep(0.1)
