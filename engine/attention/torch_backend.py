"""The ``torch`` attention backend: the correctness baseline, on CPU and GPU.

Stores K/V with ``index_copy_`` and computes attention with the plain-torch references of
``engine/ops`` (gather the sequences' KV from their blocks, mask, ``scaled_dot_product_attention`` in
float32). Decodes and prefills are padded separately so a long prompt does not pad every decode.
"""

from __future__ import annotations

import torch

from engine.attention.backend import AttentionBackend
from engine.attention.metadata import AttentionMetadata
from engine.ops.paged_decode import paged_decode_attention_reference
from engine.ops.paged_prefill import paged_prefill_attention_reference
from engine.ops.store_kv import KVScale, store_kv_reference


class TorchAttentionBackend(AttentionBackend):
    """SDPA reference backend (see ``AttentionBackend.forward``); no host synchronisation."""

    name = "torch"

    def store(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              slot_mapping: torch.Tensor, kv_scale: KVScale) -> None:
        """See ``AttentionBackend.store`` (``index_copy_`` reference)."""
        store_kv_reference(k, v, k_cache, v_cache, slot_mapping, kv_scale)

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               meta: AttentionMetadata, scale: float, kv_scale: KVScale) -> torch.Tensor:
        """See ``AttentionBackend.attend``: SDPA references, decodes and prefills padded separately."""
        nd = meta.num_decodes
        parts = []
        if nd > 0:
            parts.append(paged_decode_attention_reference(
                q[:nd], k_cache, v_cache, meta.block_tables[:nd], meta.seq_lens[:nd], meta.max_seq_len, scale,
                kv_scale,
            ))
        if meta.num_seqs > nd:
            parts.append(paged_prefill_attention_reference(
                q[nd:], k_cache, v_cache, meta.block_tables[nd:], meta.seq_lens[nd:],
                meta.query_start_loc[nd:] - nd, meta.max_query_len, meta.max_seq_len, scale, kv_scale,
            ))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
