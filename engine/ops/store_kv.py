"""Scatter the step's new K and V into the paged cache at ``slot_mapping`` (Triton kernel + reference).

Slot ``s`` is block ``s // block_size``, offset ``s % block_size`` (vLLM PagedAttention,
Kwon et al., SOSP'23, ``reshape_and_cache``). One Triton program per token copies all its KV heads.

FP8 KV cache (``torch.float8_e4m3fn``, the cache of ``--kv-cache-dtype fp8``): each layer's K and V have a
per-tensor scale (``KVScale``); a value ``x`` is stored as ``fp8(clamp(x * (1 / scale), -448, 448))``
(round to nearest even, saturated to e4m3's largest finite value instead of NaN) and read back as
``float(stored) * scale``, as vLLM's fp8 KV cache does (``reshape_and_cache`` with ``k_scale``/``v_scale``).
The reciprocal is taken once on the host in float64 and rounded to float32, so the kernels and the
references multiply by the same float32 number and store the same bits.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from engine.ops.pdl import gdc_enter, pdl_kwargs

FP8_KV_DTYPE = torch.float8_e4m3fn
FP8_E4M3_MAX = 448.0  # largest finite float8_e4m3fn value


class KVScale(NamedTuple):
    """Per-tensor dequantisation scales of one layer's K and V cache (float, > 0): the cache holds
    ``x / scale`` in FP8 and is read as ``stored * scale``. Ignored by a cache in the model's dtype."""

    k: float = 1.0
    v: float = 1.0


UNIT_SCALE = KVScale(1.0, 1.0)  # the default of the ops: what every layer of a ``KVCachePool`` holds today


def is_fp8(cache: torch.Tensor) -> bool:
    """True when ``cache`` is an FP8 (``float8_e4m3fn``) KV cache."""
    return cache.dtype == FP8_KV_DTYPE


def _check_scale(kv_scale: KVScale) -> None:
    for name, value in zip(("k", "v"), kv_scale, strict=True):
        if not (isinstance(value, float | int) and 0.0 < float(value) < float("inf")):
            raise ValueError(f"kv_scale.{name} must be a finite float > 0, got {value!r}")


@functools.lru_cache(maxsize=256)
def inverse_scales(kv_scale: KVScale) -> tuple[float, float]:
    """``(1 / k, 1 / v)`` rounded to float32 (the multipliers of the quantising store). Cached: every
    layer of every eager step asks, with the few scales a model has.

    Raises:
        ValueError: a scale that is not a finite float > 0 (not cached).
    """
    _check_scale(kv_scale)
    inv = torch.tensor([1.0 / kv_scale.k, 1.0 / kv_scale.v], dtype=torch.float64).float().tolist()
    return float(inv[0]), float(inv[1])


def quantize_kv_reference(x: torch.Tensor, inv_scale: float, cache_dtype: torch.dtype) -> torch.Tensor:
    """``x`` as the cache stores it: unchanged for a cache of ``x``'s dtype; for an FP8 cache
    ``fp8(clamp(float32(x) * inv_scale, -448, 448))`` with ``inv_scale`` from ``inverse_scales``."""
    if cache_dtype != FP8_KV_DTYPE:
        return x
    inv = torch.tensor(inv_scale, dtype=torch.float32, device=x.device)
    return (x.float() * inv).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8_KV_DTYPE)


def dequantize_kv_reference(cache: torch.Tensor, scale: float) -> torch.Tensor:
    """A (gathered) cache as float32 values: ``float(stored) * scale`` for FP8, else ``float(stored)``."""
    if cache.dtype != FP8_KV_DTYPE:
        return cache.float()
    return cache.float() * torch.tensor(scale, dtype=torch.float32, device=cache.device)


@triton.jit
def _round_to_e4m3(y):  # type: ignore[no-untyped-def]  # Triton helper
    """float32 ``y`` (``|y| <= 448``) rounded to the nearest e4m3 value, ties to even, still float32.

    Done in integer/float arithmetic so the final cast is exact: Triton's interpreter casts float32 to
    fp8 by truncating with a half-up round that does not carry into the exponent (-7.92 becomes -4),
    and the compiled cast (``cvt.rn.satfinite``) rounds to nearest even; both agree on exact values.
    Normal range (``|y| >= 2**-6``): keep 3 of float32's 23 mantissa bits, rounding on the dropped 20
    (a carry moves into the exponent). Subnormal range: multiples of ``2**-9``, rounded with the
    ``1.5 * 2**23`` float trick (adding and removing it rounds to an integer, ties to even)."""
    bits = y.to(tl.int32, bitcast=True)
    sign = bits & -2147483648  # the sign bit, put back at the end (-0.0 and tiny negatives stay negative)
    a = tl.abs(y)
    mag = a.to(tl.int32, bitcast=True)
    normal = (mag + 0x7FFFF + ((mag >> 20) & 1)) & -1048576  # -1048576 == ~0xFFFFF
    subnormal = (((a * 512.0 + 12582912.0) - 12582912.0) * 0.001953125).to(tl.int32, bitcast=True)
    return (tl.where(a < 0.015625, subnormal, normal) | sign).to(tl.float32, bitcast=True)


