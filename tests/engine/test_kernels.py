"""Triton kernels (engine/ops) against their plain-torch references and an independent float64 softmax.

On CPU the kernels run through Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1): fp32 and
fp16 only, small shapes, a subset of each grid (tests/engine/grid.py). bf16 and the full grids need a GPU
(``gpu`` mark; scripts/gpu_tests.sh runs them on an H200).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import pytest
import torch

from engine.attention.metadata import AttentionMetadata, build_attention_metadata
from engine.kv_cache import KVCachePool
from engine.ops.paged_decode import paged_decode_attention, paged_decode_attention_reference
from engine.ops.paged_prefill import paged_prefill_attention, paged_prefill_attention_reference
from engine.ops.store_kv import store_kv, store_kv_reference
from tests.engine.grid import grid

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
gpu_only = pytest.mark.skipif(not CUDA, reason="bf16 Triton kernels need CUDA (interpreter lacks bf16)")


@dataclass
class PagedBatch:
    """A packed step over a paged cache, plus each sequence's full K/V for an independent reference."""

    pool: KVCachePool
    meta: AttentionMetadata
    q: torch.Tensor  # [T, H, D]
    k_new: torch.Tensor  # [T, Hkv, D]
    v_new: torch.Tensor
    k_full: list[torch.Tensor]  # per sequence [seq_len, Hkv, D]
    v_full: list[torch.Tensor]
    specs: list[tuple[int, int]]  # (num_computed_tokens, query_len)
    used_slots: torch.Tensor  # bool [num_blocks * block_size]: slots owned by some sequence


