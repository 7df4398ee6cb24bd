"""Real vLLM on one GPU: kvpush's connector between a prefill and a decode instance, through
kvpush's router, against a plain vLLM instance (colocated serving) on the same GPU.

One call does the whole session, so that it fits one lease of the GPU machine:
  1. a Llama-3.1-8B-shaped model directory (config + a word-level tokenizer over its 128,256 ids;
     `--load-format dummy` gives every instance the same seeded random weights);
  2. three instances at once (reference, prefill, decode; each its own `--kv-cache-memory-bytes`
     and port, prefix caching off) and kvpush's router in front of prefill + decode;
  3. correctness: greedy answers through the router equal the reference's, for block-edge prompt
     lengths and for `--concurrent` prompts at once; decode's `prompt_tokens_by_source` counters
     and kvpush's byte counters over that phase;
  4. TTFT per prompt length, kvpush vs colocated, paired per round (the two modes take turns on the
     same prompt), one request at a time; prefill's pushed bytes over its WRITE seconds per length;
  5. a device-to-device copy of a 16k prompt's KV, the ceiling the push is compared with.
Raw per-request records and the summary go to `--out` (the servers' logs compressed beside them).

  python3 benchmarks/gpu_real_vllm.py --out $OUT            # on the GPU host, vLLM on PYTHONPATH
  python3 benchmarks/gpu_real_vllm.py --cpu-smoke --out /tmp/smoke   # this script's plumbing on CPU vLLM
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LLAMA_31_8B = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096, intermediate_size=14336,
    num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=128256,
    max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0, hidden_act="silu",
    rope_scaling={"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    tie_word_embeddings=False, torch_dtype="bfloat16", bos_token_id=0, eos_token_id=1,
    attention_bias=False, mlp_bias=False,
)
KV_BYTES_PER_TOKEN = 2 * 32 * 8 * 128 * 2  # K+V x layers x KV heads x head_dim x bf16 = 128 KiB
EDGES = (1, 15, 16, 17, 127, 128, 129, 255, 256, 257, 1023, 1024, 1025, 4095, 4096, 4097, 16383, 16384)
PORTS = {"reference": 8000, "prefill": 8100, "decode": 8200, "router": 9000}
SIDE_CHANNEL_PORT = 5700


# ---- the model directory -------------------------------------------------------------------------
def write_model(path: Path, config: dict) -> None:
    """config.json of the shape, and a word-level tokenizer with one word per token id ("t<id>"),
    so any id a random-weight model generates decodes to a distinct word."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    path.mkdir(parents=True, exist_ok=True)
    vocab = {f"t{i}": i for i in range(config["vocab_size"])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t2"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))
    # written by hand: transformers releases name their own classes differently in what they save
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "t0", "eos_token": "t1", "unk_token": "t2",
        "model_max_length": config["max_position_embeddings"], "clean_up_tokenization_spaces": False}))
    (path / "config.json").write_text(json.dumps(config, indent=1))
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": 1}))


def write_secrets(secret_path: Path, params_key_path: Path) -> None:
    """The deployment secret the connectors authenticate with, and the key the router signs each
    leg's kv_transfer_params with (derived from it), as `kvpush up` writes them."""
    sys.path.insert(0, str(kvpush_root()))
    from kvpush.common.deployment_secret import TRANSFER_PARAMS, derive_token, new_secret, secret_file_text

    secret = new_secret()
    for path, text in ((secret_path, secret_file_text(secret)), (params_key_path, derive_token(secret, TRANSFER_PARAMS) + "\n")):
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text)


def kvpush_root() -> Path:
    """A folder holding `kvpush` -> this checkout, for PYTHONPATH (the GPU host has no kvpush install)."""
    root = Path("/tmp/kvpush-path")
    root.mkdir(exist_ok=True)
    link = root / "kvpush"
    if not link.exists():
        link.symlink_to(REPO)
    return root


