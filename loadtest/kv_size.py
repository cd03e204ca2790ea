"""The KV-cache size of one token, from a Hugging Face model config (``config.json``).

A decoder layer keeps a key and a value vector per KV head for every token, so one token's KV over the
whole model is ``2 * num_hidden_layers * num_key_value_heads * head_dim * dtype bytes`` (the formula of
vLLM's and SGLang's KV-cache sizing). ``num_key_value_heads`` defaults to ``num_attention_heads`` (no
grouped-query attention) and ``head_dim`` to ``hidden_size // num_attention_heads``, as transformers'
Llama-family configs do.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def kv_bytes_per_token(config: dict[str, Any], dtype: str) -> int:
    """Bytes of KV one token takes over all layers, K and V together, in ``dtype``.

    Raises ValueError naming a missing or bad config key, or an unknown ``dtype`` (one of ``DTYPE_BYTES``).
    """
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"KV dtype must be one of {', '.join(DTYPE_BYTES)}, got {dtype!r}")
    cfg = config.get("text_config", config) if isinstance(config.get("text_config"), dict) else config

    def positive(key: str, default: Any = None) -> int:
        value = cfg.get(key, default)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"model config: {key} must be a positive integer, got {value!r}")
        return value

    layers, heads = positive("num_hidden_layers"), positive("num_attention_heads")
    kv_heads = positive("num_key_value_heads", heads)
    head_dim = positive("hidden_size") // heads if cfg.get("head_dim") is None else positive("head_dim")
    return 2 * layers * kv_heads * head_dim * DTYPE_BYTES[dtype]


def load_model_config(path: str | Path) -> dict[str, Any]:
    """The JSON object in ``path`` (a ``config.json``, or a model directory holding one).

    Raises OSError when unreadable, ValueError when it is not a JSON object.
    """
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    data = json.loads(p.read_text(encoding="utf-8"))
    if not isinstance(data, dict):
        raise ValueError(f"{p}: a model config is a JSON object")
    return data
