"""The attention backend interface and ``get_backend``.

A backend does one layer's attention for a packed step: it stores the new K/V at ``meta.slot_mapping``,
then attends every query token over its sequence's paged KV. Sequence ``i`` has
``n = query_start_loc[i+1] - query_start_loc[i]`` new tokens; its first ``seq_lens[i] - n`` KV entries
come from the cache, the new ones are causal: new token ``j`` sees KV positions ``<= seq_lens[i] - n + j``
(bottom-right aligned causal mask, as in FlashAttention-2 for ``seqlen_q != seqlen_k``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from engine.attention.metadata import AttentionMetadata
from engine.config import attention_backend_problem, flash_attn_available
from engine.kv_cache import KVCachePool
from engine.ops.rotary import apply_rotary_reference
from engine.ops.store_kv import KVScale

BACKEND_NAMES = ("auto", "torch", "triton", "flash_attn")


class AttentionBackend(ABC):
    """One layer's paged attention with KV store; stateless, one instance serves every layer."""

    name: str = "base"

    def set_step_limits(self, max_query_len: int, max_seq_len: int) -> None:
        """The engine's limits: no step has more new tokens than ``max_query_len`` (the token budget) or a
        sequence longer than ``max_seq_len`` (``max_model_len``). Backends that size kernels or plans by
        them keep them; the default ignores them."""
        return None

    def forward(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: KVCachePool,
        meta: AttentionMetadata,
        scale: float,
        rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
        packed_qkv: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Store ``k``, ``v`` into layer ``layer`` of ``kv_cache`` and return the attention output.

        Checks the inputs, stores the new K/V (``store``; with ``rotary``, ``rotate_and_store``), calls
        ``meta.layer_hook(layer)``, then attends (``attend_fresh`` where the backend takes the step, else
        ``attend``); backends implement those steps.

        Args:
            layer: layer index into ``kv_cache``.
            q: ``[T, H, D]`` queries (after RoPE), the cache's dtype.
            k: ``[T, Hkv, D]`` new keys; ``H % Hkv == 0`` (GQA: head ``h`` uses KV head
                ``h // (H // Hkv)``).
            v: ``[T, Hkv, D]`` new values.
            kv_cache: the paged cache.
            meta: the step's metadata (decodes first).
            scale: softmax scale, usually ``D ** -0.5``.
            rotary: ``(cos, sin)`` ``[T, D]`` from the model's ``rotary_emb``: ``q`` and ``k`` are then
                before RoPE, and are rotated in place here (engine/ops/rotary.py) as part of the store,
                except in a step ``rotate_store_attend`` takes (triton, decode-only, no ``layer_hook``),
                which rotates them inside its kernel and leaves ``q`` and ``k`` as they were.
            packed_qkv: None, or the ``[rows, H + 2 Hkv, D]`` buffer (``rows`` from ``fresh_qkv_rows``,
                those past ``T`` zero) whose first ``T`` rows ``q``, ``k``, ``v`` are the head slices of:
                ``attend_fresh`` then reads them in place.

        Returns:
            ``[T, H, D]`` in ``q``'s dtype. Calls ``meta.layer_hook(layer)`` after the store.

        Raises:
            ValueError: shapes, dtypes or devices that do not fit the cache or the metadata.
        """
        check_inputs(layer, q, k, v, kv_cache, meta)
        self.check_cache(kv_cache)
        k_cache, v_cache = kv_cache.k_cache(layer), kv_cache.v_cache(layer)
        kv_scale = kv_cache.kv_scale(layer)
        if rotary is not None and meta.layer_hook is None:
            out = self.rotate_store_attend(q, k, v, rotary[0], rotary[1], k_cache, v_cache, meta, scale,
                                           kv_scale)
            if out is not None:
                return out
        if rotary is not None:
            self.rotate_and_store(q, k, v, rotary[0], rotary[1], k_cache, v_cache, meta.slot_mapping,
                                  kv_scale)
        else:
            self.store(k, v, k_cache, v_cache, meta.slot_mapping, kv_scale)
        if meta.layer_hook is not None:
            meta.layer_hook(layer)
        out = self.attend_fresh(q, k, v, k_cache, meta, scale, packed_qkv)
        if out is not None:
            return out
        return self.attend(q, k_cache, v_cache, meta, scale, kv_scale)

    def fresh_qkv_rows(self, meta: AttentionMetadata, heads: int, kv_heads: int, head_dim: int,
                       dtype: torch.dtype, device: torch.device, k_cache_dtype: torch.dtype) -> int | None:
        """For a step that ``attend_fresh`` will take and can read in place: the rows of the
        ``[rows, heads + 2 kv_heads, head_dim]`` buffer a model may write the step's QKV projection into
        (rows past the step's tokens zeroed) and hand to ``forward`` as ``packed_qkv``. None (default):
        no such buffer."""
        return None

    def attend_fresh(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                     meta: AttentionMetadata, scale: float,
                     packed_qkv: torch.Tensor | None = None) -> torch.Tensor | None:
        """Attention over the step's own ``k``/``v`` (after RoPE and the store) for a step the backend has
        such a path for (the triton backend: one long prompt with no cached context, through cuDNN); None
        (default) means "not here": ``forward`` then runs ``attend`` over the cache. ``packed_qkv``: as in
        ``forward``."""
        return None

    def rotate_store_attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                            sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            meta: AttentionMetadata, scale: float, kv_scale: KVScale) -> torch.Tensor | None:
        """RoPE, store and attention in one go for a step with no ``layer_hook``, when the backend has
        such a path for it (the triton backend: decode-only steps); None (default) means "not here":
        ``forward`` then rotates and stores, and attends, as separate steps."""
        return None

    def rotate_and_store(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                         sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         slot_mapping: torch.Tensor, kv_scale: KVScale) -> None:
        """RoPE on ``q`` and ``k`` in place (``cos``/``sin`` ``[T, D]``), then ``store``. Default: the
        plain-torch rotation, then the backend's store; a backend may fuse the two. Raises
        ``ValueError`` for shapes that do not fit."""
        apply_rotary_reference(q, k, cos, sin)
        self.store(k, v, k_cache, v_cache, slot_mapping, kv_scale)

    def check_cache(self, kv_cache: KVCachePool) -> None:
        """Backend-specific cache requirements; raises ``ValueError``. Default: none."""
        return None

    @abstractmethod
    def store(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              slot_mapping: torch.Tensor, kv_scale: KVScale) -> None:
        """Write ``k``/``v [T, Hkv, D]`` into ``k_cache``/``v_cache [num_blocks, block_size, Hkv, D]`` at
        ``slot_mapping [T]`` (int64 slots ``block * block_size + offset``; negative slots are skipped);
        an FP8 cache stores them quantised with the layer's ``kv_scale`` (engine/ops/store_kv.py)."""

    @abstractmethod
    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               meta: AttentionMetadata, scale: float, kv_scale: KVScale) -> torch.Tensor:
        """Attention of ``q [T, H, D]`` over the paged KV of one layer (already holding this step's
        tokens; an FP8 cache read with ``kv_scale``); decodes first. Returns ``[T, H, D]`` in ``q``'s
        dtype."""


def check_inputs(
    layer: int,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: KVCachePool,
    meta: AttentionMetadata,
) -> None:
    """Shared argument checks (shapes only: no device reads). Raises ``ValueError`` naming the problem."""
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"q, k, v must be [T, heads, D], got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} differ")
    num_tokens, num_heads, head_dim = q.shape
    if k.shape[0] != num_tokens or meta.slot_mapping.shape[0] != num_tokens:
        raise ValueError(f"token counts differ: q {num_tokens}, k {k.shape[0]}, "
                         f"slot_mapping {meta.slot_mapping.shape[0]}")
    if k.shape[1] != kv_cache.num_kv_heads or k.shape[2] != kv_cache.head_dim or head_dim != k.shape[2]:
        raise ValueError(f"k {tuple(k.shape)} / q {tuple(q.shape)} do not fit the cache's "
                         f"num_kv_heads={kv_cache.num_kv_heads}, head_dim={kv_cache.head_dim}")
    if num_heads % k.shape[1] != 0:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {k.shape[1]}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dtype != kv_cache.dtype:
            raise ValueError(f"{name} dtype {t.dtype} != cache dtype {kv_cache.dtype}")
        if t.device != kv_cache.device:
            raise ValueError(f"{name} on {t.device}, cache on {kv_cache.device}")
    if not 0 <= layer < kv_cache.num_layers:
        raise ValueError(f"layer {layer} out of range [0, {kv_cache.num_layers})")


def get_backend(name: str, device: torch.device | str) -> AttentionBackend:
    """Return the backend ``name`` for ``device``.

    ``"auto"``: ``flash_attn`` if importable and on CUDA, else ``triton`` on CUDA, else ``torch``.
    ``"triton"`` on CPU is allowed only under Triton's interpreter (``TRITON_INTERPRET=1``, tests).

    Raises:
        ValueError: unknown name, ``flash_attn`` off CUDA or not installed, ``triton`` on CPU without the
            interpreter.
    """
    dev = torch.device(device)
    if name not in BACKEND_NAMES:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {BACKEND_NAMES}")
    if name == "auto":
        on_cuda = dev.type == "cuda"
        name = ("flash_attn" if flash_attn_available() else "triton") if on_cuda else "torch"
    if (why := attention_backend_problem(name, str(dev))) is not None:
        raise ValueError(why)
    if name == "torch":
        from engine.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend()
    if name == "triton":
        from engine.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    from engine.attention.flash_attn_backend import FlashAttnBackend

    return FlashAttnBackend()
