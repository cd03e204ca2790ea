"""The FP8 KV cache (``--kv-cache-dtype fp8``): the quantising store and the dequantising attention kernels
against their plain-torch references (Triton interpreter on CPU), and against attention over the
unquantised K/V.

Tolerances: kernel vs reference see the same stored bytes, so they differ only in where the K scale is
applied (folded into the softmax scale vs multiplied into K) and in summation order: fp32 tolerance.
Against attention over the unquantised values the error is e4m3's rounding (3 mantissa bits: relative
error <= 2**-4 per element). An output that is one V row (a sequence of one token) carries that error
whole (rtol 2**-4); over longer sequences K's rounding moves each score by up to 2**-4 of
``|q . k| * scale`` and the weights with it (atol 0.1 on outputs of magnitude ~1: unit-variance random
K/V/q, outputs divided by V's scale; a scale applied twice or not at all is off by far more).
"""

from __future__ import annotations

import pytest
import torch

from engine.kv_cache import KVCachePool
from engine.ops.paged_decode import paged_decode_attention, paged_decode_attention_reference
from engine.ops.paged_prefill import paged_prefill_attention, paged_prefill_attention_reference
from engine.ops.rotary_store import rotary_store_kv, rotary_store_kv_reference
from engine.ops.store_kv import (
    FP8_KV_DTYPE,
    KVScale,
    inverse_scales,
    quantize_kv_reference,
    store_kv,
    store_kv_reference,
)
from tests.engine.test_kernels import BS, DECODE_LENS, DEVICE, PREFILL_SPECS, PagedBatch, make_batch

F32 = torch.float32
FP8_ATOL, FP8_RTOL = 0.1, 2**-4
# scales far from 1 so a scale applied twice, or not at all, shows
SCALE = KVScale(k=0.03, v=0.004)


def fp8_batch(specs: list[tuple[int, int]], num_heads: int, num_kv_heads: int, head_dim: int,
              kv_scale: KVScale, dtype: torch.dtype = F32) -> tuple[PagedBatch, KVCachePool]:
    """``make_batch`` with K scaled by ``kv_scale.k * 8`` and V by ``kv_scale.v * 8`` (so the stored
    values use e4m3's range), plus an FP8 pool holding the same cached prefixes quantised."""
    batch = make_batch(specs, num_heads, num_kv_heads, head_dim, BS, dtype)
    for t, s in ((batch.k_new, kv_scale.k), (batch.v_new, kv_scale.v)):
        t.mul_(s * 8)
    for full, s in ((batch.k_full, kv_scale.k), (batch.v_full, kv_scale.v)):
        for t in full:
            t.mul_(s * 8)
    pool = batch.pool
    pool.kv_buffer[0, 0].mul_(kv_scale.k * 8)
    pool.kv_buffer[0, 1].mul_(kv_scale.v * 8)
    fp8 = KVCachePool(1, pool.num_blocks, BS, num_kv_heads, head_dim, dtype, DEVICE, cache_dtype=FP8_KV_DTYPE)
    inv_k, inv_v = inverse_scales(kv_scale)
    fp8.kv_buffer[0, 0] = quantize_kv_reference(pool.kv_buffer[0, 0], inv_k, FP8_KV_DTYPE)
    fp8.kv_buffer[0, 1] = quantize_kv_reference(pool.kv_buffer[0, 1], inv_v, FP8_KV_DTYPE)
    return batch, fp8


def raw(cache: torch.Tensor) -> torch.Tensor:
    return cache.view(torch.uint8)


def test_quantize_rounds_and_saturates() -> None:
    x = torch.tensor([1.0, 1.0625, 1.1875, -500.0, 1000.0, 0.0])
    got = quantize_kv_reference(x, 0.5, FP8_KV_DTYPE).float()
    # e4m3 in [0.5, 1): steps of 1/16; ties to the even mantissa: 0.53125 -> 0.5, 0.59375 -> 0.625;
    # beyond +-448 saturated, never NaN
    assert got.tolist() == [0.5, 0.5, 0.625, -256.0, 448.0, 0.0]  # -250: steps of 16 in [128, 256)