# ---- processes -----------------------------------------------------------------------------------
class Processes:
    """Servers started in their own sessions, stopped as whole groups (vLLM's EngineCore outlives a
    killed API server otherwise)."""

    def __init__(self, logs: Path):
        self.logs = logs
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, cmd: list[str], env: dict[str, str]) -> None:
        log = open(self.logs / f"{name}.log", "w")
        self.procs[name] = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def alive(self, name: str) -> bool:
        return self.procs[name].poll() is None

    def stop_all(self) -> None:
        for p in self.procs.values():
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 20
        for p in self.procs.values():
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def server_cmd(args, name: str, kv_config: dict | None) -> list[str]:
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(args.model_dir),
           "--served-model-name", "m", "--host", "127.0.0.1", "--port", str(PORTS[name]),
           "--max-model-len", str(args.max_model_len), "--no-enable-prefix-caching", "--seed", "0",
           "--max-num-seqs", "64"]
    if args.cpu_smoke:
        cmd += ["--dtype", "float32", "--max-num-batched-tokens", str(args.max_model_len)]
    else:
        cmd += ["--load-format", "dummy", "--dtype", "bfloat16", "--enforce-eager",
                "--gpu-memory-utilization", str(args.gpu_util), "--kv-cache-memory-bytes", str(args.kv_cache_bytes)]
    if kv_config is not None:
        cmd += ["--kv-transfer-config", json.dumps(kv_config)]
    return cmd


def kvpush_config(args, role: str) -> dict:
    prefill = role == "prefill"
    extra = {"backend": "UCX", "side_channel_host": "127.0.0.1", "side_channel_port": SIDE_CHANNEL_PORT,
             "allowed_engines": ["gpu.decode" if prefill else "gpu.prefill"], "secret_file": str(args.secret),
             "transfer_timeout_s": 30, "verify_kv": args.verify_kv}
    if not prefill:
        extra["peer_side_channels"] = {"gpu.prefill": f"127.0.0.1:{SIDE_CHANNEL_PORT}"}
    return {"kv_connector": "KVPushConnector", "kv_connector_module_path": "kvpush.connector",
            "kv_role": "kv_producer" if prefill else "kv_consumer", "engine_id": f"gpu.{role}",
            "kv_buffer_device": "cpu" if args.cpu_smoke else "cuda", "kv_connector_extra_config": extra}


def nixl_pull_config(args, role: str) -> dict:
    """vLLM's own NixlConnector (decode READs the KV), the stock class."""
    return {"kv_connector": "NixlConnector", "kv_role": "kv_both", "engine_id": f"gpu.{role}",
            "kv_buffer_device": "cpu" if args.cpu_smoke else "cuda"}


def pd_config(args, role: str) -> dict:
    return kvpush_config(args, role) if args.pd == "kvpush" else nixl_pull_config(args, role)


