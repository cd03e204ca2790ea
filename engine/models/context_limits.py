"""What context a model's attention supports here, from its config alone: a
sliding window (``check_sliding_window``) or LongRoPE's long factors (``check_rope_scaling``) shorter
than the sequences allowed are refused rather than run as something else. The workers check the loaded
config (``engine.models.loader``); ``pdserve up`` checks the model's ``config.json`` before starting any
process (``context_problem``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PretrainedConfig

# model types whose config keeps ``sliding_window`` only with ``use_sliding_window`` (transformers' rule)
GATED_WINDOW_TYPES = frozenset({"qwen2", "qwen2_moe", "qwen3", "qwen3_moe"})


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
        raise ValueError(window_message(int(window), length))


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
        raise ValueError(longrope_message(length, original))


def context_problem(config: dict[str, Any], max_model_len: int | None) -> str | None:
    """Why a model with HF config ``config`` (its ``config.json`` as a dict) cannot serve sequences of
    ``max_model_len`` tokens (None: the config's ``max_position_embeddings``) here, as the workers would
    refuse it after loading (``check_sliding_window``, ``check_rope_scaling``), or None. Read from the
    dict alone, without transformers (``pdserve up`` stays light): ``sliding_window`` counts unless the
    model type keeps it only with ``use_sliding_window`` (``GATED_WINDOW_TYPES``) and that is off;
    LongRoPE is ``rope_parameters`` / ``rope_scaling`` of type ``longrope`` (or its old name ``su``). The
    workers' check on the loaded config stays the authority."""
    limit = config.get("max_position_embeddings")
    if not isinstance(limit, int | float):
        return None
    length = max_model_len or int(limit)
    window = config.get("sliding_window")
    if config.get("model_type") in GATED_WINDOW_TYPES and not config.get("use_sliding_window", False):
        window = None
    if isinstance(window, int | float) and int(window) < length:
        return window_message(int(window), length)
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if not isinstance(rope, dict) or (rope.get("rope_type") or rope.get("type")) not in ("longrope", "su"):
        return None
    original = rope.get("original_max_position_embeddings") or config.get("original_max_position_embeddings")
    original = int(original) if isinstance(original, int | float) else int(limit)
    if length > original:
        return longrope_message(length, original)
    return None


def window_message(window: int, max_model_len: int) -> str:
    """The refusal of a ``sliding_window`` shorter than ``max_model_len`` (both in tokens)."""
    return (f"sliding_window={window} < max_model_len={max_model_len}: sliding-window attention is not "
            f"supported (every token would attend to the whole sequence); set max_model_len <= {window}")


def longrope_message(max_model_len: int, original: int) -> str:
    """The refusal of LongRoPE when ``max_model_len`` exceeds ``original_max_position_embeddings``."""
    return (f"rope_scaling longrope with max_model_len={max_model_len} > original_max_position_embeddings="
            f"{original}: LongRoPE's long factors are not supported (transformers picks them per batch); "
            f"set max_model_len <= {original}")
