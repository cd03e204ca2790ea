"""One program's walk over paged KV tiles with the online softmax (shared by the decode and prefill kernels).

FlashAttention-2 (Dao, 2023, Alg. 1) inner loop: for each tile of ``BLOCK_N`` KV positions in
``[lo, hi)`` the tile's blocks are looked up in the sequence's block table (vLLM PagedAttention, Kwon et
al., SOSP'23), ``q @ k^T`` is scaled (log2 domain), the running max ``m_i``, sum ``l_i`` and unnormalised
output ``acc`` are rescaled and updated. With ``MASKED``, row ``r`` sees positions ``<= context + r``
(bottom-right causal); positions ``>= hi`` are always masked.

An FP8 cache is read as its raw e4m3 values converted to ``q``'s dtype (exact: every e4m3 value is a
bf16/fp16/fp32 value); the caller folds the K scale into ``scale_log2`` and multiplies the output by the V
scale (``engine/ops/store_kv.py``), so the loop itself does no scaling. A cache of ``q``'s dtype is read
unchanged (the conversions are no-ops).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def attend_paged_tiles(  # type: ignore[no-untyped-def]  # Triton kernel: arguments are typed by @triton.jit
    acc, m_i, l_i, q, k_cache_ptr, v_cache_ptr, table, kv_head, rows, lo, hi, context,
    scale_log2, stride_cb, stride_cs, stride_ch,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr, PRECISION: tl.constexpr,
):
    """Returns the updated ``(acc [R, BLOCK_D] f32, m_i [R] f32, l_i [R] f32)`` for query rows ``q [R,
    BLOCK_D]`` of KV head ``kv_head``; ``table`` points at the sequence's block-table row. ``acc`` is in
    units of the stored V (multiply by the V scale for an FP8 cache)."""
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM
    for tile in range(lo, hi, BLOCK_N):
        cols = tile + tl.arange(0, BLOCK_N)
        col_mask = cols < hi
        block = tl.load(table + cols // BLOCK_SIZE, mask=col_mask, other=0).to(tl.int64)
        kv_off = block[:, None] * stride_cb + (cols % BLOCK_SIZE)[:, None] * stride_cs
        kv_off += kv_head * stride_ch + dims[None, :]
        kv_mask = col_mask[:, None] & dim_mask[None, :]
        k = tl.load(k_cache_ptr + kv_off, mask=kv_mask, other=0.0).to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
        if MASKED:
            visible = (cols[None, :] <= context + rows[:, None]) & col_mask[None, :]
            s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + kv_off, mask=kv_mask, other=0.0).to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision=PRECISION)
        m_i = m_new
    return acc, m_i, l_i
