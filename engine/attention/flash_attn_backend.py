"""The ``flash_attn`` attention backend (FlashAttention-2, Dao 2023, package ``flash_attn``).

UNTESTED: written against the flash-attn 2.6 API docs, never run (no GPU and no flash_attn wheel on the
development machines, none on the H200 hosts either). Treat it as unverified until
``tests/engine/test_attention_backends.py`` is run on a GPU with flash-attn installed.

Decodes: ``flash_attn_with_kvcache(q [N,1,H,D], k_cache, v_cache, cache_seqlens, block_table)``;
prefills: ``flash_attn_varlen_func(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, ..., causal=True,
block_table)`` whose causal mask is bottom-right aligned when ``seqlen_q != seqlen_k`` (what a cached
prefix needs). K/V are stored first by the Triton ``store_kv`` kernel. Upstream flash-attn 2 requires the
paged block size to be a multiple of 256 tokens.
"""

from __future__ import annotations

import torch

from engine.attention.backend import AttentionBackend
from engine.attention.metadata import AttentionMetadata
from engine.kv_cache import KVCachePool
from engine.ops.store_kv import KVScale, store_kv

FLASH_ATTN_BLOCK_MULTIPLE = 256


class FlashAttnBackend(AttentionBackend):
    """flash-attn backend (see ``AttentionBackend.forward``). UNTESTED until run on a GPU with flash-attn.

    Raises:
        ValueError: (in ``forward``) a block size that is not a multiple of 256 tokens.
    """

    name = "flash_attn"

    def check_cache(self, kv_cache: KVCachePool) -> None:
        """flash-attn's paged KV needs ``block_size % 256 == 0`` and a cache of the model's dtype (no FP8
        KV cache here); raises ``ValueError`` otherwise."""
        if kv_cache.cache_dtype != kv_cache.dtype:
            raise ValueError(f"the flash_attn backend has no {kv_cache.cache_dtype} KV cache; use the triton "
                             "or torch backend for --kv-cache-dtype fp8")
        if kv_cache.block_size % FLASH_ATTN_BLOCK_MULTIPLE != 0:
            raise ValueError(f"flash_attn paged KV needs block_size % {FLASH_ATTN_BLOCK_MULTIPLE} == 0, "
                             f"got {kv_cache.block_size}; use the triton backend")

    def store(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              slot_mapping: torch.Tensor, kv_scale: KVScale) -> None:
        """See ``AttentionBackend.store`` (the Triton ``store_kv`` kernel)."""
        store_kv(k, v, k_cache, v_cache, slot_mapping, kv_scale)

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               meta: AttentionMetadata, scale: float, kv_scale: KVScale) -> torch.Tensor:
        """See ``AttentionBackend.attend``: ``flash_attn_with_kvcache`` / ``flash_attn_varlen_func``."""
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

        out = torch.empty_like(q)
        nd = meta.num_decodes
        if nd > 0:
            out[:nd] = flash_attn_with_kvcache(
                q[:nd].unsqueeze(1), k_cache, v_cache, cache_seqlens=meta.seq_lens[:nd],
                block_table=meta.block_tables[:nd], softmax_scale=scale, causal=True,
            ).squeeze(1)
        if meta.num_seqs > nd:
            seq_lens = meta.seq_lens[nd:]
            cu_seqlens_k = torch.nn.functional.pad(seq_lens.cumsum(0, dtype=torch.int32), (1, 0))
            out[nd:] = flash_attn_varlen_func(
                q[nd:], k_cache, v_cache, cu_seqlens_q=meta.query_start_loc[nd:] - nd,
                cu_seqlens_k=cu_seqlens_k, max_seqlen_q=meta.max_query_len,
                max_seqlen_k=meta.max_seq_len, softmax_scale=scale, causal=True,
                block_table=meta.block_tables[nd:],
            )
        return out
