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
into the softmax scale, the output multiplied by the V scale. When a launch has too few programs to fill
the GPU (one long sequence, a few hundred new tokens), each query tile's KV is cut into slices walked by
programs of their own, whose float32 partials a second kernel combines by their log-sum-exps in a fixed
order (Flash-Decoding's split-KV, Dao et al., 2023; ``prefill_kv_splits``).
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from engine.ops.paged_decode import LOG2E, gather_paged_kv
from engine.ops.paged_tiles import attend_paged_tiles
from engine.ops.pdl import gdc_enter, pdl_kwargs
from engine.ops.store_kv import UNIT_SCALE, KVScale, _check_scale, dequantize_kv_reference


# seq_offset (the step's number of decode rows), num_tokens and num_splits are not specialised: Triton would
# otherwise compile separate variants for 1, multiples of 16 and other values, met first on the serving path.
@triton.jit(do_not_specialize=["seq_offset", "num_tokens", "num_splits"])
def _prefill_kernel(  # type: ignore[no-untyped-def]  # Triton kernel: arguments are typed by @triton.jit
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr, out_ptr,
    part_ptr, lse_ptr, scale_log2, v_scale, seq_offset, num_tokens, num_splits,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_cs, stride_ch, stride_bt,
    NUM_HEADS: tl.constexpr, QUERIES_PER_KV: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
    USE_GDC: tl.constexpr, GROUP: tl.constexpr, LONGEST_FIRST: tl.constexpr, SPLIT: tl.constexpr,
):
    gdc_enter(USE_GDC)
    pid_m = tl.program_id(0)
    if SPLIT:  # axis 0 holds (query tile, KV split) pairs
        split = pid_m % num_splits
        pid_m = pid_m // num_splits
    # longest first: the last query tiles see the most KV, so they start first
    tile_m = tl.num_programs(0) // num_splits - 1 - pid_m if LONGEST_FIRST else pid_m
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
    kv_end = tl.minimum(seq_len, context + (tile_m + 1) * tokens_m)
    if SPLIT:  # this program's slice of the tile's KV, whole BLOCK_N tiles
        chunk = tl.cdiv(tl.cdiv(kv_end, num_splits), BLOCK_N) * BLOCK_N
        lo = split * chunk
        hi = tl.minimum(kv_end, lo + chunk)
    else:
        lo = 0
        hi = kv_end
    acc, m_i, l_i = attend_paged_tiles(
        acc, m_i, l_i, q, k_cache_ptr, v_cache_ptr, table, kv_head, rows, lo, tl.minimum(full_end, hi),
        context, scale_log2, stride_cb, stride_cs, stride_ch,
        HEAD_DIM, BLOCK_SIZE, BLOCK_D, BLOCK_N, False, PRECISION,
    )
    acc, m_i, l_i = attend_paged_tiles(
        acc, m_i, l_i, q, k_cache_ptr, v_cache_ptr, table, kv_head, rows, tl.maximum(lo, full_end), hi,
        context, scale_log2, stride_cb, stride_cs, stride_ch,
        HEAD_DIM, BLOCK_SIZE, BLOCK_D, BLOCK_N, True, PRECISION,
    )
    if SPLIT:
        # float32 partials: the slice's normalised output and its log2-sum-exp; a row that sees nothing
        # of this slice writes 0 and -inf (weight 0 in _prefill_combine_kernel)
        seen = l_i > 0.0
        part = tl.where(seen[:, None], acc / tl.where(seen, l_i, 1.0)[:, None], 0.0)
        lse = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
        row_id = (split * num_tokens + tokens) * NUM_HEADS + head  # [BLOCK_M] rows of [splits, T, H]
        tl.store(lse_ptr + row_id, lse, mask=row_ok)
        tl.store(part_ptr + row_id[:, None] * HEAD_DIM + dims[None, :], part, mask=io_mask)
    else:
        out = (acc * v_scale) / l_i[:, None]
        o_off = tokens * stride_ot + head * stride_oh
        tl.store(out_ptr + o_off[:, None] + dims[None, :], out.to(out_ptr.dtype.element_ty), mask=io_mask)


@triton.jit(do_not_specialize=["seq_offset", "num_seqs", "num_tokens", "num_splits"])
def _prefill_combine_kernel(  # type: ignore[no-untyped-def]  # Triton kernel: arguments are typed by @triton.jit
    part_ptr, lse_ptr, out_ptr, query_start_loc_ptr, v_scale, seq_offset, num_seqs, num_tokens, num_splits,
    stride_ot, stride_oh,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    USE_GDC: tl.constexpr,
):
    gdc_enter(USE_GDC)
    token = tl.program_id(0)
    # a decode row (before the first computed sequence) or padding after the last: not this kernel's
    first, end = tl.load(query_start_loc_ptr + seq_offset), tl.load(query_start_loc_ptr + num_seqs)
    if (token < first) | (token >= end):
        return
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    head_ok = heads < NUM_HEADS
    io_mask = head_ok[:, None] & (dims < HEAD_DIM)[None, :]
    top = tl.full([BLOCK_H], float("-inf"), tl.float32)
    for split in range(num_splits):
        lse = tl.load(lse_ptr + (split * num_tokens + token) * NUM_HEADS + heads, mask=head_ok,
                      other=float("-inf"))
        top = tl.maximum(top, lse)
    top = tl.where(head_ok, top, 0.0)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    weights = tl.zeros([BLOCK_H], tl.float32)
    for split in range(num_splits):  # fixed order: deterministic
        row_id = (split * num_tokens + token) * NUM_HEADS + heads
        w = tl.exp2(tl.load(lse_ptr + row_id, mask=head_ok, other=float("-inf")) - top)
        part = tl.load(part_ptr + row_id[:, None] * HEAD_DIM + dims[None, :], mask=io_mask, other=0.0)
        acc += w[:, None] * part
        weights += w
    out = (acc * v_scale) / tl.where(head_ok, weights, 1.0)[:, None]
    o_off = token.to(tl.int64) * stride_ot + heads * stride_oh
    tl.store(out_ptr + o_off[:, None] + dims[None, :], out.to(out_ptr.dtype.element_ty), mask=io_mask)


LONG_KV_TOKENS = 2048  # a step whose longest sequence reaches this many tokens takes the long-KV tile


def prefill_tiles(head_dim: int, on_gpu: bool, queries_per_kv: int = 1,
                  long_kv: bool = False) -> tuple[int, int, int, int]:
    """``(BLOCK_M, BLOCK_N, num_warps, num_stages)`` of ``paged_prefill_attention`` when no tile is given.
    Hopper: 128x64 tiles with 8 warps for ``head_dim <= 64``, 64x64 with 4 warps and 3 stages for larger
    heads (register pressure), the stages overlapping the paged loads; with grouped-query attention and
    a long KV (``long_kv``: a sequence of ``LONG_KV_TOKENS`` or more) 256x64 with 8 warps and 2 stages
    (packed: 64 tokens of 4 query heads share each K/V tile), which a short KV leaves with too few
    programs. The interpreter uses 16x16 (it is slow per element). The H200 sweeps that chose them
    (``bench.kernels.prefill_attention --candidates``, Llama-3-8B heads, 2026-12-04): the 256-row tile
    against the 64-row one, both packed, 1.05-1.36x the TFLOP/s with 4k-15k cached tokens or an 8k
    prompt, but 0.84-0.95x for 770-token prompts."""
    if not on_gpu:
        return 16, 16, 1, 1
    if head_dim <= 64:
        return 128, 64, 8, 3
    if long_kv and queries_per_kv > 1 and prefill_pack_gqa(queries_per_kv, on_gpu, 256):
        return 256, 64, 8, 2
    return 64, 64, 4, 3


def prefill_pack_gqa(queries_per_kv: int, on_gpu: bool, block_m: int) -> bool:
    """Whether ``paged_prefill_attention`` packs the query heads of a KV head into one program when not
    told: on a GPU with grouped-query attention whose packed group (``queries_per_kv`` rounded up to a
    power of two) leaves at least 4 tokens in a ``block_m``-row tile. On the H200 (Llama-3-8B heads, 64x64
    tiles, 4 warps, 3 stages) packing read each K/V tile once per group and ran 0.88 of SDPA flash's time
    (geomean over ``bench.kernels.prefill_attention``'s cases) against 0.99 unpacked. The interpreter
    stays unpacked (per-element cost, not loads, bounds it)."""
    return on_gpu and queries_per_kv > 1 and triton.next_power_of_2(queries_per_kv) * 4 <= block_m


_SHARED_MEMORY_PER_SM = 228 * 1024  # bytes, Hopper
_WARPS_PER_SM = 64
_MIN_SPLIT_TOKENS = 1024  # KV positions a split walks at least (16 tiles of 64)
_MAX_SPLITS = 8
_MIN_SPLIT_GAIN = 0.95  # split only where the wave model promises at least 5 % less time


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def programs_per_sm(tile: tuple[int, int, int, int], head_dim: int, itemsize: int) -> int:
    """Programs of ``tile`` resident on one Hopper SM, estimated from shared memory (the query tile plus
    ``num_stages`` K and V tiles) and warps: 2 for 64x64 / 4 warps / 3 stages at head_dim 128 in bf16
    (112 KB each), 1 for 256x64 / 8 warps / 2 stages (128 KB). At least 1."""
    block_m, block_n, warps, stages = tile
    shared = (block_m + 2 * stages * block_n) * head_dim * itemsize
    return max(1, min(_SHARED_MEMORY_PER_SM // shared, _WARPS_PER_SM // warps))


def prefill_kv_splits(programs: int, max_seq_len: int, num_sms: int, programs_per_sm: int = 2) -> int:
    """How many slices ``paged_prefill_attention`` cuts each query tile's KV into, from the launch's
    ``programs`` (query tiles x sequences x heads) and the longest sequence: the count ``s`` in
    ``1.._MAX_SPLITS`` that minimises the launch's time in waves of ``num_sms * programs_per_sm``
    resident programs, ``ceil(programs * s / slots) / s`` (each program walks ``1 / s`` of the KV), taken
    only when it is under ``_MIN_SPLIT_GAIN`` of the unsplit launch's (the partials cost a second pass)
    and every slice keeps ``_MIN_SPLIT_TOKENS`` positions. One long sequence with a few hundred new tokens
    is the case: the packed 256-row tile over 15k cached tokens and 770 new ones is 104 programs, one per
    SM, leaving 28 of an H200's 132 idle; five slices make four full waves of a fifth of the work. The H200
    sweep (2026-12-04, Llama-3-8B heads): 345 TFLOP/s with five slices against 273 unsplit there, and 371
    against 325 with three slices for eight such sequences (the model promises 0.8 and 0.9 of the time;
    the causal tiles' unequal lengths even out as well). Split-KV over the sequence as in Flash-Decoding
    (Dao et al., 2023), applied to prefill tiles."""
    slots = max(1, num_sms * programs_per_sm)

    def waves(s: int) -> float:
        return math.ceil(programs * s / slots) / s

    most = max(1, min(_MAX_SPLITS, max_seq_len // _MIN_SPLIT_TOKENS))
    best = min(range(1, most + 1), key=lambda s: (waves(s), s))
    return best if waves(best) < _MIN_SPLIT_GAIN * waves(1) else 1


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
    tile: tuple[int, int, int, int] | None = None, pack_gqa: bool | None = None,
    longest_first: bool | None = None,
    max_seq_len: int | None = None, num_splits: int | None = None,
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
            first). None: with the long-KV default tile (``prefill_tiles``), else not (H200, that tile:
            1.04-1.05x the TFLOP/s with 8k-15k tokens of KV, 0.97x with 4k).
        max_seq_len: python int >= every ``seq_lens`` entry, for choosing the default tile and
            ``num_splits``; None: the short-KV tile, no split.
        num_splits: cut each query tile's KV into this many slices of whole ``BLOCK_N`` tiles, one program
            each, writing float32 partial outputs and log-sum-exps that a second kernel adds in split order
            (deterministic; the bits differ from the unsplit kernel's). None: ``prefill_kv_splits`` on a
            GPU when ``max_seq_len`` is given, else 1.

    Returns:
        ``out`` (``[T, H, D]``, ``q``'s dtype).

    Raises:
        ValueError: a scale that is not a finite float > 0; a ``tile`` whose block sizes or warps are not
            powers of two, whose stages are < 1, or whose ``BLOCK_M`` is smaller than the packed group;
            ``num_splits < 1``.
    """
    _check_scale(kv_scale)
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    queries_per_kv = num_heads // num_kv_heads
    # the packed default tile only where packing may apply (an explicit pack_gqa=False gets the plain one)
    long_kv = max_seq_len is not None and max_seq_len >= LONG_KV_TOKENS
    chosen = tile or prefill_tiles(head_dim, q.is_cuda, 1 if pack_gqa is False else queries_per_kv, long_kv)
    if longest_first is None:
        longest_first = tile is None and chosen[0] == 256
    block_m, block_n, warps, stages = chosen
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
    m_tiles = triton.cdiv(max_query_len, block_m // group)
    heads_axis = num_kv_heads if pack_gqa else num_heads
    if num_splits is None:
        num_splits = 1
        if q.is_cuda and max_seq_len is not None:
            programs = m_tiles * num_seqs * heads_axis
            num_splits = prefill_kv_splits(programs, max_seq_len, _num_sms(q.device.index or 0),
                                           programs_per_sm(chosen, head_dim, q.element_size()))
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    num_tokens = q.shape[0]
    block_d = max(16, triton.next_power_of_2(head_dim))
    if num_splits > 1:
        lse = torch.empty((num_splits, num_tokens, num_heads), dtype=torch.float32, device=q.device)
        part = lse.new_empty((num_splits, num_tokens, num_heads, head_dim))
    else:
        part = lse = out  # not read
    _prefill_kernel[(m_tiles * num_splits, num_seqs, heads_axis)](
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out, part, lse,
        scale * LOG2E * kv_scale.k, float(kv_scale.v), seq_offset, num_tokens, num_splits,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        NUM_HEADS=num_heads, QUERIES_PER_KV=queries_per_kv, HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1],
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", GROUP=group, LONGEST_FIRST=longest_first,
        SPLIT=num_splits > 1, num_warps=warps, num_stages=stages, **pdl_kwargs(q),
    )
    if num_splits > 1:
        _prefill_combine_kernel[(num_tokens,)](
            part, lse, out, query_start_loc, float(kv_scale.v), seq_offset, seq_lens.shape[0], num_tokens,
            num_splits, out.stride(0), out.stride(1), NUM_HEADS=num_heads, HEAD_DIM=head_dim,
            BLOCK_H=triton.next_power_of_2(num_heads), BLOCK_D=block_d, num_warps=4, **pdl_kwargs(q),
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
