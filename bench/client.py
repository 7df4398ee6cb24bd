"""Drive the router with vLLM's own benchmark client, `vllm bench serve`: its CLI entry point, run
once per rate inside one warm process (client_worker.py), so vLLM's import is paid once per bench."""
from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from kvpush.common.errors import KvpushError
from kvpush.deploy.topology.placement import on_cores

from .conversation_client import API_KEY_VARIABLE
from .conversation_client import argv_for as conversations_argv
from .conversations import Workload

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
    input_len: int  # each prompt's own tokens, after the shared prefix
    output_len: int
    seed: int  # a different seed per mode and rate: fresh prompts, no prefix-cache hits on decode
    result_dir: str
    result_filename: str
    # each request's X-Request-Id is this prefix and its index (in the order of the result file's lists)
    request_id_prefix: str = ""
    prefix_len: int = 0  # tokens every prompt of the level starts with (the same ones)
    input_len_spread: float = 0.0  # own tokens spread uniformly over input_len x [1 - spread, 1 + spread]
    # multi-turn conversations (conversation_client.py) instead of `vllm bench serve`: `rate` is then
    # conversations started per second, input_len their first turn's own tokens
    workload: Workload | None = None
    timeout_s: float = 900.0  # a multi-turn request's whole answer

    @property
    def result_path(self) -> Path:
        return Path(self.result_dir) / self.result_filename


def job_argv(load: LoadSpec) -> list[str]:
    """What the client worker runs for one load level."""
    if load.workload is None:
        return bench_serve_argv(load)
    return conversations_argv(load.base_url, load.served_model, load.tokenizer, load.rate, load.seed, load.workload,
                              load.output_len, load.result_path, load.request_id_prefix, load.timeout_s)


def bench_serve_argv(load: LoadSpec, command: list[str] | None = None) -> list[str]:
    """The `vllm bench serve` command line for one load level (program name first, `vllm` by default)."""
    return [
        *(command if command is not None else ["vllm"]),
        "bench",
        "serve",
        "--backend",
        "openai",
        "--base-url",
        load.base_url,
        "--endpoint",
        "/v1/completions",
        "--model",
        load.served_model,
        "--served-model-name",
        load.served_model,
        "--tokenizer",
        load.tokenizer,
        "--dataset-name",
        "random",
        "--random-input-len",
        str(load.input_len),
        "--random-output-len",
        str(load.output_len),
        # only the prompt's length varies: every request produces output_len tokens
        "--random-range-ratio",
        json.dumps({"input": load.input_len_spread, "output": 0.0}) if load.input_len_spread else "0.0",
        "--random-prefix-len",
        str(load.prefix_len),  # 0: every prompt is new to decode
        "--num-prompts",
        str(load.num_prompts),
        "--request-rate",
        f"{load.rate:g}",
        "--seed",
        str(load.seed),
        "--ignore-eos",  # every request produces output_len tokens, so TPOT compares like with like
        "--temperature",
        "0",
        "--percentile-metrics",
        PERCENTILE_METRICS,
        "--metric-percentiles",
        PERCENTILES,
        "--disable-tqdm",
        "--save-result",
        "--save-detailed",  # per-request latencies: a --rounds bench pools them over rounds
        "--result-dir",
        load.result_dir,
        "--result-filename",
        load.result_filename,
        *(["--request-id-prefix", load.request_id_prefix] if load.request_id_prefix else []),
    ]


WORKER_MODULE = "kvpush.bench.client_worker"


class BenchClient:
    """A warm `vllm bench serve` process serving every load level of a bench, one at a time.

    `start()` spawns it early (vLLM's import then overlaps the first deployment's start); `run()`
    waits for it, runs one level and returns the result file. A level past its timeout, a Ctrl-C
    or a dead worker kill the worker; the next `run()` starts a fresh one."""

    def __init__(self, log_path: Path, command: list[str] | None = None, cpu_cores: str | None = None):
        self.log_path = log_path  # the worker's own output (vLLM's import warnings, crashes)
        self.command = on_cores(cpu_cores, command if command is not None else [sys.executable, "-m", WORKER_MODULE])
        self._proc: subprocess.Popen | None = None
        self._ready = False

    def start(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            return
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        with open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen(self.command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                                          env=env, start_new_session=True)
        self._ready = False

    def run(self, load: LoadSpec, log_path: Path, timeout_s: float, api_key: str | None = None) -> Path:
        """Run one load level (with the router's API key, if it takes one); returns the result JSON."""
        Path(load.result_dir).mkdir(parents=True, exist_ok=True)
        load.result_path.unlink(missing_ok=True)
        deadline = time.monotonic() + timeout_s
        self.start()
        try:
            if not self._ready:
                answer = self._answer(deadline, load, log_path, timeout_s)
                if "error" in answer:
                    raise KvpushError(
                        f"`vllm bench serve` could not start: {answer['error']}; its output is {self.log_path}"
                    )
                self._ready = True
            # The key goes on the worker's stdin, never in an argv; unset when the router takes none,
            # so a key of the user's own environment is never sent to the deployment.
            job = {"argv": job_argv(load), "log": str(log_path), "env": {API_KEY_VARIABLE: api_key}}
            assert self._proc is not None and self._proc.stdin is not None
            self._proc.stdin.write((json.dumps(job) + "\n").encode())
            self._proc.stdin.flush()
            rc = int(self._answer(deadline, load, log_path, timeout_s).get("rc", 1))
        except BaseException:
            self.close()
            raise
        if rc != 0 or not load.result_path.is_file():
            text = log_path.read_text(errors="replace") if log_path.is_file() else ""
            tail = text.strip().splitlines()[-1:] or ["no output"]
            raise KvpushError(f"`vllm bench serve` at {load.rate:g} req/s failed (exit {rc}): {tail[0][:200]}; "
                              f"full output in {log_path}")
        return load.result_path

    def _answer(self, deadline: float, load: LoadSpec, log_path: Path, timeout_s: float) -> dict:
        """The worker's next JSON line, or an error once the deadline passes or the worker dies."""
        assert self._proc is not None and self._proc.stdout is not None
        with selectors.DefaultSelector() as selector:
            selector.register(self._proc.stdout, selectors.EVENT_READ)
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise KvpushError(
                        f"`vllm bench serve` at {load.rate:g} req/s did not finish within {timeout_s:.0f} s; "
                        f"its output is {log_path}; lower --num-prompts or raise --client-timeout"
                    )
                if selector.select(timeout=min(left, 1.0)):
                    line = self._proc.stdout.readline()
                    if not line:
                        rc = self._proc.wait()
                        raise KvpushError(
                            f"the `vllm bench serve` process exited (status {rc}) at {load.rate:g} req/s; "
                            f"its output is {self.log_path} and {log_path}"
                        )
                    try:
                        return json.loads(line)
                    except ValueError:
                        continue  # not one of ours

    def close(self) -> None:
        """Stop the worker (end of stdin, then signals); safe to call twice."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None and proc.stdin is not None:
            try:
                proc.stdin.close()
                proc.wait(timeout=2.0)
            except (OSError, subprocess.TimeoutExpired):
                pass
        _kill_group(proc)
        for stream in (proc.stdin, proc.stdout):
            if stream is not None:
                try:
                    stream.close()
                except OSError:
                    pass

    def __enter__(self) -> BenchClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _kill_group(proc: subprocess.Popen) -> None:
    for sig, wait_s in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        if proc.poll() is not None:
            break
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        end = time.monotonic() + wait_s
        while time.monotonic() < end:
            if proc.poll() is not None:
                break
            time.sleep(0.1)
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # anything the client left in its group
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()
