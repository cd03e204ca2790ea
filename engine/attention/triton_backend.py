"""The ``triton`` attention backend: fused Triton kernels from ``engine/ops``. ``store_kv`` scatters the new
K/V (``rotary_store_kv`` when the model hands RoPE to the backend: rotation and store in one kernel; in a
decode-only step both happen inside the decode kernel); the first ``num_decodes`` sequences go through
the split-K paged decode kernel (Flash-Decoding), the rest through the paged prefill kernel
(FlashAttention-2 with a cached prefix); a step of one long prompt with no cached context attends through
cuDNN instead (engine/ops/cudnn_attention.py). Grid sizes come from the python ints of
``AttentionMetadata``: no host synchronisation. On CPU it runs only under Triton's interpreter
(``TRITON_INTERPRET=1``: tests).
"""

from __future__ import annotations

import torch

from engine.attention.backend import AttentionBackend
from engine.attention.metadata import AttentionMetadata
from engine.ops.cudnn_attention import cudnn_causal_attention, fresh_prefill_rows, fresh_prefill_usable
from engine.ops.paged_decode import RopeStore, paged_decode_attention, rope_fusable
from engine.ops.paged_prefill import paged_prefill_attention
from engine.ops.rotary import apply_rotary
from engine.ops.rotary_store import rotary_store_kv
from engine.ops.store_kv import KVScale, store_kv


class TritonAttentionBackend(AttentionBackend):
    """Triton kernel backend (see ``AttentionBackend.forward``)."""

    name = "triton"
    # decode-only steps rotate and store inside the decode kernel (engine/ops/paged_decode.py: RopeStore),
    # one launch per layer fewer; the switch exists for same-process benchmarks (the async-alt mode of
    # bench.engine.throughput)
    fuse_decode_rope = True
    # one long prompt with no cached context through cuDNN (engine/ops/cudnn_attention.py); the switch exists
    # for same-process benchmarks (bench.engine.fp8, bench.engine.prefill)
    cudnn_fresh_prefill = True

    def fresh_qkv_rows(self, meta: AttentionMetadata, heads: int, kv_heads: int, head_dim: int,
                       dtype: torch.dtype, device: torch.device, k_cache_dtype: torch.dtype) -> int | None:
        """See ``AttentionBackend.fresh_qkv_rows``: ``fresh_prefill_rows`` where ``attend_fresh`` takes
        the step (the step's tokens rounded up to cuDNN's bucket)."""
        if not self.cudnn_fresh_prefill:
            return None
        return fresh_prefill_rows(device, dtype, heads, kv_heads, head_dim, k_cache_dtype, meta.num_seqs,
                                  meta.num_decodes, meta.max_query_len, meta.max_seq_len)

    def attend_fresh(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                     meta: AttentionMetadata, scale: float,
                     packed_qkv: torch.Tensor | None = None) -> torch.Tensor | None:
        """See ``AttentionBackend.attend_fresh``: ``cudnn_causal_attention`` (over ``packed_qkv`` in place
        when given) where ``fresh_prefill_usable`` (one sequence of >= ``CUDNN_MIN_TOKENS`` tokens, no
        cached context, no decode rows, a cache of ``q``'s dtype, a Hopper GPU)."""
        if not self.cudnn_fresh_prefill or not fresh_prefill_usable(
                q, k.shape[1], k_cache.dtype, meta.num_seqs, meta.num_decodes, meta.max_query_len,
                meta.max_seq_len):
            return None
        return cudnn_causal_attention(q, k, v, scale, packed=packed_qkv)

    def rotate_store_attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                            sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            meta: AttentionMetadata, scale: float, kv_scale: KVScale) -> torch.Tensor | None:
        """See ``AttentionBackend.rotate_store_attend``: a decode-only step (every sequence one query
        token) whose tensors fit ``rope_fusable`` runs ``paged_decode_attention(rope=...)``: RoPE of q and
        the new K, the K/V store and attention in the split kernel: the same cache as the separate path,
        the same output in fp32, within one ulp in bf16/fp16 (engine/ops/decode_rope.py)."""
        nd = meta.num_decodes
        if not self.fuse_decode_rope or nd == 0 or nd != meta.num_seqs or q.shape[0] != nd:
            return None
        rope = RopeStore(k, v, cos, sin, meta.slot_mapping)
        if not rope_fusable(q, k_cache, v_cache, rope):
            return None
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        return paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.max_seq_len,
                                      scale, out=out, rope=rope, kv_scale=kv_scale)

    def store(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              slot_mapping: torch.Tensor, kv_scale: KVScale) -> None:
        """See ``AttentionBackend.store`` (the ``store_kv`` kernel)."""
        store_kv(k, v, k_cache, v_cache, slot_mapping, kv_scale)

    def rotate_and_store(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                         sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         slot_mapping: torch.Tensor, kv_scale: KVScale) -> None:
        """See ``AttentionBackend.rotate_and_store``: one ``rotary_store_kv`` kernel (last dims contiguous,
        else the two-kernel path)."""
        if v.stride(2) != 1 or k_cache.stride(3) != 1 or k_cache.stride() != v_cache.stride():
            apply_rotary(q, k, cos, sin)
            self.store(k, v, k_cache, v_cache, slot_mapping, kv_scale)
            return
        rotary_store_kv(q, k, v, cos, sin, k_cache, v_cache, slot_mapping, kv_scale)

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               meta: AttentionMetadata, scale: float, kv_scale: KVScale) -> torch.Tensor:
        """See ``AttentionBackend.attend``: split-K decode kernel, then the paged prefill kernel (KV cut into
        slices when its programs would not fill the GPU: ``prefill_kv_splits``)."""
        if q.stride(2) != 1:
            q = q.contiguous()
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        nd = meta.num_decodes
        if nd > 0:
            paged_decode_attention(
                q[:nd], k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.max_seq_len, scale,
                out=out[:nd], kv_scale=kv_scale,
            )
        if meta.num_seqs > nd:
            paged_prefill_attention(
                q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                meta.max_query_len, scale, seq_offset=nd, out=out, kv_scale=kv_scale,
                max_seq_len=meta.max_seq_len,
            )
        return out
