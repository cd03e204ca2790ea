"""RoPE on a step's queries and keys fused with the store of its K/V in the paged cache (Triton + reference).

The decoder's ``apply_rotary`` (engine/ops/rotary.py) and ``store_kv`` (engine/ops/store_kv.py) in one
kernel: each program takes one token, rotates its query heads in place, rotates its key heads (written
back in place and into the cache slot) and copies its value heads into the cache. Same arithmetic as the
two kernels (RoPE "rotate half" of transformers' Llama, Su et al. 2021, each product rounded to the dtype;
slot ``s`` = block ``s // block_size``, offset ``s % block_size`` as vLLM's ``reshape_and_cache``), so the
results are bit-identical to running them one after the other; a decode step saves one launch per layer
(32 per step of Llama-3-8B). A negative slot (padding row of a decode graph) stores nothing. An FP8 cache
gets the rotated key and the value quantised as ``store_kv`` quantises them (``KVScale``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.ops.pdl import gdc_enter, pdl_kwargs
from engine.ops.rotary import _check as _check_rotary
from engine.ops.rotary import _cos_sin, _rotate_heads, _rotated, apply_rotary_reference
from engine.ops.store_kv import UNIT_SCALE, KVScale, inverse_scales, is_fp8, quantize_kv, store_kv_reference
from engine.ops.store_kv import _check as _check_store


@triton.jit
def _rotary_store_kernel(  # type: ignore[no-untyped-def]  # Triton kernel: arguments are typed by @triton.jit
    q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, inv_k_scale, inv_v_scale,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ct, stride_st,
    stride_cb, stride_cs, stride_ch,
    NUM_Q_HEADS: tl.constexpr, NUM_K_HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_QH: tl.constexpr, BLOCK_KH: tl.constexpr, BLOCK_HALF: tl.constexpr, KV_FP8: tl.constexpr,
    USE_GDC: tl.constexpr,
):
    gdc_enter(USE_GDC)
    t = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK_HALF)
    dmask = d < HALF
    c1, c2, s1, s2 = _cos_sin(cos_ptr, sin_ptr, t, stride_ct, stride_st, d, dmask, HALF)
    _rotate_heads(q_ptr + t * stride_qt, stride_qh, c1, c2, s1, s2, d, dmask, NUM_Q_HEADS, HALF, BLOCK_QH)
    heads = tl.arange(0, BLOCK_KH)
    mask = (heads[:, None] < NUM_K_HEADS) & dmask[None, :]
    p1 = k_ptr + t * stride_kt + heads[:, None] * stride_kh + d[None, :]
    r1, r2 = _rotated(tl.load(p1, mask=mask, other=0.0), tl.load(p1 + HALF, mask=mask, other=0.0),
                      c1, c2, s1, s2)
    tl.store(p1, r1, mask=mask)
    tl.store(p1 + HALF, r2, mask=mask)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs \
            + heads[:, None] * stride_ch + d[None, :]
        tl.store(k_cache_ptr + dst, quantize_kv(r1, inv_k_scale, k_cache_ptr, KV_FP8), mask=mask)
        tl.store(k_cache_ptr + dst + HALF, quantize_kv(r2, inv_k_scale, k_cache_ptr, KV_FP8), mask=mask)
        pv = v_ptr + t * stride_vt + heads[:, None] * stride_vh + d[None, :]
        tl.store(v_cache_ptr + dst, quantize_kv(tl.load(pv, mask=mask), inv_v_scale, v_cache_ptr, KV_FP8),
                 mask=mask)
        tl.store(v_cache_ptr + dst + HALF,
                 quantize_kv(tl.load(pv + HALF, mask=mask), inv_v_scale, v_cache_ptr, KV_FP8), mask=mask)


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
           k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    _check_rotary(q, k, cos, sin)
    _check_store(k, v, k_cache, v_cache, slot_mapping)
    if v.stride(2) != 1 or k_cache.stride(3) != 1 or k_cache.stride() != v_cache.stride():
        raise ValueError("v needs a contiguous last dim; k_cache and v_cache the same strides with a "
                         "contiguous last dim")


def rotary_store_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                    kv_scale: KVScale = UNIT_SCALE) -> None:
    """Rotate ``q`` and ``k`` in place, then write ``k[t]``/``v[t]`` into cache slot ``slot_mapping[t]``
    (one Triton kernel; a negative slot is skipped).

    Args:
        q: ``[T, H, D]`` queries, last dim contiguous (a view of the fused QKV output works).
        k, v: ``[T, Hkv, D]`` keys and values, ``q``'s dtype, last dim contiguous.
        cos, sin: ``[T, D]`` from the model's ``rotary_emb``.
        k_cache, v_cache: ``[num_blocks, block_size, Hkv, D]`` (``KVCachePool.k_cache(layer)``): ``k``'s
            dtype, or FP8 (quantised with ``kv_scale`` as ``store_kv`` does).
        slot_mapping: int64 ``[T]``.
        kv_scale: the layer's K and V scales (FP8 cache only).

    Raises:
        ValueError: shapes, dtypes, strides or scales that do not fit (nothing is changed then).
    """
    _check(q, k, v, cos, sin, k_cache, v_cache, slot_mapping)
    inv_k, inv_v = inverse_scales(kv_scale)
    t, num_heads, d = q.shape
    if t == 0:
        return
    num_kv_heads = k.shape[1]
    _rotary_store_kernel[(t,)](
        q, k, v, cos, sin, k_cache, v_cache, slot_mapping, inv_k, inv_v,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0),
        sin.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        NUM_Q_HEADS=num_heads, NUM_K_HEADS=num_kv_heads, HALF=d // 2, BLOCK_SIZE=k_cache.shape[1],
        BLOCK_QH=triton.next_power_of_2(num_heads), BLOCK_KH=triton.next_power_of_2(num_kv_heads),
        BLOCK_HALF=triton.next_power_of_2(d // 2), KV_FP8=is_fp8(k_cache),
        **pdl_kwargs(q),
    )


def rotary_store_kv_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                              sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              slot_mapping: torch.Tensor, kv_scale: KVScale = UNIT_SCALE) -> None:
    """Plain-torch ``rotary_store_kv``: ``apply_rotary_reference`` then ``store_kv_reference`` (every slot
    valid). Same arguments and errors."""
    _check(q, k, v, cos, sin, k_cache, v_cache, slot_mapping)
    apply_rotary_reference(q, k, cos, sin)
    store_kv_reference(k, v, k_cache, v_cache, slot_mapping, kv_scale)
