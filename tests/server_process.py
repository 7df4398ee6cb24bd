"""One test server (vLLM, router) in its own process group, logging to a file; killed at teardown."""
from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

from kvpush.common.vllm_metrics import metric_sum


class ServerProcess:
    def __init__(self, name: str, argv: list[str], env: dict[str, str], url: str, log_dir: Path):
        self.name, self.url = name, url
        self.log_path = Path(log_dir) / f"{name}.log"
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(argv, env={**os.environ, **env}, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)

    def wait_healthy(self, timeout_s: float = 300) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}; see {self.log_path}:\n{self.tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} not healthy after {timeout_s} s; see {self.log_path}:\n{self.tail()}")

    def tail(self, n: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def metrics(self) -> str:
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:
            return r.read().decode()

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples of `name` with these labels on the server's /metrics page; 0 when absent."""
        return metric_sum(self.metrics(), name, **labels) or 0.0

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait(timeout=30)
        self._log.close()
