"""Paged prefill attention: varlen query chunks over a paged KV with a cached prefix (Triton + reference).

FlashAttention-2 forward (Dao, 2023, "FlashAttention-2: Faster Attention with Better Parallelism and Work
Partitioning", Alg. 1): one program per (query tile, sequence, query head) keeps a running max, sum and
output in registers while it walks the KV in tiles (online softmax, exp2 with the scale folded in). The
KV is read through the block table (vLLM PagedAttention, Kwon et al., SOSP'23); the new tokens' K/V are
already stored, so the cached prefix and the new tokens come through one path. Query ``i`` of a sequence
with ``c = seq_len - query_len`` cached tokens sees KV positions ``<= c + i`` (bottom-right causal). KV
tiles wholly below the tile's diagonal run without masks; only the last ones are masked. Optionally
(``pack_gqa``) one program holds the query heads of one KV head as rows of its tile, so grouped-query
attention (Ainslie et al., 2023) reads each K/V tile once per group instead of once per query head. An
FP8 cache (engine/ops/store_kv.py) is dequantised on load: raw values into the dots, the K scale folded
into the softmax scale, the output multiplied by the V scale.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.ops.paged_decode import LOG2E, gather_paged_kv
from engine.ops.paged_tiles import attend_paged_tiles
from engine.ops.pdl import gdc_enter, pdl_kwargs
from engine.ops.store_kv import UNIT_SCALE, KVScale, _check_scale, dequantize_kv_reference


# seq_offset (the step's number of decode rows) is not specialised: Triton would otherwise compile separate
# variants for 1, multiples of 16 and other values, met first on the serving path by mixed steps.
@triton.jit(do_not_specialize=["seq_offset"])
def _prefill_kernel(  # type: ignore[no-untyped-def]  # Triton kernel: arguments are typed by @triton.jit
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr, out_ptr,
    scale_log2, v_scale, seq_offset,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_cs, stride_ch, stride_bt,
    QUERIES_PER_KV: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
    USE_GDC: tl.constexpr, GROUP: tl.constexpr, LONGEST_FIRST: tl.constexpr,
):
    gdc_enter(USE_GDC)
    pid_m = tl.program_id(0)
    # longest first: the last query tiles see the most KV, so they start first
    tile_m = tl.num_programs(0) - 1 - pid_m if LONGEST_FIRST else pid_m
    seq = tl.program_id(1) + seq_offset
    tokens_m: tl.constexpr = BLOCK_M // GROUP  # query tokens per program
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if tile_m * tokens_m >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context = seq_len - q_len
    r = tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    if GROUP == 1:  # one query head per program
        rows = tile_m * BLOCK_M + r
        head = tl.program_id(2)
        kv_head = head // QUERIES_PER_KV
        row_ok = rows < q_len
    else:  # GQA packed: row r is token r // GROUP of the tile, query head r % GROUP of the KV head's group
        rows = tile_m * tokens_m + r // GROUP
        kv_head = tl.program_id(2)
        head = kv_head * QUERIES_PER_KV + r % GROUP
        row_ok = (rows < q_len) & (r % GROUP < QUERIES_PER_KV)
    io_mask = row_ok[:, None] & (dims < HEAD_DIM)[None, :]
    tokens = (q_start + rows).to(tl.int64)
    q_off = tokens * stride_qt + head * stride_qh
    q = tl.load(q_ptr + q_off[:, None] + dims[None, :], mask=io_mask, other=0.0)
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    # KV below every row's diagonal: no mask needed.
    full_end = ((context + tile_m * tokens_m) // BLOCK_N) * BLOCK_N
    acc, m_i, l_i = attend_paged_tiles(
        acc, m_i, l_i, q, k_cache_ptr, v_cache_ptr, table, kv_head, rows, 0, full_end, context,
        scale_log2, stride_cb, stride_cs, stride_ch,
        HEAD_DIM, BLOCK_SIZE, BLOCK_D, BLOCK_N, False, PRECISION,
    )
    kv_end = tl.minimum(seq_len, context + (tile_m + 1) * tokens_m)
    acc, m_i, l_i = attend_paged_tiles(
        acc, m_i, l_i, q, k_cache_ptr, v_cache_ptr, table, kv_head, rows, full_end, kv_end, context,
        scale_log2, stride_cb, stride_cs, stride_ch,
        HEAD_DIM, BLOCK_SIZE, BLOCK_D, BLOCK_N, True, PRECISION,
    )
    out = (acc * v_scale) / l_i[:, None]
    o_off = tokens * stride_ot + head * stride_oh
    tl.store(out_ptr + o_off[:, None] + dims[None, :], out.to(out_ptr.dtype.element_ty), mask=io_mask)


def prefill_tiles(head_dim: int, on_gpu: bool) -> tuple[int, int, int, int]:
    """``(BLOCK_M, BLOCK_N, num_warps, num_stages)`` of ``paged_prefill_attention`` when no tile is given.
    Hopper: 128x64 tiles with 8 warps for ``head_dim <= 64``, 64x64 with 4 warps for larger heads
    (register pressure), 3 stages to overlap the paged loads; the interpreter uses 16x16 (it is slow per
    element). ``bench.kernels.prefill_attention --candidates`` sweeps the alternatives."""
    if not on_gpu:
        return 16, 16, 1, 1
    if head_dim <= 64:
        return 128, 64, 8, 3
    return 64, 64, 4, 3


def prefill_pack_gqa(queries_per_kv: int, on_gpu: bool, block_m: int) -> bool:
    """Whether ``paged_prefill_attention`` packs the query heads of a KV head into one program when not
    told: on a GPU with grouped-query attention whose packed group (``queries_per_kv`` rounded up to a
    power of two) leaves at least 4 tokens in a ``block_m``-row tile. On the H200 (Llama-3-8B heads, 64x64
    tiles, 4 warps, 3 stages) packing read each K/V tile once per group and ran 0.88 of SDPA flash's time
    (geomean over ``bench.kernels.prefill_attention``'s cases) against 0.99 unpacked. The interpreter
    stays unpacked (per-element cost, not loads, bounds it)."""
    return on_gpu and queries_per_kv > 1 and triton.next_power_of_2(queries_per_kv) * 4 <= block_m


def _check_tile(tile: tuple[int, int, int, int], group: int) -> None:
    block_m, block_n, warps, stages = tile
    for name, v in (("BLOCK_M", block_m), ("BLOCK_N", block_n), ("num_warps", warps)):
        if v < 1 or v & (v - 1):
            raise ValueError(f"prefill tile {tile}: {name} must be a power of two >= 1, got {v}")
    if stages < 1:
        raise ValueError(f"prefill tile {tile}: num_stages must be >= 1, got {stages}")
    if block_m < group:
        raise ValueError(f"prefill tile {tile}: with pack_gqa BLOCK_M must hold one token's {group} "
                         f"(padded) query heads")


def paged_prefill_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, max_query_len: int, scale: float,
    seq_offset: int = 0, out: torch.Tensor | None = None, kv_scale: KVScale = UNIT_SCALE, *,
    tile: tuple[int, int, int, int] | None = None, pack_gqa: bool | None = None, longest_first: bool = False,
) -> torch.Tensor:
    """Varlen attention over paged KV for sequences ``seq_offset .. S-1`` of a packed step (Triton).

    Args:
        q: ``[T, H, D]`` packed queries of the whole step (tokens of sequence ``s`` at
            ``query_start_loc[s] .. query_start_loc[s+1]``); innermost dim contiguous.
        k_cache, v_cache: ``[num_blocks, block_size, Hkv, D]`` (same strides) holding every sequence's KV,
            the new tokens included; ``q``'s dtype, or FP8 read with ``kv_scale``.
        block_tables: int32 ``[S, max_blocks]``; seq_lens: int32 ``[S]``; query_start_loc: int32 ``[S+1]``.
        max_query_len: python int >= every query length (sizes the grid; no device read).
        scale: softmax scale. seq_offset: first sequence to compute (``num_decodes`` in the backend).
        out: optional ``[T, H, D]`` output; only the rows of the computed sequences are written.
        kv_scale: the layer's K and V scales (an FP8 cache's values are ``stored * scale``).
        tile: ``(BLOCK_M, BLOCK_N, num_warps, num_stages)``; None: ``prefill_tiles``. ``BLOCK_M`` counts
            rows of the program's query tile (tokens x packed heads with ``pack_gqa``), ``BLOCK_N`` KV
            positions per step (several pages when larger than the cache's block_size).
        pack_gqa: one program per (query tile, sequence, KV head) holding all ``H / Hkv`` query heads of
            that KV head (padded to a power of two) as rows, so they share every K/V load; default one
            program per query head. Each row's softmax walks the same KV tiles (from position 0 in steps
            of ``BLOCK_N``) in the same order either way. None: packed on a GPU when several query heads
            share a KV head (``prefill_pack_gqa``), else not.
        longest_first: launch the query tiles in reverse order (the last tiles, which see the most KV,
            first).

    Returns:
        ``out`` (``[T, H, D]``, ``q``'s dtype).

    Raises:
        ValueError: a scale that is not a finite float > 0; a ``tile`` whose block sizes or warps are not
            powers of two, whose stages are < 1, or whose ``BLOCK_M`` is smaller than the packed group.
    """
    _check_scale(kv_scale)
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    queries_per_kv = num_heads // num_kv_heads
    block_m, block_n, warps, stages = tile or prefill_tiles(head_dim, q.is_cuda)
    if pack_gqa is None:
        pack_gqa = prefill_pack_gqa(queries_per_kv, q.is_cuda, block_m)
    group = triton.next_power_of_2(queries_per_kv) if pack_gqa else 1
    if tile is not None:
        _check_tile(tile, group)
    if block_m < group:
        raise ValueError(f"pack_gqa needs BLOCK_M >= {group} (the packed query heads), got {block_m}")
    if out is None:
        out = torch.empty_like(q)
    num_seqs = seq_lens.shape[0] - seq_offset
    if num_seqs <= 0 or max_query_len <= 0:
        return out
    grid = (triton.cdiv(max_query_len, block_m // group), num_seqs, num_kv_heads if pack_gqa else num_heads)
    _prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out,
        scale * LOG2E * kv_scale.k, float(kv_scale.v), seq_offset,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        QUERIES_PER_KV=queries_per_kv, HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1],
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", GROUP=group, LONGEST_FIRST=longest_first,
        num_warps=warps, num_stages=stages, **pdl_kwargs(q),
    )
    return out


def paged_prefill_attention_reference(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, max_query_len: int, max_seq_len: int,
    scale: float, kv_scale: KVScale = UNIT_SCALE,
) -> torch.Tensor:
    """Plain-torch varlen paged attention: pad the queries to ``[S, max_query_len]``, gather the KV to
    ``[S, max_seq_len]`` (an FP8 cache dequantised with ``kv_scale``: ``dequantize_kv_reference``), mask
    (bottom-right causal, ``< seq_len``), SDPA in float32 with GQA, unpad.

    Args: as ``paged_prefill_attention`` with ``seq_offset=0``: ``q [T, H, D]`` where
    ``T == query_start_loc[-1]`` and ``query_start_loc[0] == 0``; ``max_seq_len`` >= every ``seq_lens``.
    Returns ``[T, H, D]`` in ``q``'s dtype. No host synchronisation.
    """
    num_tokens, num_heads, head_dim = q.shape
    device = q.device
    token_ids = torch.arange(num_tokens, device=device, dtype=torch.int32)
    seq_of_token = torch.searchsorted(query_start_loc[1:].contiguous(), token_ids, right=True)
    row_of_token = token_ids - query_start_loc[seq_of_token]
    num_seqs = seq_lens.shape[0]
    padded = torch.zeros((num_seqs, max_query_len, num_heads, head_dim), dtype=torch.float32, device=device)
    padded[seq_of_token, row_of_token] = q.float()
    k = dequantize_kv_reference(gather_paged_kv(k_cache, block_tables, max_seq_len), kv_scale.k)
    v = dequantize_kv_reference(gather_paged_kv(v_cache, block_tables, max_seq_len), kv_scale.v)
    k, v = k.transpose(1, 2), v.transpose(1, 2)
    query_lens = query_start_loc[1:] - query_start_loc[:-1]
    context = (seq_lens - query_lens)[:, None, None]
    rows = torch.arange(max_query_len, device=device)[None, :, None]
    cols = torch.arange(max_seq_len, device=device)[None, None, :]
    mask = (cols <= context + rows) & (cols < seq_lens[:, None, None])  # [S, Mq, L]
    out = torch.nn.functional.scaled_dot_product_attention(
        padded.transpose(1, 2), k, v, attn_mask=mask[:, None], scale=scale, enable_gqa=True
    )  # [S, H, Mq, D]
    return out.transpose(1, 2)[seq_of_token, row_of_token].to(q.dtype)
