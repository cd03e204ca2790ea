"""Route transformers' attention calls to pdserve's paged-attention backends.

transformers (≥ 4.48) lets a model's attention be replaced by name: ``AttentionInterface.register`` maps
a name to a function ``fn(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw)``;
``AttentionMaskInterface.register`` with a function returning ``None`` stops transformers from building a
dense mask (the backend applies causality from the metadata); ``model.set_attn_implementation(name)``
switches a loaded model over. Keyword arguments given to ``model(...)`` reach ``fn`` unchanged, which is
how the step's ``AttentionMetadata``, the ``KVCachePool`` and the backend arrive (no global state).
``meta.layer_hook`` is called by the backend itself, right after it stores the layer's K/V.
Source: transformers docs, "Attention Interface" (https://huggingface.co/docs/transformers/attention_interface).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from engine.attention.backend import AttentionBackend
from engine.attention.metadata import AttentionMetadata
from engine.kv_cache import KVCachePool

ATTN_IMPLEMENTATION = "pdserve_paged"
# Keyword arguments the model runner passes to ``model(...)``; they travel to ``paged_attention``.
META_KWARG = "pdserve_attn_metadata"
CACHE_KWARG = "pdserve_kv_cache"
BACKEND_KWARG = "pdserve_attn_backend"


def _no_mask(*args: Any, **kwargs: Any) -> None:
    """Mask builder for ``ATTN_IMPLEMENTATION``: no dense mask; causality comes from the metadata."""
    return None


def paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """One layer's attention over the paged KV cache, called by transformers' attention modules.

    Args:
        module: the HF attention module; ``module.layer_idx`` selects the cache layer.
        query: ``[1, H, T, D]`` after RoPE (all sequences packed in one row).
        key: ``[1, Hkv, T, D]`` new keys after RoPE.
        value: ``[1, Hkv, T, D]`` new values.
        attention_mask: ignored (``None`` from ``_no_mask``).
        scaling: softmax scale; ``D ** -0.5`` when ``None``.
        dropout: must be 0 (inference).
        kwargs: must hold ``META_KWARG``, ``CACHE_KWARG`` and ``BACKEND_KWARG``.

    Returns:
        ``(out [1, T, H, D], None)`` — the layout transformers expects from an attention function.

    Raises:
        KeyError: the model was called without the pdserve keyword arguments.
        ValueError: ``query`` has a batch dimension other than 1.
    """
    meta: AttentionMetadata = kwargs[META_KWARG]
    kv_cache: KVCachePool = kwargs[CACHE_KWARG]
    backend: AttentionBackend = kwargs[BACKEND_KWARG]
    if query.shape[0] != 1:
        raise ValueError(f"paged attention packs all sequences in one row; got batch {query.shape[0]}")
    layer = int(module.layer_idx)  # type: ignore[arg-type]
    scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
    q = query[0].transpose(0, 1)
    k = key[0].transpose(0, 1)
    v = value[0].transpose(0, 1)
    out = backend.forward(layer, q, k, v, kv_cache, meta, scale)  # calls meta.layer_hook after the store
    return out.unsqueeze(0), None


def install_paged_attention(model: torch.nn.Module) -> None:
    """Register ``paged_attention`` (idempotent) and switch ``model`` to it.

    Raises:
        ValueError: from transformers if the model class does not support custom attention functions.
    """
    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _no_mask)
    model.set_attn_implementation(ATTN_IMPLEMENTATION)  # type: ignore[operator]
