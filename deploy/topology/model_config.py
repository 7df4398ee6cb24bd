"""What kvpush reads of a model's config.json: how many KV heads tensor parallelism splits."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def kv_heads_from_config(config: dict[str, Any]) -> int | None:
    """KV heads of a Hugging Face config: num_key_value_heads (GQA), else num_attention_heads
    (MHA); 1 for a latent (MLA) cache, which every TP rank holds whole. None if it says neither."""
    if config.get("kv_lora_rank"):
        return 1
    for key in ("num_key_value_heads", "num_attention_heads"):
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def kv_heads_of(model_dir: Path) -> int | None:
    """From the model's config.json where the model is on this machine; None otherwise."""
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return kv_heads_from_config(config) if isinstance(config, dict) else None
