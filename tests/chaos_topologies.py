"""The deployments the chaos suite breaks, as topology text made from the shipped templates: each
serves the tiny model (seed 0) exactly as the session's plain reference server does (float32,
eager, no prefix cache, the same length limit), so every answer can be compared with the
reference's, on ports and in a working directory of the caller's.

- `1p1d`: the `local-cpu` template (prefill on core 0, decode on core 1).
- `p1-d2`: `local-cpu-hetero` the other way round: prefill TP 1 -> decode TP 2.
- `2p2d`: two prefill and two decode instances of `local-cpu`, sharing the cores, least-loaded
  (the shape of tests/e2e/test_faults_2p2d_real_vllm.py).
- `mixed`: two prefill TP 1 and two decode instances, one TP 2 and one TP 1: one deployment whose
  pairs are of both the 1P1D and the P TP 1 -> D TP 2 shape, with a peer of each role (the CI
  version, which has time to start one deployment only).
"""
from __future__ import annotations

import copy

import yaml

from kvpush.templates import template_text

SHAPES = ("1p1d", "p1-d2", "2p2d", "mixed")
# Prefix caching off: a prompt sent again is computed and transferred again, not served from cache.
_MODEL = {"served_name": "tiny", "max_model_len": 2048, "enforce_eager": True, "dtype": "float32",
          "extra_args": ["--no-enable-prefix-caching"], "tiny": {"seed": 0}}
_TP1_ON = {"0": {"cpu_cores": "0", "share_cores": True}, "1": {"cpu_cores": "1", "share_cores": True}}
_TP2 = {"tensor_parallel_size": 2, "cpu_cores": "0|1", "share_cores": True}
_INSTANCES = {  # shape -> (template, prefill instances, decode instances, router overrides)
    "1p1d": ("local-cpu", [{"cpu_cores": "0"}], [{"cpu_cores": "1"}], {}),
    "p1-d2": ("local-cpu-hetero", [_TP1_ON["0"]], [_TP2], {}),
    "2p2d": ("local-cpu", [_TP1_ON["0"], _TP1_ON["1"]], [_TP1_ON["0"], _TP1_ON["1"]],
             {"cpu_cores": "0-1", "policy": "least-loaded"}),
    "mixed": ("local-cpu", [_TP1_ON["0"], _TP1_ON["1"]], [_TP2, _TP1_ON["1"]],
              {"cpu_cores": "0-1", "policy": "least-loaded", "health_timeout_s": 5}),
}


def chaos_topology(shape: str, name: str, model: str, workdir: str, port_base: int, kv_cache_gib: float) -> str:
    """Topology YAML of `shape`: instance i of a role listens on port_base + 2i (prefill) or
    port_base + 2i + 1 (decode), prefill's side channels on port_base + 10 + i, the router on
    port_base + 9; ports port_base to port_base + 19 are the deployment's."""
    if shape not in _INSTANCES:
        raise ValueError(f"unknown chaos topology {shape!r}; choose one of {', '.join(SHAPES)}")
    template, prefill, decode, router = _INSTANCES[shape]
    doc = yaml.safe_load(template_text(template))
    doc["name"] = name
    doc["model"] = {"path": model, **_MODEL}
    doc["hosts"]["local"]["workdir"] = workdir
    doc["prefill"] = [{**copy.deepcopy(spec), "kv_cache_gib": kv_cache_gib, "http_port": port_base + 2 * i,
                       "side_channel_port": port_base + 10 + i} for i, spec in enumerate(prefill)]
    doc["decode"] = [{**copy.deepcopy(spec), "kv_cache_gib": kv_cache_gib, "http_port": port_base + 2 * i + 1}
                     for i, spec in enumerate(decode)]
    doc["router"] = {**doc["router"], **router, "port": port_base + 9}
    return yaml.safe_dump(doc, sort_keys=False)