@triton.jit
def quantize_kv(x, inv_scale, cache_ptr, FP8: tl.constexpr):  # type: ignore[no-untyped-def]  # Triton helper
    """``x`` as stored in ``cache_ptr``'s element type: with ``FP8`` scaled by ``inv_scale`` in float32,
    saturated to +-448 and rounded to e4m3 (ties to even); else unchanged (see the module docstring)."""
    if FP8:
        y = _round_to_e4m3(tl.clamp(x.to(tl.float32) * inv_scale, -448.0, 448.0))
        y = y.to(cache_ptr.dtype.element_ty)
    else:
        y = x
    return y


@triton.jit
def _store_kv_kernel(  # type: ignore[no-untyped-def]  # Triton kernel: arguments are typed by @triton.jit
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    inv_k_scale,
    inv_v_scale,
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
    KV_FP8: tl.constexpr,
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
    tl.store(k_cache_ptr + dst, quantize_kv(key, inv_k_scale, k_cache_ptr, KV_FP8), mask=mask)
    value = tl.load(v_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)
    tl.store(v_cache_ptr + dst, quantize_kv(value, inv_v_scale, v_cache_ptr, KV_FP8), mask=mask)


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
    if k.dtype != v.dtype or k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k/v dtypes {k.dtype}/{v.dtype} or cache dtypes {k_cache.dtype}/{v_cache.dtype} "
                         "differ")
    if k.dtype != k_cache.dtype and not (is_fp8(k_cache) and k.is_floating_point() and not is_fp8(k)):
        raise ValueError(f"k/v dtype {k.dtype} differs from cache dtype {k_cache.dtype} (only an "
                         f"{FP8_KV_DTYPE} cache takes another floating dtype, quantising it)")


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    slot_mapping: torch.Tensor, kv_scale: KVScale = UNIT_SCALE,
) -> None:
    """Write ``k[t]``/``v[t]`` into cache slot ``slot_mapping[t]`` (Triton); a negative slot is skipped.

    Args:
        k, v: ``[T, Hkv, D]``, the cache's dtype (or any float dtype for an FP8 cache); the last dim must
            be contiguous (copied if not).
        k_cache, v_cache: ``[num_blocks, block_size, Hkv, D]`` (``KVCachePool.k_cache(layer)``),
            innermost dim contiguous.
        slot_mapping: int64 ``[T]``.
        kv_scale: the layer's K and V scales; an FP8 cache stores ``x / scale`` (module docstring).

    Raises:
        ValueError: shapes or dtypes that do not match, a scale that is not a finite float > 0.
    """
    _check(k, v, k_cache, v_cache, slot_mapping)
    inv_k, inv_v = inverse_scales(kv_scale)
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
        k, v, k_cache, v_cache, slot_mapping, inv_k, inv_v,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        KV_FP8=is_fp8(k_cache),
        **pdl_kwargs(k),
    )


def store_kv_reference(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    slot_mapping: torch.Tensor, kv_scale: KVScale = UNIT_SCALE,
) -> None:
    """Plain-torch ``store_kv``: ``quantize_kv_reference``, then ``index_copy_`` into the caches viewed as
    ``[num_slots, Hkv, D]`` (an FP8 cache through a uint8 view: torch has no FP8 ``index_copy_`` on CPU).

    Same arguments as ``store_kv``; every slot must be in ``[0, num_blocks * block_size)`` (no padding).

    Raises:
        ValueError: shapes or dtypes that do not match, a scale that is not a finite float > 0.
    """
    _check(k, v, k_cache, v_cache, slot_mapping)
    inv_k, inv_v = inverse_scales(kv_scale)
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    for cache, x, inv in ((k_cache, k, inv_k), (v_cache, v, inv_v)):
        stored = quantize_kv_reference(x, inv, cache.dtype)
        flat = cache.view(num_slots, *cache.shape[2:])
        if is_fp8(cache):
            flat, stored = flat.view(torch.uint8), stored.view(torch.uint8)
        flat.index_copy_(0, slot_mapping, stored)
