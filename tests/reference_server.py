"""One plain vLLM server (no KV connector) whose answers the e2e tests compare their deployments'
answers with, shared by every test of a session: started at its first use, stopped at the end.

It serves its own copy of the tiny model (seed 0) with the argv and env `build_plan` gives a
colocated instance: float32 (the random-weight model's logits are near ties; bf16's rounding flips
greedy picks with the batch shape, float32's does not), one OMP thread on core 1, eager, no prefix cache
(every answer is computed from the prompt alone, whatever the server answered before). A test gets
its URL only for a deployment whose decode serves an identical model with the same dtype, length
limit, served name and eager mode, so the two are comparable; it leaves the server as it found it.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from e2e_instances import KV_CACHE_GIB
from kvpush.deploy.plan.plan import build_plan
from kvpush.deploy.plan.plan_model import ProcessPlan
from kvpush.deploy.lifecycle.tiny_model import make_tiny_model
from kvpush.deploy.topology.topology import TinyModelSpec, parse_topology
from plan_secrets import keyless
from server_process import ServerProcess

PORT = 17990  # no other test uses it
TOPOLOGY = """
name: reference
platform: cpu
model: {{path: {model}, served_name: tiny, max_model_len: 2048, enforce_eager: true, dtype: float32,
         extra_args: ["--no-enable-prefix-caching"]}}
connector: {{type: colocated}}
hosts:
  local: {{address: 127.0.0.1, workdir: {workdir}}}
prefill: []
decode: [{{cpu_cores: "1", kv_cache_gib: {kv_cache_gib}, http_port: {port}}}]
router: {{port: {router_port}}}
"""
# Flags whose values must be the same on a compared deployment's decode (--model: the same files).
COMPARED_FLAGS = ("--dtype", "--max-model-len", "--served-model-name")


def model_digest(model: Path) -> str:
    """One hash of every file of a model directory (names and contents)."""
    digest = hashlib.sha256()
    for path in sorted(p for p in Path(model).rglob("*") if p.is_file()):
        digest.update(str(path.relative_to(model)).encode() + b"\0")
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


def _flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


class ReferenceServer:
    def __init__(self, root: Path):
        self._root = root
        self._model = root / "reference-model"
        topo = parse_topology(TOPOLOGY.format(model=self._model, workdir=root, kv_cache_gib=KV_CACHE_GIB, port=PORT,
                                              router_port=PORT + 1))
        self.plan = build_plan(topo).process("decode-0")
        self._server: ServerProcess | None = None
        self._healthy = False
        self._failed = ""

    def start(self) -> None:
        """Start loading the server, if it is not running yet; returns at once (a test may start its
        own servers meanwhile)."""
        if self._server is not None:
            return
        make_tiny_model(self._model, TinyModelSpec(seed=0))
        self._server = ServerProcess("reference", keyless(self.plan.argv), self.plan.env, self.plan.base_url, self._root)

    def url_for(self, decode: ProcessPlan, timeout_s: float = 600) -> str:
        """The reference's URL once it answers, for a deployment with this decode instance: fails
        the test if that decode's answers are not comparable with the reference's."""
        self.start()
        model = Path(_flag(decode.argv, "--model"))
        differing = {flag: (_flag(decode.argv, flag), _flag(self.plan.argv, flag)) for flag in COMPARED_FLAGS
                     if _flag(decode.argv, flag) != _flag(self.plan.argv, flag)}
        if ("--enforce-eager" in decode.argv) != ("--enforce-eager" in self.plan.argv):
            differing["--enforce-eager"] = ("--enforce-eager" in decode.argv, "--enforce-eager" in self.plan.argv)
        assert not differing, f"decode and the reference server differ in (decode, reference): {differing}"
        assert model_digest(model) == model_digest(self._model), f"{model} is not the reference's tiny model (seed 0)"
        if self._failed:
            pytest.fail(f"the reference server did not start: {self._failed}")  # once is enough to wait
        if not self._healthy:
            try:
                self._server.wait_healthy(timeout_s)
            except BaseException as exc:
                self._failed = f"{type(exc).__name__}: {exc}"
                self._server.kill()
                raise
            self._healthy = True
        elif not self._server.alive():  # a request of an earlier test ended it: that is a finding, not a reason to restart
            pytest.fail(f"the reference server has exited ({self._server.proc.returncode}):\n{self._server.tail()}")
        return self._server.url

    def stop(self) -> None:
        if self._server is not None:
            self._server.kill()