@pytest.mark.parametrize("kv_scale", [KVScale(), SCALE])
def test_store_kv_fp8_matches_reference(kv_scale: KVScale) -> None:
    batch, pool = fp8_batch([(5, 1), (0, 9), (7, 10)], 2, 2, 64, kv_scale)
    ref = pool.kv_buffer.clone()
    store_kv_reference(batch.k_new, batch.v_new, ref[0, 0], ref[0, 1], batch.meta.slot_mapping, kv_scale)
    store_kv(batch.k_new, batch.v_new, pool.k_cache(0), pool.v_cache(0), batch.meta.slot_mapping, kv_scale)
    assert torch.equal(raw(pool.kv_buffer), raw(ref))
    # every stored value is within e4m3's rounding of the original
    slots = batch.meta.slot_mapping
    k_back = pool.k_cache(0).reshape(-1, 2, 64)[slots].float() * kv_scale.k
    torch.testing.assert_close(k_back, batch.k_new, rtol=2**-4, atol=kv_scale.k * 2**-9)
    v_back = pool.v_cache(0).reshape(-1, 2, 64)[slots].float() * kv_scale.v
    torch.testing.assert_close(v_back, batch.v_new, rtol=2**-4, atol=kv_scale.v * 2**-9)
    unused = ~batch.used_slots
    flat, flat_ref = raw(pool.k_cache(0).reshape(-1, 2, 64)), raw(ref[0, 0].reshape(-1, 2, 64))
    assert torch.equal(flat[unused], flat_ref[unused])