def server_env(args, name: str) -> dict[str, str]:
    env = dict(os.environ)
    if args.v1_runner:  # vLLM 0.25's V1 model runner: it allocates the cross-layer KV cache kvpush asks for
        env["VLLM_USE_V2_MODEL_RUNNER"] = "0"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(kvpush_root()), env.get("PYTHONPATH")]))
    env.update(PYTHONUNBUFFERED="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", VLLM_USE_FLASHINFER_SAMPLER="0", VLLM_LOG_STATS_INTERVAL="1",
               NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    if name in ("prefill", "decode"):
        env["UCX_PROTO_INFO"] = "y"  # UCX prints the protocol (and transport) it picks per operation
        env["VLLM_LOGGING_LEVEL"] = "INFO"
        env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = "127.0.0.1"
        env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(SIDE_CHANNEL_PORT + (0 if name == "prefill" else 1))
    if args.cpu_smoke and name != "router":
        cores = {"reference": "0", "prefill": "0", "decode": "1"}[name]
        env.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND=cores, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    return env


def router_config(args) -> Path:
    up = lambda name: {"name": name, "url": f"http://127.0.0.1:{PORTS[name]}", "engine_id": f"gpu.{name}",  # noqa: E731
                       "side_channel_host": "127.0.0.1",
                       "side_channel_port": SIDE_CHANNEL_PORT + (0 if name == "prefill" else 1)}
    config = {"bind": "127.0.0.1", "port": PORTS["router"], "protocol": args.pd, "served_model_name": "m",
              "prefill": [up("prefill")], "decode": [up("decode")]}
    if args.pd == "kvpush":
        config["transfer_params_key_file"] = str(args.params_key)
    path = args.work / "router.json"
    path.write_text(json.dumps(config))
    return path


async def wait_healthy(session, names: list[str], procs: Processes, timeout_s: float) -> dict[str, float]:
    import aiohttp

    t0, ready = time.monotonic(), {}
    while len(ready) < len(names):
        for name in names:
            if name in ready:
                continue
            if not procs.alive(name):
                raise RuntimeError(f"{name} exited during start-up; see its log")
            try:
                async with session.get(f"http://127.0.0.1:{PORTS[name]}/health", timeout=aiohttp.ClientTimeout(total=2)) as r:
                    if r.status == 200:
                        ready[name] = round(time.monotonic() - t0, 1)
                        print(f"{name} healthy after {ready[name]} s", flush=True)
            except (aiohttp.ClientError, asyncio.TimeoutError):
                pass
        if time.monotonic() - t0 > timeout_s:
            raise RuntimeError(f"not healthy after {timeout_s:.0f} s: {sorted(set(names) - set(ready))}")
        await asyncio.sleep(1)
    return ready


# ---- requests and metrics ------------------------------------------------------------------------
async def complete(session, port: int, prompt: list[int], max_tokens: int) -> dict:
    """One streamed greedy completion: TTFT (first text chunk), end-to-end, the text."""
    body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    t0 = time.perf_counter()
    first, chunks, text, status = None, 0, [], None
    try:
        async with session.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as r:
            status = r.status
            if status != 200:
                return {"ok": False, "status": status, "error": (await r.text())[:300]}
            async for raw in r.content:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                piece = json.loads(line[5:])["choices"][0].get("text", "")
                if piece and first is None:
                    first = time.perf_counter() - t0
                chunks += 1
                text.append(piece)
    except Exception as exc:  # a failed request is a record too
        return {"ok": False, "status": status, "error": repr(exc)[:300]}
    e2e = time.perf_counter() - t0
    out_tokens = len("".join(text).split())
    return {"ok": first is not None, "status": status, "ttft_s": first, "e2e_s": e2e, "text": "".join(text),
            "out_tokens": out_tokens,
            "tpot_s": (e2e - first) / (out_tokens - 1) if first is not None and out_tokens > 1 else None}


_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([-+0-9.eEinfNa]+)$')


async def metrics(session, port: int) -> dict[str, float]:
    """Every sample of an instance's /metrics, summed over label sets except `source`."""
    async with session.get(f"http://127.0.0.1:{port}/metrics") as r:
        text = await r.text()
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line.strip())
        if not m:
            continue
        name, labels, value = m.groups()
        src = re.search(r'source="([^"]+)"', labels or "")
        key = f"{name}[{src.group(1)}]" if src else name
        out[key] = out.get(key, 0.0) + float(value)
    return out


def delta(after: dict, before: dict, *keys: str) -> dict:
    return {k: after.get(k, 0.0) - before.get(k, 0.0) for k in keys}


D_KEYS = ("vllm:prompt_tokens_by_source_total[external_kv_transfer]", "vllm:prompt_tokens_by_source_total[local_compute]",
          "vllm:prompt_tokens_by_source_total[local_cache_hit]", "vllm:kvpush_received_bytes_sum",
          "vllm:kvpush_pushes_received_total", "vllm:kvpush_failed_transfers_total")
P_KEYS = ("vllm:kvpush_sent_bytes_sum", "vllm:kvpush_write_seconds_sum", "vllm:kvpush_write_seconds_count",
          "vllm:kvpush_pushes_sent_total", "vllm:kvpush_failed_transfers_total",
          "vllm:kvpush_prefill_end_to_write_done_seconds_sum")
# vLLM's NixlConnector counts its READs on decode
PULL_KEYS = ("vllm:nixl_bytes_transferred_sum", "vllm:nixl_xfer_time_seconds_sum", "vllm:nixl_xfer_time_seconds_count",
             "vllm:nixl_num_descriptors_sum", "vllm:nixl_num_failed_transfers_total")


VOCAB = [LLAMA_31_8B["vocab_size"]]  # the served model's, set in main()


def prompt(rng: random.Random, n: int) -> list[int]:
    """n random token ids (0 and 1 are BOS/EOS of the made-up tokenizer)."""
    return [rng.randrange(2, VOCAB[0]) for _ in range(n)]


