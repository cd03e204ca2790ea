"""Scatter the step's new K and V into the paged cache at ``slot_mapping`` (Triton kernel + reference).

Slot ``s`` is block ``s // block_size``, offset ``s % block_size`` (vLLM PagedAttention,
Kwon et al., SOSP'23, ``reshape_and_cache``). One Triton program per token copies all its KV heads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.ops.pdl import gdc_enter, pdl_kwargs


@triton.jit
def _store_kv_kernel(  # type: ignore[no-untyped-def]  # Triton kernel: arguments are typed by @triton.jit
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_cs,
    stride_ch,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    USE_GDC: tl.constexpr,
):
    gdc_enter(USE_GDC)
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:  # padding token: nothing to store
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    mask = (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_DIM)
    dst = block * stride_cb + offset * stride_cs + heads[:, None] * stride_ch + dims[None, :]
    key = tl.load(k_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask)
    tl.store(k_cache_ptr + dst, key, mask=mask)
    value = tl.load(v_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)
    tl.store(v_cache_ptr + dst, value, mask=mask)


def _check(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    if k.shape != v.shape or k.dim() != 3:
        raise ValueError(f"k and v must both be [T, Hkv, D], got {tuple(k.shape)} and {tuple(v.shape)}")
    if k_cache.shape != v_cache.shape or k_cache.dim() != 4 or k_cache.shape[2:] != k.shape[1:]:
        raise ValueError(f"cache {tuple(k_cache.shape)} does not fit k {tuple(k.shape)}")
    if slot_mapping.shape != (k.shape[0],) or slot_mapping.dtype != torch.int64:
        raise ValueError(f"slot_mapping must be int64 [{k.shape[0]}], got {slot_mapping.dtype} "
                         f"{tuple(slot_mapping.shape)}")
    if k.dtype != k_cache.dtype or v.dtype != v_cache.dtype:
        raise ValueError(f"k/v dtype {k.dtype} differs from cache dtype {k_cache.dtype}")


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write ``k[t]``/``v[t]`` into cache slot ``slot_mapping[t]`` (Triton); a negative slot is skipped.

    Args:
        k, v: ``[T, Hkv, D]``, the cache's dtype; the last dim must be contiguous (copied if not).
        k_cache, v_cache: ``[num_blocks, block_size, Hkv, D]`` (``KVCachePool.k_cache(layer)``),
            innermost dim contiguous.
        slot_mapping: int64 ``[T]``.

    Raises:
        ValueError: shapes or dtypes that do not match.
    """
    _check(k, v, k_cache, v_cache, slot_mapping)
    if k.shape[0] == 0:
        return
    if k.stride(2) != 1:
        k = k.contiguous()
    if v.stride(2) != 1:
        v = v.contiguous()
    if k_cache.stride(3) != 1 or k_cache.stride() != v_cache.stride():
        raise ValueError("k_cache and v_cache must share strides with a contiguous last dim")
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    _store_kv_kernel[(k.shape[0],)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        **pdl_kwargs(k),
    )


def store_kv_reference(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Plain-torch ``store_kv``: ``index_copy_`` into the caches viewed as ``[num_slots, Hkv, D]``.

    Same arguments as ``store_kv``; every slot must be in ``[0, num_blocks * block_size)`` (no padding).

    Raises:
        ValueError: shapes or dtypes that do not match.
    """
    _check(k, v, k_cache, v_cache, slot_mapping)
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    k_cache.view(num_slots, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k)
    v_cache.view(num_slots, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v)
