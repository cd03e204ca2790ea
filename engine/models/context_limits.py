"""What context a model's attention supports here, from its transformers config alone (no torch): a
sliding window (``check_sliding_window``) or LongRoPE's long factors (``check_rope_scaling``) shorter
than the sequences allowed are refused rather than run as something else. The workers check the loaded
config (``engine.models.loader``); ``pdserve up`` checks the model's ``config.json`` before starting any
process (``context_problem``).
"""

from __future__ import annotations

from typing import Any

from transformers import AutoConfig, PretrainedConfig


def check_sliding_window(hf_config: PretrainedConfig, max_model_len: int | None) -> None:
    """Refuse a model whose attention looks back only ``sliding_window`` tokens when a sequence may be
    longer than that: the paged attention here always attends to the whole sequence, which would
    silently change such a model's outputs past the window.

    Raises:
        ValueError: ``sliding_window`` is set and below ``max_model_len`` (default: the config's
            ``max_position_embeddings``); the message names both and how to fit.
    """
    window = getattr(hf_config, "sliding_window", None)
    length = max_model_len or int(hf_config.max_position_embeddings)
    if window is not None and int(window) < length:
        raise ValueError(
            f"sliding_window={window} < max_model_len={length}: sliding-window attention is not supported "
            f"(every token would attend to the whole sequence); set max_model_len <= {window}")


def check_rope_scaling(hf_config: PretrainedConfig, max_model_len: int | None) -> None:
    """Refuse LongRoPE (Phi-3's ``rope_scaling`` type ``longrope``, formerly ``su``) when a sequence may
    outgrow ``original_max_position_embeddings``: transformers then switches every position to the long
    factors by the longest sequence of the batch, so in a batch packing several sequences one sequence's
    length would change the others' rotations (and the K/V already cached used the short factors). Within
    the original context the short factors always apply, per sequence, as in transformers.

    Raises:
        ValueError: the RoPE type is ``longrope`` and ``max_model_len`` (default: the config's
            ``max_position_embeddings``) exceeds ``original_max_position_embeddings``; the message names
            both and how to fit.
    """
    rope = getattr(hf_config, "rope_parameters", None) or {}
    if rope.get("rope_type") != "longrope":
        return
    original = int(rope.get("original_max_position_embeddings")
                   or getattr(hf_config, "original_max_position_embeddings", None)
                   or hf_config.max_position_embeddings)
    length = max_model_len or int(hf_config.max_position_embeddings)
    if length > original:
        raise ValueError(
            f"rope_scaling longrope with max_model_len={length} > "
            f"original_max_position_embeddings={original}: "
            f"LongRoPE's long factors are not supported (transformers picks them per batch); set "
            f"max_model_len <= {original}")


def context_problem(config: dict[str, Any], max_model_len: int | None) -> str | None:
    """Why a model with HF config ``config`` (its ``config.json`` as a dict) cannot serve sequences of
    ``max_model_len`` tokens (None: the config's ``max_position_embeddings``) here, as the workers would
    refuse it after loading (``check_sliding_window``, ``check_rope_scaling``), or None. The dict is read
    through transformers' config class for its ``model_type``, which applies the model's own defaults (a
    Qwen2 ``sliding_window`` counts only with ``use_sliding_window``); a ``model_type`` transformers does
    not know gives None (the architecture check refuses such a model first)."""
    model_type = config.get("model_type")
    if not isinstance(model_type, str):
        return None
    try:
        hf_config = AutoConfig.for_model(model_type, **{k: v for k, v in config.items() if k != "model_type"})
    except (ValueError, KeyError, TypeError):
        return None
    try:
        check_sliding_window(hf_config, max_model_len)
        check_rope_scaling(hf_config, max_model_len)
    except ValueError as exc:
        return str(exc)
    return None