async def correctness(args, session, rng, records: list) -> dict:
    lengths = [n for n in EDGES if n + args.check_tokens <= args.max_model_len]
    before_d, before_p = await metrics(session, PORTS["decode"]), await metrics(session, PORTS["prefill"])
    prompts = [prompt(rng, n) for n in lengths]
    sizes = [rng.randrange(64, args.concurrent_max_len) for _ in range(args.concurrent)]
    concurrent = [prompt(rng, n) for n in sizes]
    results = {"edges": [], "concurrent": []}
    for p in prompts:  # one at a time
        ref = await complete(session, PORTS["reference"], p, args.check_tokens)
        pd = await complete(session, PORTS["router"], p, args.check_tokens)
        results["edges"].append((len(p), ref, pd))
    refs = await asyncio.gather(*(complete(session, PORTS["reference"], p, args.check_tokens) for p in concurrent))
    pds = await asyncio.gather(*(complete(session, PORTS["router"], p, args.check_tokens) for p in concurrent))
    results["concurrent"] = [(len(p), r, d) for p, r, d in zip(concurrent, refs, pds)]
    await asyncio.sleep(2.5)  # the stats logger's interval
    after_d, after_p = await metrics(session, PORTS["decode"]), await metrics(session, PORTS["prefill"])
    summary = {}
    for phase, items in results.items():
        equal, first_diff = 0, []
        for n, ref, pd in items:
            same = ref.get("ok") and pd.get("ok") and ref["text"] == pd["text"]
            equal += bool(same)
            if not same:
                a, b = (ref.get("text") or "").split(), (pd.get("text") or "").split()
                at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                first_diff.append({"prompt_tokens": n, "first_different_token": at, "ref_ok": ref.get("ok"),
                                   "pd_ok": pd.get("ok"), "pd_error": pd.get("error")})
            records.append({"phase": f"correctness-{phase}", "prompt_tokens": n, "reference": ref, args.pd: pd,
                            "equal": bool(same)})
        summary[phase] = {"prompts": len(items), "equal": equal, "differences": first_diff}
    summary["prompt_tokens_sent"] = sum(lengths) + sum(sizes)
    summary["decode_metrics_delta"] = delta(after_d, before_d, *D_KEYS, *PULL_KEYS)
    summary["prefill_metrics_delta"] = delta(after_p, before_p, *P_KEYS)
    return summary


async def ttft(args, session, rng, records: list, deadline: float) -> dict:
    modes = {"colocated": PORTS["reference"], args.pd: PORTS["router"]}
    per_length = {}
    for n in args.lengths:
        if time.monotonic() > deadline:
            print(f"TTFT: out of time before {n}-token prompts", flush=True)
            break
        before_p, before_d = await metrics(session, PORTS["prefill"]), await metrics(session, PORTS["decode"])
        done = 0
        for r in range(args.rounds):
            if time.monotonic() > deadline:
                break
            p = prompt(rng, n)
            order = list(modes) if r % 2 == 0 else list(reversed(modes))
            for mode in order:
                res = await complete(session, modes[mode], p, args.out_tokens)
                res.pop("text", None)
                records.append({"phase": "ttft", "mode": mode, "prompt_tokens": n, "round": r, **res})
            done += 1
        await asyncio.sleep(2.5)
        d = delta(await metrics(session, PORTS["prefill"]), before_p, *P_KEYS)
        dd = delta(await metrics(session, PORTS["decode"]), before_d, *D_KEYS, *PULL_KEYS)
        if args.pd == "kvpush":
            moved, secs, count = (d["vllm:kvpush_sent_bytes_sum"], d["vllm:kvpush_write_seconds_sum"],
                                  d["vllm:kvpush_pushes_sent_total"])
        else:
            moved, secs, count = (dd["vllm:nixl_bytes_transferred_sum"], dd["vllm:nixl_xfer_time_seconds_sum"],
                                  dd["vllm:nixl_xfer_time_seconds_count"])
        per_length[n] = {"rounds": done, "prefill_metrics_delta": d, "decode_metrics_delta": dd,
                         "transfer_gb_per_s": (moved / secs / 1e9) if secs > 0 else None,
                         "transfer_bytes_per_request": moved / max(1.0, count)}
        print(f"{n} tokens: {done} rounds; KV transfer {per_length[n]['transfer_gb_per_s']} GB/s", flush=True)
    return per_length


