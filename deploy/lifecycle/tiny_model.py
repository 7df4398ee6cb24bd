"""Make a tiny Llama-style causal LM locally: random weights from a seed, a tokenizer trained here.

No model hub is reachable, so demos and tests use this. Same spec -> byte-identical files.
Runs wherever vLLM's Python stack is installed (torch, tokenizers, transformers, safetensors);
`kvpush up` runs it on each host that lacks the model: `python -m kvpush.deploy.lifecycle.tiny_model PATH --spec JSON`.
"""
from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
from pathlib import Path

from kvpush.deploy.topology.topology import TinyModelSpec

MARKER = "kvpush-tiny-model.json"  # written last: its presence means the model is complete

_WORDS = (
    "the a an of to in and or but if then else when while for with without from into over under "
    "cache block layer token prompt decode prefill transfer memory remote local agent request "
    "server router engine model weight tensor shape stride offset buffer write read push pull "
    "fast slow small large first last next step time queue batch stream answer question value "
    "python function return class import yield async await raise error retry timeout host port "
    "cat dog bird tree river mountain city road light dark warm cold blue green red yellow "
    "one two three four five six seven eight nine ten hundred thousand zero many few all none "
    "is are was were be been being has have had do does did can could will would should may"
).split()


def describe(spec: TinyModelSpec) -> str:
    kv_bytes = 2 * spec.layers * spec.kv_heads * spec.head_dim * 2  # K and V, bf16
    return (
        f"seed {spec.seed}, {spec.layers} layers, hidden {spec.hidden_size}, {spec.heads} heads, "
        f"{spec.kv_heads} KV heads x {spec.head_dim}, vocab {spec.vocab_size}; {kv_bytes} bytes of KV per token"
    )


def _corpus(seed: int, lines: int = 4000) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 16))]
        if rng.random() < 0.3:
            words.append(str(rng.randint(0, 99999)))
        out.append(" ".join(words) + rng.choice([".", "?", "!", ":", ","]))
    return out


def _write_tokenizer(path: Path, spec: TinyModelSpec) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        special_tokens=["<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(spec.seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    fast.save_pretrained(str(path))


def _config(spec: TinyModelSpec, vocab_size: int) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.hidden_size * 2,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads,
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "vocab_size": vocab_size,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": 2,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "attention_bias": False,
        "mlp_bias": False,
    }


def _weights(spec: TinyModelSpec, vocab_size: int) -> dict:
    import torch

    gen = torch.Generator().manual_seed(spec.seed)
    h, i = spec.hidden_size, spec.hidden_size * 2
    q, kv = spec.heads * spec.head_dim, spec.kv_heads * spec.head_dim

    def rand(*shape: int):
        return (torch.randn(*shape, generator=gen) * 0.02).to(torch.bfloat16)

    weights = {"model.embed_tokens.weight": rand(vocab_size, h)}
    for n in range(spec.layers):
        p = f"model.layers.{n}."
        weights.update({
            p + "self_attn.q_proj.weight": rand(q, h),
            p + "self_attn.k_proj.weight": rand(kv, h),
            p + "self_attn.v_proj.weight": rand(kv, h),
            p + "self_attn.o_proj.weight": rand(h, q),
            p + "mlp.gate_proj.weight": rand(i, h),
            p + "mlp.up_proj.weight": rand(i, h),
            p + "mlp.down_proj.weight": rand(h, i),
            p + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
            p + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
        })
    weights["model.norm.weight"] = torch.ones(h, dtype=torch.bfloat16)
    weights["lm_head.weight"] = rand(vocab_size, h)
    return weights


def make_tiny_model(path: str | Path, spec: TinyModelSpec, force: bool = False) -> bool:
    """Create the model at path; False if a complete one with the same spec is already there."""
    from safetensors.torch import save_file

    path = Path(path).expanduser()
    marker = path / MARKER
    wanted = spec.model_dump(mode="json")
    if marker.is_file() and not force and json.loads(marker.read_text()) == wanted:
        return False
    tmp = path.with_name(path.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    _write_tokenizer(tmp, spec)
    vocab_size = len(json.loads((tmp / "tokenizer.json").read_text())["model"]["vocab"])
    (tmp / "config.json").write_text(json.dumps(_config(spec, vocab_size), indent=2, sort_keys=True) + "\n")
    (tmp / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 0, "eos_token_id": 1, "do_sample": False}, indent=2) + "\n"
    )
    save_file(_weights(spec, vocab_size), str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / MARKER).write_text(json.dumps(wanted, indent=2, sort_keys=True) + "\n")
    if path.exists():
        shutil.rmtree(path)
    tmp.rename(path)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="make kvpush's tiny local model")
    parser.add_argument("path")
    parser.add_argument("--spec", default="{}", help="TinyModelSpec as JSON")
    parser.add_argument("--force", action="store_true")
    args = parser.parse_args(argv)
    spec = TinyModelSpec.model_validate_json(args.spec)
    made = make_tiny_model(args.path, spec, force=args.force)
    print(f"{'made' if made else 'kept existing'} {args.path}: {describe(spec)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
