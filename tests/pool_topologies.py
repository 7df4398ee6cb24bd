"""The deployments of the e2e session's pool (tests/deployment_pool.py), as topology text of a model
directory and a working directory. Every instance serves the tiny model (seed 0) as the session's
plain reference server does (float32, eager, the same length limit and served name), so every
answer can be compared with the reference's.

- `pool-kvpush`, `pool-nixl-pull`, `pool-nixl-push`: 1P1D, prefill on core 0, decode and the router
  on core 1 (decode may share it: the live-change test adds a second decode there, `second_decode`). Prefill caches no prefixes (a prompt sent again is computed and transferred again);
  decode does (several samples of one prompt share one transfer through that cache). kvpush's
  connector holds the blocks of a transfer whose prefill went silent for 4 s, not 30 s, so a test
  can watch them come back.
- `pool-colocated`: one colocated instance on core 1 behind the router.
- `pool-tp`: prefill TP 2 (`p2`) and TP 1 (`p1`), decode TP 2 (`d2`) and TP 1 (`d1`), all sharing
  both cores, kvpush, no prefix caching on decode (its own answer to a prompt is a plain server's).
"""
from __future__ import annotations

from pathlib import Path

from e2e_instances import KV_CACHE_GIB

LATE_WRITE_HOLD_S = 4
PORT_BASE = {"kvpush": 18300, "nixl-pull": 18320, "nixl-push": 18340, "colocated": 18360, "tp": 19000}
_MODEL = ('{{path: {model}, served_name: tiny, max_model_len: 2048, enforce_eager: true, dtype: float32, '
          'extra_args: ["--no-enable-prefix-caching"]}}')
_1P1D = """
name: pool-{protocol}
platform: cpu
model: """ + _MODEL + """
connector: {{type: {protocol}, backend: UCX{extra}}}
hosts:
  local: {{address: 127.0.0.1, workdir: {workdir}}}
prefill: {prefill}
decode: [{{cpu_cores: "1", share_cores: true, kv_cache_gib: {kv}, http_port: {decode_port}, side_channel_port: {decode_side},
          extra_args: ["--enable-prefix-caching"]}}]
router: {{port: {router_port}, cpu_cores: "1"}}
env: {{UCX_MODULES: "^ib", UCX_MEM_EVENTS: "no"}}
"""
_PREFILL = '[{{cpu_cores: "0", kv_cache_gib: {kv}, http_port: {port}, side_channel_port: {side}}}]'
_TP = """
name: pool-tp
platform: cpu
model: {{path: {model}, served_name: tiny, max_model_len: 2048, enforce_eager: true, dtype: float32}}
connector: {{type: kvpush, backend: UCX, transfer_timeout_s: 20, extra_config: {{late_write_hold_s: 3}}}}
hosts:
  local: {{address: 127.0.0.1, workdir: {workdir}}}
prefill:
  - {{name: p2, tensor_parallel_size: 2, cpu_cores: "0|1", share_cores: true, kv_cache_gib: {kv},
     http_port: {b0}, side_channel_port: {b10}}}
  - {{name: p1, cpu_cores: "0", share_cores: true, kv_cache_gib: {kv}, http_port: {b1}, side_channel_port: {b12}}}
decode:
  - {{name: d2, tensor_parallel_size: 2, cpu_cores: "0|1", share_cores: true, kv_cache_gib: {kv},
     http_port: {b2}, side_channel_port: {b14}, extra_args: ["--no-enable-prefix-caching"]}}
  - {{name: d1, cpu_cores: "1", share_cores: true, kv_cache_gib: {kv}, http_port: {b3}, side_channel_port: {b16},
     extra_args: ["--no-enable-prefix-caching"]}}
router: {{port: {b9}, health_timeout_s: 60}}  # 4 instances (8 processes) on 2 busy cores: /health can take seconds
env: {{UCX_MODULES: "^ib", UCX_MEM_EVENTS: "no"}}
"""


def one_p_one_d(protocol: str, model: Path, workdir: Path) -> str:
    base = PORT_BASE[protocol]
    prefill = "[]" if protocol == "colocated" else _PREFILL.format(kv=KV_CACHE_GIB, port=base, side=base + 5)
    extra = f", extra_config: {{late_write_hold_s: {LATE_WRITE_HOLD_S}}}" if protocol == "kvpush" else ""
    return _1P1D.format(protocol=protocol, model=model, workdir=workdir, prefill=prefill, kv=KV_CACHE_GIB, extra=extra,
                        decode_port=base + 1, decode_side=base + 6, router_port=base + 2)


def tensor_parallel(model: Path, workdir: Path) -> str:
    base = PORT_BASE["tp"]
    return _TP.format(model=model, workdir=workdir, kv=KV_CACHE_GIB, **{f"b{i}": base + i for i in range(20)})


POOL = {**{f"pool-{p}": (lambda model, workdir, p=p: one_p_one_d(p, model, workdir))
           for p in ("kvpush", "nixl-pull", "nixl-push", "colocated")},
        "pool-tp": tensor_parallel}


def second_decode(topology_text: str) -> str:
    """A 1P1D's topology with a second decode, decode-1, sharing decode-0's core, on ports of its own."""
    import copy

    import yaml

    doc = yaml.safe_load(topology_text)
    first = doc["decode"][0]
    doc["decode"].append({**copy.deepcopy(first), "name": "decode-1", "http_port": first["http_port"] + 2,
                          "side_channel_port": first["side_channel_port"] + 2})
    return yaml.safe_dump(doc, sort_keys=False)