PROBE_CASES = ("gap-0s", "gap-1.5s", "after-colocated", "after-two-colocated", "after-colocated-same-prompt")


async def idle_probe(args, session, rng, records: list) -> dict:
    """What makes a P/D request slower: the pair sitting idle, the colocated instance using the GPU
    before it, or the colocated instance having just served the same prompt? For each length: a
    warm P/D request, then what the case names, then the measured P/D request."""
    out: dict = {}
    for n in args.idle_probe_lengths:
        rows: dict[str, list[float]] = {}
        for rep in range(args.idle_probe_rounds):
            for case in PROBE_CASES:
                await complete(session, PORTS["router"], prompt(rng, n), args.out_tokens)
                measured = prompt(rng, n)
                if case.startswith("gap-"):
                    await asyncio.sleep(float(case[4:-1]))
                for _ in range({"after-colocated": 1, "after-two-colocated": 2}.get(case, 0)):
                    await complete(session, PORTS["reference"], prompt(rng, n), args.out_tokens)
                if case == "after-colocated-same-prompt":
                    await complete(session, PORTS["reference"], measured, args.out_tokens)
                res = await complete(session, PORTS["router"], measured, args.out_tokens)
                res.pop("text", None)
                records.append({"phase": "idle-probe", "case": case, "prompt_tokens": n, "round": rep, **res})
                if res.get("ok"):
                    rows.setdefault(case, []).append(round(res["ttft_s"] * 1e3, 1))
        out[n] = rows
        print(f"idle probe, {n} tokens, TTFT ms per case: {rows}", flush=True)
    return out


def stats(records: list, pd: str) -> dict:
    import statistics

    def pct(xs, q):
        xs = sorted(xs)
        return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else None

    out: dict = {}
    ttft_recs = [r for r in records if r["phase"] == "ttft"]
    for n in sorted({r["prompt_tokens"] for r in ttft_recs}):
        row = {}
        for mode in ("colocated", pd):
            xs = [r["ttft_s"] for r in ttft_recs if r["prompt_tokens"] == n and r["mode"] == mode and r["ok"]]
            tp = [r["tpot_s"] for r in ttft_recs if r["prompt_tokens"] == n and r["mode"] == mode and r.get("tpot_s")]
            row[mode] = {"n": len(xs), "failed": sum(1 for r in ttft_recs if r["prompt_tokens"] == n and r["mode"] == mode and not r["ok"]),
                         "ttft_p50_ms": pct(xs, 0.5) and pct(xs, 0.5) * 1e3, "ttft_p99_ms": pct(xs, 0.99) and pct(xs, 0.99) * 1e3,
                         "tpot_p50_ms": pct(tp, 0.5) and pct(tp, 0.5) * 1e3}
        pairs = {}
        for r in ttft_recs:
            if r["prompt_tokens"] == n and r["ok"]:
                pairs.setdefault(r["round"], {})[r["mode"]] = r["ttft_s"]
        ratios = [v[pd] / v["colocated"] for v in pairs.values() if len(v) == 2]
        row["paired_ttft_ratio_median"] = statistics.median(ratios) if ratios else None
        row["paired_ttft_ratios"] = ratios
        out[n] = row
    return out


def device_copy_gb_per_s(nbytes: int) -> float | None:
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_(0, 255)
    b = torch.empty_like(a)
    times = []
    for _ in range(6):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    del a, b
    torch.cuda.empty_cache()
    return nbytes / sorted(times[1:])[2] / 1e9