def make_batch(
    specs: list[tuple[int, int]], num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
    dtype: torch.dtype, device: str = DEVICE, seed: int = 0, spare_blocks: int = 3,
) -> PagedBatch:
    """Random sequences with scattered (permuted) blocks; their cached prefixes are written into the
    cache by plain indexing (independent of the kernels). Unused blocks hold a sentinel (7.0)."""
    gen = torch.Generator().manual_seed(seed)
    needed = [math.ceil((c + q) / block_size) for c, q in specs]
    num_blocks = sum(needed) + spare_blocks
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, start = [], 0
    for n in needed:
        tables.append(perm[start:start + n])
        start += n
    pool = KVCachePool(1, num_blocks, block_size, num_kv_heads, head_dim, dtype, device)
    pool.kv_buffer.fill_(7.0)
    meta = build_attention_metadata(tables, [c for c, _ in specs], [q for _, q in specs], block_size, device)
    k_full, v_full, k_new, v_new = [], [], [], []
    used = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    for (computed, qlen), table in zip(specs, tables, strict=True):
        k = torch.randn(computed + qlen, num_kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(computed + qlen, num_kv_heads, head_dim, generator=gen).to(dtype)
        for pos in range(computed + qlen):
            block, off = table[pos // block_size], pos % block_size
            used[block * block_size + off] = True
            if pos < computed:
                pool.k_cache(0)[block, off] = k[pos].to(device)
                pool.v_cache(0)[block, off] = v[pos].to(device)
        k_full.append(k.to(device))
        v_full.append(v.to(device))
        k_new.append(k[computed:])
        v_new.append(v[computed:])
    num_tokens = sum(q for _, q in specs)
    q = torch.randn(num_tokens, num_heads, head_dim, generator=gen).to(dtype).to(device)
    return PagedBatch(pool, meta, q, torch.cat(k_new).to(device), torch.cat(v_new).to(device),
                      k_full, v_full, list(specs), used)


def naive_attention(batch: PagedBatch, scale: float) -> torch.Tensor:
    """Float64 softmax attention from the full per-sequence K/V (no paging): ``[T, H, D]`` float64."""
    outs, start = [], 0
    num_heads = batch.q.shape[1]
    group = num_heads // batch.k_full[0].shape[1]
    for (computed, qlen), k, v in zip(batch.specs, batch.k_full, batch.v_full, strict=True):
        q = batch.q[start:start + qlen].double()  # [n, H, D]
        kk = k.double().repeat_interleave(group, dim=1)  # [L, H, D]
        vv = v.double().repeat_interleave(group, dim=1)
        scores = torch.einsum("nhd,lhd->hnl", q, kk) * scale
        rows = torch.arange(qlen, device=q.device)[:, None]
        cols = torch.arange(computed + qlen, device=q.device)[None, :]
        scores = scores.masked_fill(cols > computed + rows, float("-inf"))
        outs.append(torch.einsum("hnl,lhd->nhd", scores.softmax(-1), vv))
        start += qlen
    return torch.cat(outs)


def assert_no_stray_writes(batch: PagedBatch) -> None:
    """Leak check: slots no sequence owns still hold the sentinel."""
    for cache in (batch.pool.k_cache(0), batch.pool.v_cache(0)):
        flat = cache.reshape(-1, *cache.shape[2:]).cpu()
        assert bool((flat[~batch.used_slots] == 7.0).all()), "a kernel wrote outside slot_mapping"


# ---------------------------------------------------------------------------------------------- store_kv
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_kv_heads,head_dim", [(1, 64), (3, 64), (2, 128)])
def test_store_kv_matches_reference_and_full_kv(dtype: torch.dtype, num_kv_heads: int, head_dim: int) -> None:
    batch = make_batch([(5, 1), (0, 9), (7, 10)], num_kv_heads, num_kv_heads, head_dim, 8, dtype)
    # k as a non-contiguous view (slice of a fused qkv projection), as the model produces it
    fused = torch.cat([batch.k_new, batch.v_new], dim=1)
    k_view, v_view = fused[:, :num_kv_heads], fused[:, num_kv_heads:]
    ref_k, ref_v = batch.pool.k_cache(0).clone(), batch.pool.v_cache(0).clone()
    store_kv_reference(batch.k_new, batch.v_new, ref_k, ref_v, batch.meta.slot_mapping)
    store_kv(k_view, v_view, batch.pool.k_cache(0), batch.pool.v_cache(0), batch.meta.slot_mapping)
    assert torch.equal(batch.pool.k_cache(0), ref_k)
    assert torch.equal(batch.pool.v_cache(0), ref_v)
    bs = batch.pool.block_size
    for i, (computed, qlen) in enumerate(batch.specs):  # every position of every sequence now cached
        table = batch.meta.block_tables[i].tolist()
        for pos in range(computed + qlen):
            assert torch.equal(batch.pool.k_cache(0)[table[pos // bs], pos % bs], batch.k_full[i][pos])
            assert torch.equal(batch.pool.v_cache(0)[table[pos // bs], pos % bs], batch.v_full[i][pos])
    assert_no_stray_writes(batch)


def test_store_kv_skips_negative_slots() -> None:
    pool = KVCachePool(1, 2, 4, 2, 64, torch.float32, DEVICE)
    k = torch.ones(3, 2, 64, device=DEVICE)
    store_kv(k, 2 * k, pool.k_cache(0), pool.v_cache(0), torch.tensor([5, -1, 0], device=DEVICE))
    written = pool.k_cache(0).reshape(8, 2, 64).abs().sum(dim=(1, 2)).cpu()
    assert written.tolist() == [128.0, 0, 0, 0, 0, 128.0, 0, 0]
    assert torch.equal(pool.v_cache(0).reshape(8, 2, 64)[5], 2 * k[0])


def test_store_kv_rejects_bad_inputs() -> None:
    pool = KVCachePool(1, 2, 4, 2, 64, torch.float32, DEVICE)
    k = torch.ones(3, 2, 64, device=DEVICE)
    with pytest.raises(ValueError, match="slot_mapping"):
        store_kv(k, k, pool.k_cache(0), pool.v_cache(0), torch.tensor([0, 1, 2], device=DEVICE).int())
    with pytest.raises(ValueError, match="dtype"):
        store_kv(k.half(), k.half(), pool.k_cache(0), pool.v_cache(0), torch.arange(3, device=DEVICE))
    with pytest.raises(ValueError, match="does not fit"):
        store_kv(k[:, :1], k[:, :1], pool.k_cache(0), pool.v_cache(0), torch.arange(3, device=DEVICE))


# ------------------------------------------------------------------------------------------ paged decode
BS = 8
DECODE_LENS = [BS - 1, BS, BS + 1, 3 * BS + 2, 1]  # seq_len incl. the query: around block boundaries


def _decode(batch: PagedBatch, scale: float, num_splits: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    store_kv(batch.k_new, batch.v_new, batch.pool.k_cache(0), batch.pool.v_cache(0), batch.meta.slot_mapping)
    args = (batch.q, batch.pool.k_cache(0), batch.pool.v_cache(0), batch.meta.block_tables,
            batch.meta.seq_lens, batch.meta.max_seq_len, scale)
    return paged_decode_attention(*args, num_splits=num_splits), paged_decode_attention_reference(*args)


F32, F16 = torch.float32, torch.float16
DECODE_GRID = grid(list(itertools.product([F32, F16], [(2, 2, 64), (6, 2, 64), (4, 1, 128)], [None, 1, 3])),
                   cpu=[(F32, (6, 2, 64), None), (F32, (4, 1, 128), 3), (F16, (6, 2, 64), 3),
                        (F16, (2, 2, 64), 1), (F16, (4, 1, 128), None)])


@pytest.mark.parametrize(("dtype", "shape", "num_splits"), DECODE_GRID)
def test_paged_decode_matches_reference(
    dtype: torch.dtype, shape: tuple[int, int, int], num_splits: int | None
) -> None:
    num_heads, num_kv_heads, head_dim = shape
    batch = make_batch([(n - 1, 1) for n in DECODE_LENS], num_heads, num_kv_heads, head_dim, BS, dtype)
    scale = head_dim**-0.5
    out, ref = _decode(batch, scale, num_splits)
    assert out.shape == batch.q.shape and out.dtype == dtype
    torch.testing.assert_close(out, ref, atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(out.double(), naive_attention(batch, scale), atol=TOL[dtype], rtol=TOL[dtype])
    assert_no_stray_writes(batch)


@gpu_only
@pytest.mark.gpu
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(8, 8, 128), (32, 8, 128), (9, 3, 64)])
def test_paged_decode_bf16_gpu(num_heads: int, num_kv_heads: int, head_dim: int) -> None:
    specs = [(n - 1, 1) for n in [15, 16, 17, 300, 1000, 1]]
    batch = make_batch(specs, num_heads, num_kv_heads, head_dim, 16, torch.bfloat16)
    out, ref = _decode(batch, head_dim**-0.5, None)
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)
    assert_no_stray_writes(batch)


# ----------------------------------------------------------------------------------------- paged prefill
PREFILL_SPECS = [
    (0, BS - 1), (0, BS), (0, BS + 1),  # fresh prompts around a block boundary
    (BS, BS + 3),  # cached prefix of a full block
    (5, 2 * BS + 4),  # a chunk that starts mid-block (chunked prefill)
    (3 * BS + 1, 1),  # single-token chunk after a long context
]


def _prefill(batch: PagedBatch, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    store_kv(batch.k_new, batch.v_new, batch.pool.k_cache(0), batch.pool.v_cache(0), batch.meta.slot_mapping)
    m = batch.meta
    kc, vc = batch.pool.k_cache(0), batch.pool.v_cache(0)
    out = paged_prefill_attention(batch.q, kc, vc, m.block_tables, m.seq_lens, m.query_start_loc,
                                  m.max_query_len, scale)
    ref = paged_prefill_attention_reference(batch.q, kc, vc, m.block_tables, m.seq_lens, m.query_start_loc,
                                            m.max_query_len, m.max_seq_len, scale)
    return out, ref


PREFILL_GRID = grid(list(itertools.product([F32, F16], [(2, 2, 64), (3, 1, 64), (8, 2, 128)])),
                    cpu=[(F32, (3, 1, 64)), (F16, (2, 2, 64)), (F16, (8, 2, 128))])


@pytest.mark.parametrize(("dtype", "shape"), PREFILL_GRID)
def test_paged_prefill_matches_reference(dtype: torch.dtype, shape: tuple[int, int, int]) -> None:
    num_heads, num_kv_heads, head_dim = shape
    batch = make_batch(PREFILL_SPECS, num_heads, num_kv_heads, head_dim, BS, dtype)
    scale = head_dim**-0.5
    out, ref = _prefill(batch, scale)
    assert out.shape == batch.q.shape and out.dtype == dtype
    torch.testing.assert_close(out, ref, atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(out.double(), naive_attention(batch, scale), atol=TOL[dtype], rtol=TOL[dtype])
    assert_no_stray_writes(batch)


def test_paged_prefill_seq_offset_leaves_earlier_rows() -> None:
    batch = make_batch([(4, 1), (0, 5), (2, 7)], 4, 2, 64, BS, torch.float32)
    store_kv(batch.k_new, batch.v_new, batch.pool.k_cache(0), batch.pool.v_cache(0), batch.meta.slot_mapping)
    m = batch.meta
    out = torch.full_like(batch.q, -3.0)
    paged_prefill_attention(batch.q, batch.pool.k_cache(0), batch.pool.v_cache(0), m.block_tables,
                            m.seq_lens, m.query_start_loc, m.max_query_len, 0.125, seq_offset=1, out=out)
    assert bool((out[0] == -3.0).all())
    torch.testing.assert_close(out[1:].double(), naive_attention(batch, 0.125)[1:], atol=2e-5, rtol=2e-5)


@gpu_only
@pytest.mark.gpu
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(8, 8, 128), (32, 8, 128), (9, 3, 64)])
def test_paged_prefill_bf16_gpu(num_heads: int, num_kv_heads: int, head_dim: int) -> None:
    specs = [(0, 15), (0, 16), (16, 17), (37, 300), (1000, 129), (5, 1)]
    batch = make_batch(specs, num_heads, num_kv_heads, head_dim, 16, torch.bfloat16)
    out, ref = _prefill(batch, head_dim**-0.5)
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)
    assert_no_stray_writes(batch)


@gpu_only
def test_new_split_counts_compile_no_new_kernel() -> None:
    """Regression (2×H200 serving): ``num_splits`` was a compile-time constant, so an eager mixed step
    with a split count not met before compiled two new kernels on the serving path (~2 s stalls on a fresh
    colocated worker). Now the split kernel compiles once for every count, and the reduce kernel once per
    power-of-two ``BLOCK_S``; results stay equal to the reference."""
    from engine.ops import paged_decode as pd

    def variants(fn) -> int:  # type: ignore[no-untyped-def]
        return sum(len(caches[0]) for caches in fn.device_caches.values())

    dtype = torch.bfloat16
    batch = make_batch([(95, 1), (60, 1)], 8, 2, 128, BS, dtype)
    _decode(batch, 128**-0.5, 5)  # compiles the split kernel and the reduce kernel for BLOCK_S 8
    split_before, reduce_before = variants(pd._decode_split_kernel), variants(pd._decode_reduce_kernel)
    for splits in (6, 7, 3, 2):  # BLOCK_S 8, 8, 4, 2
        out, ref = _decode(batch, 128**-0.5, splits)
        torch.testing.assert_close(out, ref, atol=TOL[dtype], rtol=TOL[dtype])
    assert variants(pd._decode_split_kernel) == split_before
    assert variants(pd._decode_reduce_kernel) <= reduce_before + 2  # BLOCK_S 4 and 2 at most


@gpu_only
def test_prefill_seq_offsets_compile_no_new_kernel() -> None:
    """Like the split counts: a mixed step's number of decode rows (``seq_offset``) must not select a new
    compiled variant (Triton specialises integers equal to 1 or divisible by 16 unless told not to)."""
    from engine.ops import paged_prefill as pp

    specs = [(3, 1)] * 17 + [(0, 9)]  # 17 decode rows, then one prompt chunk
    batch = make_batch(specs, 4, 2, 64, BS, torch.bfloat16)
    store_kv(batch.k_new, batch.v_new, batch.pool.k_cache(0), batch.pool.v_cache(0), batch.meta.slot_mapping)
    m = batch.meta
    args = (batch.q, batch.pool.k_cache(0), batch.pool.v_cache(0), m.block_tables, m.seq_lens,
            m.query_start_loc, m.max_query_len, 0.125)
    pp.paged_prefill_attention(*args, seq_offset=17)
    before = sum(len(c[0]) for c in pp._prefill_kernel.device_caches.values())
    for offset in (16, 1, 0, 5):
        pp.paged_prefill_attention(*args, seq_offset=offset)
    assert sum(len(c[0]) for c in pp._prefill_kernel.device_caches.values()) == before
