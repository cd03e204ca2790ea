"""The candidate variants of ``paged_prefill_attention`` (explicit tiles, GQA packing, longest-first launch
order) give the reference's answer, and (interpreter, float32 and float16) the very numbers of the
default kernel: each row's softmax walks the same KV tiles in the same order, so a variant cannot change
what a cache hit returns."""

from __future__ import annotations

import pytest
import torch

from engine.ops.paged_prefill import paged_prefill_attention, paged_prefill_attention_reference
from engine.ops.store_kv import store_kv
from tests.engine.test_kernels import (
    BS,
    PREFILL_SPECS,
    TOL,
    assert_no_stray_writes,
    make_batch,
    naive_attention,
)

F32, F16 = torch.float32, torch.float16
# (pack_gqa, longest_first, tile): BLOCK_N 16 reads two pages of BS 8 per KV tile
VARIANTS = [
    (True, False, None),
    (False, True, None),
    (True, True, (32, 16, 1, 1)),
    (False, False, (32, 16, 1, 1)),
    (True, False, (16, 8, 1, 1)),
]


def _run(batch, **kw):  # type: ignore[no-untyped-def]
    m = batch.meta
    return paged_prefill_attention(batch.q, batch.pool.k_cache(0), batch.pool.v_cache(0), m.block_tables,
                                   m.seq_lens, m.query_start_loc, m.max_query_len, batch.q.shape[2] ** -0.5,
                                   **kw)


interpreter_only = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter tiles and bit-equality; "
                                      "the GPU runs test_prefill_variant_bf16_gpu")