async def session_main(args, procs: Processes) -> dict:
    import aiohttp

    rng = random.Random(args.seed)
    result: dict = {"argv": sys.argv, "pd": args.pd, "model": "Llama-3.1-8B shape" if not args.cpu_smoke else "tiny (CPU smoke)"}
    deadline = time.monotonic() + args.budget_s
    for name, kv in (("reference", None), ("prefill", pd_config(args, "prefill")), ("decode", pd_config(args, "decode"))):
        procs.start(name, server_cmd(args, name, kv), server_env(args, name))
    records: list = []
    timeout = aiohttp.ClientTimeout(total=args.request_timeout_s)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        result["healthy_after_s"] = await wait_healthy(session, ["reference", "prefill", "decode"], procs, args.start_timeout_s)
        procs.start("router", [sys.executable, "-m", "kvpush.router", "--config", str(router_config(args))],
                    server_env(args, "router"))
        result["healthy_after_s"].update(await wait_healthy(session, ["router"], procs, 60))
        for warm in (64, 2048):  # first requests pay one-off costs (handshake, UCX wire-up, kernels)
            await complete(session, PORTS["router"], prompt(rng, warm), 4)
            await complete(session, PORTS["reference"], prompt(rng, warm), 4)
        try:
            result["correctness"] = await correctness(args, session, rng, records)
            print("correctness:", json.dumps({k: v for k, v in result["correctness"].items() if k != "decode_metrics_delta"})[:1500], flush=True)
            print("decode counters:", json.dumps(result["correctness"]["decode_metrics_delta"]), flush=True)
            result["transfer_per_length"] = await ttft(args, session, rng, records, deadline)
            if args.idle_probe_rounds:
                result["idle_probe_ttft_ms"] = await idle_probe(args, session, rng, records)
        finally:
            result["ttft"] = stats(records, args.pd)
            (args.out / "requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--work", type=Path, default=Path("/tmp/gpu-real-vllm"))
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny model on CPU vLLM: checks this script's plumbing")
    ap.add_argument("--pd", choices=("kvpush", "nixl-pull"), default="kvpush",
                    help="the prefill/decode pair: kvpush's connector, or vLLM's own NixlConnector (pull)")
    ap.add_argument("--model-dir", type=Path, help="default: a Llama-3.1-8B-shaped directory made under --work")
    ap.add_argument("--max-model-len", type=int, default=16640)
    ap.add_argument("--gpu-util", type=float, default=0.25)
    ap.add_argument("--kv-cache-bytes", type=int, default=5 << 30)
    ap.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")], default=[1024, 4096, 16384])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--out-tokens", type=int, default=16)
    ap.add_argument("--check-tokens", type=int, default=32)
    ap.add_argument("--concurrent", type=int, default=24)
    ap.add_argument("--concurrent-max-len", type=int, default=1500)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--budget-s", type=float, default=400, help="no new TTFT length starts after this")
    ap.add_argument("--start-timeout-s", type=float, default=240)
    ap.add_argument("--verify-kv", action="store_true", help="kvpush: connector.verify_kv on both sides")
    ap.add_argument("--v1-runner", action="store_true",
                    help="every instance on vLLM's V1 model runner (VLLM_USE_V2_MODEL_RUNNER=0; vLLM 0.25)")
    ap.add_argument("--idle-probe-rounds", type=int, default=0, help="rounds of the idle probe (0: skip it)")
    ap.add_argument("--idle-probe-lengths", type=lambda s: [int(x) for x in s.split(",")], default=[4096, 16384])
    ap.add_argument("--request-timeout-s", type=float, default=120)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    args.secret, args.params_key = args.work / "deployment.secret", args.work / "router-params.key"
    write_secrets(args.secret, args.params_key)
    if args.model_dir is None:
        args.model_dir = args.work / "model"
        write_model(args.model_dir, LLAMA_31_8B)
    VOCAB[0] = json.loads((args.model_dir / "config.json").read_text())["vocab_size"]
    logs = args.work / "logs"
    logs.mkdir(exist_ok=True)
    procs = Processes(logs)
    result: dict = {}
    try:
        result = asyncio.run(session_main(args, procs))
    except Exception as exc:
        result["error"] = repr(exc)
        print("FAILED:", repr(exc), flush=True)
    finally:
        procs.stop_all()
        if not args.cpu_smoke:
            result["device_copy_16k_kv_gb_per_s"] = device_copy_gb_per_s(16384 * KV_BYTES_PER_TOKEN)
        with tarfile.open(args.out / "logs.tar.xz", "w:xz") as tar:
            tar.add(logs, arcname="logs")
        (args.out / "summary.json").write_text(json.dumps(result, indent=1, default=str))
    print(json.dumps({k: result.get(k) for k in ("healthy_after_s", "ttft", "transfer_per_length", "idle_probe_ttft_ms",
                                                 "device_copy_16k_kv_gb_per_s", "error")}, indent=1, default=str))
    if result.get("error"):
        sys.exit(1)


if __name__ == "__main__":
    main()
