"""The ``triton`` attention backend: fused Triton kernels from ``engine/ops``. ``store_kv`` scatters the new
K/V (``rotary_store_kv`` when the model hands RoPE to the backend: rotation and store in one kernel; in a
decode-only step both happen inside the decode kernel); the first ``num_decodes`` sequences go through
the split-K paged decode kernel (Flash-Decoding), the rest through the paged prefill kernel
(FlashAttention-2 with a cached prefix); a step of one long prompt with no cached context attends through
cuDNN instead (engine/ops/cudnn_attention.py), and on Hopper the prefill sequences of a step whose KV
reaches ``CUDNN_PAGED_MIN_KV`` tokens through cuDNN's paged attention (engine/ops/cudnn_paged_prefill.py).
Grid sizes come from the python ints of ``AttentionMetadata``: no host synchronisation. On CPU it runs
only under Triton's interpreter (``TRITON_INTERPRET=1``: tests).
"""

from __future__ import annotations

import weakref

import torch

from engine.attention.backend import AttentionBackend
from engine.attention.metadata import AttentionMetadata
from engine.ops.cudnn_attention import cudnn_causal_attention, fresh_prefill_rows, fresh_prefill_usable
from engine.ops.cudnn_paged_prefill import (
    PagedPrefillInputs,
    cudnn_paged_prefill,
    paged_graph_key,
    paged_prefill_inputs,
    paged_prefill_usable,
)
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
    # prefill sequences over a long KV through cuDNN's paged attention (engine/ops/cudnn_paged_prefill.py);
    # the switch exists for same-process benchmarks (bench.kernels.prefill_attention, bench.engine.fp8)
    cudnn_paged_prefill = True

    def __init__(self) -> None:
        # the last step's cuDNN inputs, built by its first layer and reused by the others, keyed by a weak
        # reference to the step's metadata (a dead reference never matches a new step)
        self._paged_step: tuple[weakref.ref[AttentionMetadata], PagedPrefillInputs] | None = None
        self._step_limits: tuple[int, int] | None = None  # set_step_limits: cuDNN's bucket lengths

    def set_step_limits(self, max_query_len: int, max_seq_len: int) -> None:
        """See ``AttentionBackend.set_step_limits``: the query and KV lengths of the cuDNN paged graphs
        (padding them is free, so one bucket covers every step)."""
        self._step_limits = (max_query_len, max_seq_len)

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
        if meta.num_seqs > nd and not self._cudnn_prefill(q, k_cache, v_cache, meta, scale, out):
            paged_prefill_attention(
                q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                meta.max_query_len, scale, seq_offset=nd, out=out, kv_scale=kv_scale,
                max_seq_len=meta.max_seq_len,
            )
        return out

    def _cudnn_prefill(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       meta: AttentionMetadata, scale: float, out: torch.Tensor) -> bool:
        """The step's prefill sequences through ``cudnn_paged_prefill`` where ``paged_prefill_usable``
        (a step whose longest sequence has ``CUDNN_PAGED_MIN_KV`` tokens or more, a Hopper GPU, a cache
        of ``q``'s dtype); the graph's inputs are built by the step's first layer. False where the step
        stays on the Triton kernel (nothing written)."""
        if not self.cudnn_paged_prefill or not paged_prefill_usable(q, k_cache, v_cache, meta.max_seq_len):
            return False
        nd = meta.num_decodes
        cached = self._paged_step
        if cached is not None and cached[0]() is meta:
            inputs = cached[1]
        else:
            max_query_len, max_seq_len = self._step_limits or (0, 0)
            key = paged_graph_key(q, k_cache, meta.num_seqs - nd, max(max_query_len, meta.max_query_len),
                                  max(max_seq_len, meta.max_seq_len))
            inputs = paged_prefill_inputs(key, meta.block_tables, meta.seq_lens, meta.query_start_loc, nd,
                                          meta.num_decode_tokens, scale)
            self._paged_step = (weakref.ref(meta), inputs)
        return cudnn_paged_prefill(q, k_cache, v_cache, inputs, out, meta.num_decode_tokens)