@interpreter_only
@pytest.mark.parametrize(("dtype", "shape"), [(F32, (8, 2, 64)), (F16, (9, 3, 32))])
@pytest.mark.parametrize(("pack_gqa", "longest_first", "tile"), VARIANTS)
def test_prefill_variant_matches_reference_and_default(
    dtype: torch.dtype, shape: tuple[int, int, int], pack_gqa: bool, longest_first: bool,
    tile: tuple[int, int, int, int] | None,
) -> None:
    num_heads, num_kv_heads, head_dim = shape
    specs = [*PREFILL_SPECS, (5 * BS + 3, 2 * BS + 5)]  # a cached prefix longer than one KV tile
    batch = make_batch(specs, num_heads, num_kv_heads, head_dim, BS, dtype)
    store_kv(batch.k_new, batch.v_new, batch.pool.k_cache(0), batch.pool.v_cache(0), batch.meta.slot_mapping)
    m = batch.meta
    got = _run(batch, tile=tile, pack_gqa=pack_gqa, longest_first=longest_first)
    ref = paged_prefill_attention_reference(batch.q, batch.pool.k_cache(0), batch.pool.v_cache(0),
                                            m.block_tables, m.seq_lens, m.query_start_loc, m.max_query_len,
                                            m.max_seq_len, head_dim ** -0.5)
    torch.testing.assert_close(got, ref, atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(got.double(), naive_attention(batch, head_dim ** -0.5), atol=TOL[dtype],
                               rtol=TOL[dtype])
    assert_no_stray_writes(batch)
    same_kv_tiles = (tile or (16, 16, 1, 1))[1] == 16  # the default's BLOCK_N on the interpreter
    if same_kv_tiles:
        assert torch.equal(got, _run(batch)), "same KV tiles, other numbers than the default kernel"


@interpreter_only
def test_packed_prefill_seq_offset_leaves_earlier_rows() -> None:
    batch = make_batch([(4, 1), (0, 5), (2, 7)], 8, 2, 64, BS, F32)
    store_kv(batch.k_new, batch.v_new, batch.pool.k_cache(0), batch.pool.v_cache(0), batch.meta.slot_mapping)
    out = torch.full_like(batch.q, -3.0)
    _run(batch, seq_offset=1, out=out, pack_gqa=True)
    assert bool((out[0] == -3.0).all())
    torch.testing.assert_close(out[1:].double(), naive_attention(batch, 64 ** -0.5)[1:], atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize(("tile", "pack", "words"), [
    ((24, 16, 1, 1), False, "BLOCK_M must be a power of two"),
    ((16, 48, 1, 1), False, "BLOCK_N must be a power of two"),
    ((16, 16, 3, 1), False, "num_warps must be a power of two"),
    ((16, 16, 1, 0), False, "num_stages must be >= 1"),
    ((2, 16, 1, 1), True, "BLOCK_M must hold one token's 4"),
])
def test_bad_prefill_tile_is_refused(tile: tuple[int, int, int, int], pack: bool, words: str) -> None:
    batch = make_batch([(0, 3)], 8, 2, 64, BS, F32)
    with pytest.raises(ValueError, match=words):
        _run(batch, tile=tile, pack_gqa=pack)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled bf16 Triton kernels need CUDA")
@pytest.mark.gpu
@pytest.mark.parametrize(("pack_gqa", "longest_first", "tile"), [
    (True, False, (64, 64, 4, 3)), (True, False, (128, 64, 8, 3)), (True, True, (128, 128, 8, 2)),
    (False, True, None), (False, False, (128, 64, 8, 2)),
])
def test_prefill_variant_bf16_gpu(pack_gqa: bool, longest_first: bool,
                                  tile: tuple[int, int, int, int] | None) -> None:
    specs = [(0, 15), (16, 17), (37, 300), (1000, 129), (5, 1), (2000, 770)]
    batch = make_batch(specs, 32, 8, 128, 16, torch.bfloat16)
    store_kv(batch.k_new, batch.v_new, batch.pool.k_cache(0), batch.pool.v_cache(0), batch.meta.slot_mapping)
    m = batch.meta
    got = _run(batch, tile=tile, pack_gqa=pack_gqa, longest_first=longest_first)
    ref = paged_prefill_attention_reference(batch.q, batch.pool.k_cache(0), batch.pool.v_cache(0),
                                            m.block_tables, m.seq_lens, m.query_start_loc, m.max_query_len,
                                            m.max_seq_len, 128 ** -0.5)
    torch.testing.assert_close(got, ref, atol=2e-2, rtol=2e-2)
    assert_no_stray_writes(batch)


def test_default_packing_follows_the_device() -> None:
    """Not told, the kernel packs the query heads of a KV head on a GPU with grouped-query attention
    (``prefill_pack_gqa``) and not in the interpreter, without GQA, or when the packed group would leave
    fewer than 4 tokens in the tile (no query-head count can make the default call fail); on this device
    the default call gives the very numbers of the explicit choice."""
    from engine.ops.paged_prefill import prefill_pack_gqa

    cases = ((4, True, 64), (1, True, 64), (4, False, 64), (16, True, 64), (17, True, 64), (128, True, 64))
    assert [prefill_pack_gqa(*c) for c in cases] == [True, False, False, True, False, False]
    batch = make_batch([(3, 5), (0, 9)], 8, 2, 64, BS, F32)
    store_kv(batch.k_new, batch.v_new, batch.pool.k_cache(0), batch.pool.v_cache(0), batch.meta.slot_mapping)
    explicit = _run(batch, pack_gqa=prefill_pack_gqa(4, batch.q.is_cuda, 16))
    assert torch.equal(_run(batch), explicit)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled bf16 Triton kernels need CUDA")
@pytest.mark.gpu
def test_default_prefill_is_packed_bf16_gpu() -> None:
    """On the GPU the engine's default call is the GQA-packed kernel, bit for bit."""
    batch = make_batch([(0, 15), (37, 300), (2000, 770)], 32, 8, 128, 16, torch.bfloat16)
    store_kv(batch.k_new, batch.v_new, batch.pool.k_cache(0), batch.pool.v_cache(0), batch.meta.slot_mapping)
    assert torch.equal(_run(batch), _run(batch, pack_gqa=True))


SPLITS_SPECS = [(5 * BS + 3, 2 * BS + 5), (0, 3), (9 * BS + 1, 4), (2 * BS, 2 * BS + 1)]


# 3 and 5 slices: over SPLITS_SPECS and each variant's tiles, 3 gives every slicing case 2 does (empty
# slices for short sequences, slices of several KV tiles, a diagonal-masked tile, a ragged end) and 5
# adds rows that see nothing of a non-empty slice; 2 gives none of its own (the seq-offset test below and
# test_split_kv_prefill_bf16_gpu run 2 slices)
@interpreter_only
@pytest.mark.parametrize("num_splits", [3, 5])
@pytest.mark.parametrize(("pack_gqa", "longest_first", "tile"), [
    (False, False, None), (True, True, (16, 8, 1, 1)), (True, False, (32, 16, 1, 1))])
def test_split_kv_prefill_matches_reference_and_is_repeatable(
    num_splits: int, pack_gqa: bool, longest_first: bool, tile: tuple[int, int, int, int] | None,
) -> None:
    """Each query tile's KV cut into slices (some rows see nothing of a slice, some slices are empty for
    short sequences) and the partials combined: the reference's answer, the same bits on a second call,
    and no write outside the computed rows."""
    batch = make_batch(SPLITS_SPECS, 8, 2, 64, BS, F32)
    store_kv(batch.k_new, batch.v_new, batch.pool.k_cache(0), batch.pool.v_cache(0), batch.meta.slot_mapping)
    m = batch.meta
    kw = dict(tile=tile, pack_gqa=pack_gqa, longest_first=longest_first, num_splits=num_splits)
    got = _run(batch, **kw)
    torch.testing.assert_close(got.double(), naive_attention(batch, 64 ** -0.5), atol=2e-5, rtol=2e-5)
    ref = paged_prefill_attention_reference(batch.q, batch.pool.k_cache(0), batch.pool.v_cache(0),
                                            m.block_tables, m.seq_lens, m.query_start_loc, m.max_query_len,
                                            m.max_seq_len, 64 ** -0.5)
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=2e-5)
    assert torch.equal(got, _run(batch, **kw))
    assert_no_stray_writes(batch)


@interpreter_only
def test_split_kv_prefill_seq_offset_leaves_earlier_rows() -> None:
    """The combine kernel writes only the computed sequences' rows: a decode row before them keeps its
    value."""
    batch = make_batch([(4, 1), (3 * BS, 5), (2, 7)], 8, 2, 64, BS, F32)
    store_kv(batch.k_new, batch.v_new, batch.pool.k_cache(0), batch.pool.v_cache(0), batch.meta.slot_mapping)
    out = torch.full_like(batch.q, -3.0)
    _run(batch, seq_offset=1, out=out, num_splits=2)
    assert bool((out[0] == -3.0).all())
    torch.testing.assert_close(out[1:].double(), naive_attention(batch, 64 ** -0.5)[1:], atol=2e-5, rtol=2e-5)


def test_bad_split_count_is_refused() -> None:
    batch = make_batch([(0, 3)], 8, 2, 64, BS, F32)
    with pytest.raises(ValueError, match="num_splits must be >= 1"):
        _run(batch, num_splits=0)


def test_kv_splits_fill_the_waves_of_a_long_sequence_only() -> None:
    """``prefill_kv_splits`` on an H200's 132 SMs (2 programs each): one 15k-token sequence with 770 new
    tokens in 64-row tiles (49 packed query tiles x 8 KV heads = 392 programs, two waves the second half
    empty) gets 2 slices (three full waves); 8 such sequences, an 8k prompt (4096 programs) or a short
    context stay whole; the count never leaves a slice shorter than 1024 positions."""
    from engine.ops.paged_prefill import prefill_kv_splits

    assert prefill_kv_splits(392, 15360, 132) == 2
    assert prefill_kv_splits(392 * 8, 15360, 132) == 1
    assert prefill_kv_splits(4096, 8192, 132) == 1
    assert prefill_kv_splits(8, 1500, 132) == 1  # 1500 positions: no two slices of 1024
    assert prefill_kv_splits(8, 100_000, 132) == 8  # 8 programs on 264 slots: as many slices as allowed
    assert prefill_kv_splits(8, 3000, 132) == 2
    # the packed 256-row tile, one program per SM: 104 programs (13 tiles x 8 KV heads) leave 28 SMs
    # idle, 5 slices make 4 full waves of a fifth of the work (0.8); 8 sequences (832 programs) take 3
    # slices (19 waves of a third against 7 whole: 0.9); an 8k prompt's 1024 programs stay whole
    assert prefill_kv_splits(104, 15360, 132, programs_per_sm=1) == 5
    assert prefill_kv_splits(832, 15360, 132, programs_per_sm=1) == 3
    assert prefill_kv_splits(1024, 8192, 132, programs_per_sm=1) == 1


def test_programs_per_sm_of_the_default_gpu_tiles() -> None:
    from engine.ops.paged_prefill import prefill_tiles, programs_per_sm

    packed, plain = prefill_tiles(128, True, 4, long_kv=True), prefill_tiles(128, True, 1, long_kv=True)
    assert (packed, plain, prefill_tiles(128, True, 4)) == ((256, 64, 8, 2), (64, 64, 4, 3), (64, 64, 4, 3))
    assert programs_per_sm(packed, 128, 2) == 1
    assert programs_per_sm(plain, 128, 2) == 2
    assert programs_per_sm((16, 16, 4, 1), 16, 2) == 16  # warps bound it: 64 per SM


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled bf16 Triton kernels need CUDA")
@pytest.mark.gpu
@pytest.mark.parametrize(("pack_gqa", "num_splits"), [(True, 2), (True, 3), (False, 4), (True, None)])
def test_split_kv_prefill_bf16_gpu(pack_gqa: bool, num_splits: int | None) -> None:
    specs = [(15000, 770)] if num_splits is None else [(0, 15), (37, 300), (2000, 770), (15000, 100)]
    batch = make_batch(specs, 32, 8, 128, 16, torch.bfloat16)
    store_kv(batch.k_new, batch.v_new, batch.pool.k_cache(0), batch.pool.v_cache(0), batch.meta.slot_mapping)
    m = batch.meta
    got = _run(batch, pack_gqa=pack_gqa, num_splits=num_splits, max_seq_len=m.max_seq_len)
    ref = paged_prefill_attention_reference(batch.q, batch.pool.k_cache(0), batch.pool.v_cache(0),
                                            m.block_tables, m.seq_lens, m.query_start_loc, m.max_query_len,
                                            m.max_seq_len, 128 ** -0.5)
    torch.testing.assert_close(got, ref, atol=2e-2, rtol=2e-2)
    assert torch.equal(got, _run(batch, pack_gqa=pack_gqa, num_splits=num_splits, max_seq_len=m.max_seq_len))
    assert_no_stray_writes(batch)