def test_rotary_store_fp8_matches_reference() -> None:
    batch, pool = fp8_batch([(3, 4), (0, 6)], 4, 2, 64, SCALE)
    gen = torch.Generator().manual_seed(1)
    angles = torch.rand(batch.q.shape[0], 32, generator=gen) * 6
    cos, sin = (torch.cat([f(angles)] * 2, -1).to(batch.q.device) for f in (torch.cos, torch.sin))
    ref = pool.kv_buffer.clone()
    q_ref, k_ref = batch.q.clone(), batch.k_new.clone()
    rotary_store_kv_reference(q_ref, k_ref, batch.v_new, cos, sin, ref[0, 0], ref[0, 1],
                              batch.meta.slot_mapping, SCALE)
    rotary_store_kv(batch.q, batch.k_new, batch.v_new, cos, sin, pool.k_cache(0), pool.v_cache(0),
                    batch.meta.slot_mapping, SCALE)
    assert torch.equal(raw(pool.kv_buffer), raw(ref))
    # the rotated q and k: equal through the interpreter; compiled, a fused multiply-add moves the last bit
    torch.testing.assert_close(batch.q, q_ref, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(batch.k_new, k_ref, atol=1e-6, rtol=1e-6)


def _unquantised(batch: PagedBatch) -> KVCachePool:
    store_kv(batch.k_new, batch.v_new, batch.pool.k_cache(0), batch.pool.v_cache(0), batch.meta.slot_mapping)
    return batch.pool


# model dtypes: fp32 everywhere; bf16 (the served case) with compiled kernels on a GPU
MODEL_DTYPES = [F32] + ([torch.bfloat16] if torch.cuda.is_available() else [])
KERNEL_TOL = {F32: 2e-5, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("dtype", MODEL_DTYPES)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_paged_decode_fp8_matches_reference(num_splits: int, dtype: torch.dtype) -> None:
    batch, pool = fp8_batch([(n - 1, 1) for n in DECODE_LENS], 6, 2, 64, SCALE, dtype)
    store_kv(batch.k_new, batch.v_new, pool.k_cache(0), pool.v_cache(0), batch.meta.slot_mapping, SCALE)
    m, scale = batch.meta, 64**-0.5 / SCALE.k / 8
    args = (batch.q, pool.k_cache(0), pool.v_cache(0), m.block_tables, m.seq_lens, m.max_seq_len, scale)
    out = paged_decode_attention(*args, num_splits=num_splits, kv_scale=SCALE)
    ref = paged_decode_attention_reference(*args, kv_scale=SCALE)
    tol = KERNEL_TOL[dtype]
    torch.testing.assert_close(out, ref, atol=tol * SCALE.v * 8, rtol=tol)
    full = _unquantised(batch)
    exact = paged_decode_attention_reference(batch.q, full.k_cache(0), full.v_cache(0), m.block_tables,
                                             m.seq_lens, m.max_seq_len, scale)
    torch.testing.assert_close(out / (SCALE.v * 8), exact / (SCALE.v * 8), atol=FP8_ATOL, rtol=FP8_RTOL)


@pytest.mark.parametrize("dtype", MODEL_DTYPES)
def test_paged_prefill_fp8_matches_reference(dtype: torch.dtype) -> None:
    batch, pool = fp8_batch(PREFILL_SPECS, 4, 2, 64, SCALE, dtype)
    store_kv(batch.k_new, batch.v_new, pool.k_cache(0), pool.v_cache(0), batch.meta.slot_mapping, SCALE)
    m, scale = batch.meta, 64**-0.5 / SCALE.k / 8
    kc, vc = pool.k_cache(0), pool.v_cache(0)
    out = paged_prefill_attention(batch.q, kc, vc, m.block_tables, m.seq_lens, m.query_start_loc,
                                  m.max_query_len, scale, kv_scale=SCALE)
    ref = paged_prefill_attention_reference(batch.q, kc, vc, m.block_tables, m.seq_lens, m.query_start_loc,
                                            m.max_query_len, m.max_seq_len, scale, kv_scale=SCALE)
    tol = KERNEL_TOL[dtype]
    torch.testing.assert_close(out, ref, atol=tol * SCALE.v * 8, rtol=tol)
    full = _unquantised(batch)
    exact = paged_prefill_attention_reference(batch.q, full.k_cache(0), full.v_cache(0), m.block_tables,
                                              m.seq_lens, m.query_start_loc, m.max_query_len, m.max_seq_len,
                                              scale)
    torch.testing.assert_close(out / (SCALE.v * 8), exact / (SCALE.v * 8), atol=FP8_ATOL, rtol=FP8_RTOL)


def test_fp8_pool_takes_one_byte_per_element() -> None:
    bf16 = KVCachePool.fit_num_blocks(2, 16, 2, 64, torch.bfloat16, cpu_kv_bytes=1 << 20, memory_fraction=1.0)
    fp8 = KVCachePool.fit_num_blocks(2, 16, 2, 64, FP8_KV_DTYPE, cpu_kv_bytes=1 << 20, memory_fraction=1.0)
    assert (bf16, fp8) == ((1 << 20) // (2 * 2 * 16 * 2 * 64 * 2), (1 << 20) // (2 * 2 * 16 * 2 * 64))
    pool = KVCachePool.from_memory(2, 16, 2, 64, torch.bfloat16, cpu_kv_bytes=1 << 20, memory_fraction=1.0,
                                   cache_dtype=FP8_KV_DTYPE)
    assert pool.num_blocks == fp8 and pool.kv_buffer.dtype == FP8_KV_DTYPE and pool.dtype == torch.bfloat16
    assert pool.layer_block_bytes == 16 * 2 * 64 and pool.bytes_per_block == 2 * 2 * 16 * 2 * 64
    assert pool.kv_scale(1) == KVScale(1.0, 1.0)


def test_bad_scales_and_dtypes_are_refused() -> None:
    pool = KVCachePool(1, 2, 4, 2, 64, F32, DEVICE, cache_dtype=FP8_KV_DTYPE)
    k = torch.ones(3, 2, 64, device=DEVICE)
    slots = torch.arange(3, device=DEVICE)
    with pytest.raises(ValueError, match=r"kv_scale\.k"):
        store_kv(k, k, pool.k_cache(0), pool.v_cache(0), slots, KVScale(0.0, 1.0))
    with pytest.raises(ValueError, match=r"kv_scale\.v"):
        store_kv_reference(k, k, pool.k_cache(0), pool.v_cache(0), slots, KVScale(1.0, float("nan")))
    with pytest.raises(ValueError, match="cache_dtype"):
        KVCachePool(1, 2, 4, 2, 64, F32, DEVICE, cache_dtype=torch.float16)


@pytest.mark.parametrize(("lens", "splits"), [([37, 16, 60], 3), ([33, 90], None)])
def test_fused_decode_rope_store_fp8_equals_rotary_store_then_attention(lens: list[int],
                                                                        splits: int | None) -> None:
    """The decode kernel's own RoPE + store (``RopeStore``) quantises exactly as ``rotary_store_kv``: the
    same FP8 cache bytes, the same output (fp32 model dtype)."""
    from engine.ops.paged_decode import RopeStore
    from tests.engine.test_decode_rope import _step

    x = _step(F32, lens, 8, 2, 64)
    inv_k, inv_v = inverse_scales(SCALE)
    kc = quantize_kv_reference(x["kc"] * SCALE.k * 8, inv_k, FP8_KV_DTYPE)
    vc = quantize_kv_reference(x["vc"] * SCALE.v * 8, inv_v, FP8_KV_DTYPE)
    k, v = x["k"] * SCALE.k * 8, x["v"] * SCALE.v * 8
    scale = 64**-0.5 / SCALE.k / 8
    q2, k2, kc2, vc2 = x["q"].clone(), k.clone(), kc.clone(), vc.clone()
    rotary_store_kv(q2, k2, v, x["cos"], x["sin"], kc2, vc2, x["slots"], SCALE)
    want = paged_decode_attention(q2, kc2, vc2, x["tables"], x["lens"], x["max_len"], scale,
                                  num_splits=splits, kv_scale=SCALE)
    got = paged_decode_attention(x["q"], kc, vc, x["tables"], x["lens"], x["max_len"], scale,
                                 num_splits=splits, rope=RopeStore(k, v, x["cos"], x["sin"], x["slots"]),
                                 kv_scale=SCALE)
    assert torch.equal(raw(kc), raw(kc2)) and torch.equal(raw(vc), raw(vc2))
    assert not torch.equal(raw(kc), raw(quantize_kv_reference(x["kc"] * SCALE.k * 8, inv_k, FP8_KV_DTYPE)))
    assert torch.equal(got[:-1], want[:-1])  # the padding row's output is never used
