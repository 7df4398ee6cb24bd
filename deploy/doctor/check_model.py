"""Model: present on every vLLM host, identical everywhere, and its dtype/length fit the topology."""
from __future__ import annotations

from kvpush.connector.sharding import tp_problem
from kvpush.deploy.topology.model_config import kv_heads_from_config

from .context import Check, DoctorContext, agreement
from .facts import HostFacts
from .result import TOPOLOGY_SUBJECT, CheckResult, Evidence, fail, ok, skip, warn


def _model_evidence(model: dict) -> Evidence:
    lines = [f"path {model.get('path')}: {'exists' if model.get('exists') else 'missing'}"]
    if model.get("config_error"):
        lines.append(model["config_error"])
    if model.get("config_digest"):
        lines.append(f"config.json digest {model['config_digest']}")
    if model.get("weights_digest"):
        total = sum(w["size"] for w in model.get("weights", []))
        lines.append(
            f"{len(model['weights'])} weight files, {total} bytes, {model['digest_mode']} digest "
            f"{model['weights_digest']}"
        )
    return Evidence("python: os.path.isdir(model), read config.json, sha256 of weight files", tuple(lines))


def check_model_present(ctx: DoctorContext) -> list[CheckResult]:
    path = ctx.topo.model.path

    def decide(facts: HostFacts) -> CheckResult:
        model = facts.model or {}
        ev = _model_evidence(model)
        if not model.get("exists"):
            if ctx.topo.model.tiny is not None:
                return ok("model-present", facts.host, f"{path} missing; `up` makes the tiny model there", ev)
            return fail(
                "model-present",
                facts.host,
                f"model directory {path} does not exist",
                f"copy the model to {path} on {facts.host} (same files as the other hosts) or fix model.path",
                ev,
            )
        if model.get("config_error"):
            return fail("model-present", facts.host, "config.json unreadable",
                        f"copy a complete model to {path} on {facts.host}", ev)
        if not model.get("weights"):
            return fail("model-present", facts.host, "no weight files (*.safetensors, *.bin)",
                        f"copy the weights into {path} on {facts.host}", ev)
        return ok("model-present", facts.host, f"{path}: config + {len(model['weights'])} weight files", ev)

    return ctx.each_host("model-present", ctx.vllm_hosts(), decide)


def check_model_match(ctx: DoctorContext) -> list[CheckResult]:
    present = {
        h: model
        for h in ctx.vllm_hosts()
        if h in ctx.facts and (model := ctx.facts[h].model) and model.get("weights_digest")
    }
    if len(present) < 2:
        return [
            skip(
                "model-match",
                TOPOLOGY_SUBJECT,
                f"model found on {len(present)} host(s); nothing to compare",
                scope="topology",
            )
        ]
    lines, differs = [], []
    for key, label in (("config_digest", "config.json"), ("weights_digest", "weights")):
        described, agree = agreement({h: str(m.get(key)) for h, m in present.items()})
        lines.append(f"{label}: {described}")
        if not agree:
            differs.append(label)
    ev = Evidence("sha256 of config.json and weight files on each host", tuple(lines))
    if differs:
        return [
            fail(
                "model-match",
                TOPOLOGY_SUBJECT,
                f"{' and '.join(differs)} differ between hosts",
                "copy one model to every host (prefill and decode must load identical weights)",
                ev,
                scope="topology",
            )
        ]
    return [ok("model-match", TOPOLOGY_SUBJECT, f"identical on {len(present)} hosts", ev, scope="topology")]


DTYPE_NAMES = {
    "bfloat16": "bfloat16",
    "float16": "float16",
    "half": "float16",
    "float32": "float32",
    "float": "float32",
}


def check_model_fit(ctx: DoctorContext) -> list[CheckResult]:
    config = next((model["config"] for h in ctx.vllm_hosts()
                   if h in ctx.facts and (model := ctx.facts[h].model or {}).get("config")), None)
    if config is None:
        return [skip("model-fit", TOPOLOGY_SUBJECT, "no host has the model's config.json yet", scope="topology")]
    spec = ctx.topo.model
    native = DTYPE_NAMES.get(str(config.get("torch_dtype") or config.get("dtype") or ""), None)
    limit = config.get("max_position_embeddings")
    lines = [f"config.json: torch_dtype={native}, max_position_embeddings={limit}",
             f"topology: dtype={spec.dtype}, max_model_len={spec.max_model_len}"]
    ev = Evidence("config.json vs model: in the topology", tuple(lines))
    if spec.max_model_len and limit and spec.max_model_len > limit and not config.get("rope_scaling"):
        return [
            fail(
                "model-fit",
                TOPOLOGY_SUBJECT,
                f"max_model_len {spec.max_model_len} > the model's {limit} positions",
                f"set model.max_model_len to at most {limit}",
                ev,
                scope="topology",
            )
        ]
    heads = kv_heads_from_config(config)
    for _, _, instance in ctx.topo.instances():
        problem = tp_problem(heads, instance.tensor_parallel_size) if heads else ""
        if problem:
            return [
                fail(
                    "model-fit",
                    TOPOLOGY_SUBJECT,
                    f"{instance.name}: TP size {instance.tensor_parallel_size} vs the "
                    f"model's {heads} KV heads: {problem}",
                    f"change {instance.name}'s tensor_parallel_size",
                    Evidence(
                        "config.json: KV heads vs each instance's TP size",
                        (
                            f"KV heads: {heads}",
                            *(f"{s.name}: TP {s.tensor_parallel_size}" for _, _, s in ctx.topo.instances()),
                        ),
                    ),
                    scope="topology",
                )
            ]
    if native and spec.dtype != "auto" and spec.dtype != native:
        risk = (
            "overflow risk"
            if (native, spec.dtype) == ("bfloat16", "float16")
            else "twice the memory"
            if spec.dtype == "float32"
            else "precision loss"
        )
        return [warn("model-fit", TOPOLOGY_SUBJECT, f"dtype {spec.dtype} differs from the model's {native} ({risk})",
                     f"set model.dtype: {native} (or auto)", ev, scope="topology")]
    sizes = sorted({s.tensor_parallel_size for _, _, s in ctx.topo.instances()})
    return [ok("model-fit", TOPOLOGY_SUBJECT, f"dtype {spec.dtype}, max_model_len {spec.max_model_len or limit}, "
               f"TP {'/'.join(map(str, sizes))} over {heads} KV heads fit", ev, scope="topology")]


CHECKS = [
    Check("model-present", "host", "model directory, config.json and weights on every vLLM host", check_model_present),
    Check("model-match", "topology", "same config and weights digest on every host", check_model_match),
    Check("model-fit", "topology", "dtype, max_model_len and every instance's TP size fit the model", check_model_fit),
]
