"""Paged decode attention: one query token per sequence over its paged KV (Triton kernel + reference).

Split-K ("Flash-Decoding", Dao, Haziza, Massa, Sizov, 2023, https://crfm.stanford.edu/2023/10/12/
flashdecoding.html): each sequence's KV is cut into ``num_splits`` ranges; step 1 runs one program per
(sequence, KV head, split) and writes an unnormalised partial output plus its running max and sum; step 2
merges the splits with the log-sum-exp rescaling. Paged KV gathers follow vLLM PagedAttention (Kwon et al.,
SOSP'23). GQA: a program handles all ``H // Hkv`` query heads of its KV head as the rows of one ``tl.dot``
(padded to 16 rows), so each KV block is read once per split, not once per query head. An FP8 cache
(engine/ops/store_kv.py) is dequantised on load: raw values into the dots, the K scale folded into the
softmax scale, each split's partial output multiplied by the V scale.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from engine.ops.decode_rope import RopeStore, _rope_args, _rope_q_store_kv, rope_fusable
from engine.ops.paged_tiles import attend_paged_tiles
from engine.ops.pdl import GEMV_KERNELS, gdc_enter, pdl_kwargs
from engine.ops.store_kv import UNIT_SCALE, KVScale, dequantize_kv_reference, inverse_scales, is_fp8

LOG2E = 1.4426950408889634
_NEG_BIG = -1.0e30  # finite "minus infinity" for running maxima: no inf - inf = NaN


# num_splits is a run-time argument, never specialised: as a compile-time constant, an eager step (a mixed
# prefill + decode step) with a split count not seen before would compile two new kernels on the serving
# path (~2 s stalls on a fresh colocated worker of an H200). So the reduce kernel compiles once per
# power-of-two BLOCK_S (7 shapes up to 64 splits), met when the decode CUDA graphs are captured at
# start-up, and the split kernel once per variant: ROPE=True (decode-only steps, engine/ops/decode_rope.py)
# at that capture, ROPE=False (a mixed step's decode rows) in the
# start-up warm-up's mixed wave (engine/warmup.py); with warm-up off, at the first mixed step.
@triton.jit(do_not_specialize=["num_splits"])
def _decode_split_kernel(  # type: ignore[no-untyped-def]  # Triton kernel: arguments are typed by @triton.jit
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
    part_acc_ptr, part_m_ptr, part_l_ptr,
    scale_log2, v_scale, inv_k_scale, inv_v_scale, num_splits,
    stride_qt, stride_qh, stride_cb, stride_cs, stride_ch, stride_bt,
    k_new_ptr, v_new_ptr, cos_ptr, sin_ptr, slot_ptr, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_ct, stride_st,
    NUM_HEADS: tl.constexpr, QUERIES_PER_KV: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, ROPE: tl.constexpr, KV_FP8: tl.constexpr,
    USE_GDC: tl.constexpr,
):
    gdc_enter(USE_GDC)
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    # each sequence spreads its own length over the num_splits splits (whole tiles), read from device
    # memory: the grid never depends on a step's lengths, so one CUDA graph serves every step
    split_len = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)
    rows = tl.arange(0, BLOCK_G)
    dims = tl.arange(0, BLOCK_D)
    heads = kv_head * QUERIES_PER_KV + rows
    row_mask = rows < QUERIES_PER_KV
    dim_mask = dims < HEAD_DIM
    if ROPE:  # rotate q here; the split holding the new position stores its K/V first
        q = _rope_q_store_kv(
            q_ptr + seq * stride_qt, k_new_ptr + seq * stride_kt + kv_head * stride_kh,
            v_new_ptr + seq * stride_vt + kv_head * stride_vh, cos_ptr, sin_ptr, slot_ptr, k_cache_ptr,
            v_cache_ptr, seq, kv_head, rows, row_mask, stride_qh, stride_ct, stride_st, stride_cb, stride_cs,
            stride_ch, (start <= seq_len - 1) & (seq_len - 1 < end), inv_k_scale, inv_v_scale,
            HEAD_DIM // 2, BLOCK_SIZE, BLOCK_G, BLOCK_D, QUERIES_PER_KV, KV_FP8,
        )
    else:
        q = tl.load(q_ptr + seq * stride_qt + heads[:, None] * stride_qh + dims[None, :],
                    mask=row_mask[:, None] & dim_mask[None, :], other=0.0)
    m_i = tl.full([BLOCK_G], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    # context = end: every row sees the whole split (positions >= end are masked)
    acc, m_i, l_i = attend_paged_tiles(
        acc, m_i, l_i, q, k_cache_ptr, v_cache_ptr, table, kv_head, rows, start, end, end,
        scale_log2, stride_cb, stride_cs, stride_ch,
        HEAD_DIM, BLOCK_SIZE, BLOCK_D, BLOCK_N, True, PRECISION,
    )
    part = (seq * NUM_HEADS + heads) * num_splits + split
    tl.store(part_m_ptr + part, m_i, mask=row_mask)
    tl.store(part_l_ptr + part, l_i, mask=row_mask)
    tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + dims[None, :], acc * v_scale,
             mask=row_mask[:, None] & dim_mask[None, :])


@triton.jit(do_not_specialize=["num_splits"])
def _decode_reduce_kernel(  # type: ignore[no-untyped-def]  # Triton kernel: arguments are typed by @triton.jit
    part_acc_ptr, part_m_ptr, part_l_ptr, out_ptr, stride_ot, stride_oh, num_splits,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
    USE_GDC: tl.constexpr,
):
    gdc_enter(USE_GDC)
    seq = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, BLOCK_S)
    dims = tl.arange(0, BLOCK_D)
    split_mask = splits < num_splits
    part = (seq * NUM_HEADS + head) * num_splits + splits
    m = tl.load(part_m_ptr + part, mask=split_mask, other=-1.0e30)
    l_s = tl.load(part_l_ptr + part, mask=split_mask, other=0.0)
    weight = tl.exp2(m - tl.max(m, 0))
    acc = tl.load(part_acc_ptr + part[:, None] * HEAD_DIM + dims[None, :],
                  mask=split_mask[:, None] & (dims[None, :] < HEAD_DIM), other=0.0)
    out = tl.sum(acc * weight[:, None], 0) / tl.sum(l_s * weight, 0)
    tl.store(out_ptr + seq * stride_ot + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty),
             mask=dims < HEAD_DIM)


@functools.cache
def _num_sms(device_index: int) -> int:
    return int(torch.cuda.get_device_properties(device_index).multi_processor_count)


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, block_n: int, num_sms: int) -> int:
    """Heuristic split count: enough (sequence, KV head, split) programs for two waves over ``num_sms``
    SMs (four for a single sequence, whose attention is bound by latency:
    ``bench.kernels.decode_attention``), but at least 4 tiles of ``block_n`` tokens per split (less work
    per split would not pay for the reduce) and at most 64 splits. Returns >= 1."""
    tiles = triton.cdiv(max_seq_len, block_n)
    waves = 4 if num_seqs == 1 else 2
    wanted = triton.cdiv(waves * num_sms, max(1, num_seqs * num_kv_heads))
    return max(1, min(wanted, triton.cdiv(tiles, 4), 64))


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def paged_decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, max_seq_len: int, scale: float, out: torch.Tensor | None = None,
    num_splits: int | None = None, block_n: int | None = None, num_warps: int = 4,
    rope: RopeStore | None = None, kv_scale: KVScale = UNIT_SCALE,
) -> torch.Tensor:
    """Decode attention for ``N`` sequences with one query token each (Triton, two launches).

    Args:
        q: ``[N, H, D]``; token ``i`` belongs to sequence ``i``; innermost dim contiguous.
        k_cache, v_cache: ``[num_blocks, block_size, Hkv, D]`` (same strides), ``q``'s dtype or FP8
            (read, and with ``rope`` written, with ``kv_scale``: engine/ops/store_kv.py).
        block_tables: int32 ``[>= N, max_blocks]``; seq_lens: int32 ``[>= N]`` (tokens incl. the query).
        max_seq_len: python int >= every ``seq_lens[i]``; only feeds the ``num_splits`` heuristic (no
            device read). The kernel reads each ``seq_lens[i]`` from device memory and cuts that length
            into ``num_splits`` ranges, so the launch grid ``(N, Hkv, num_splits)`` does not depend on the
            step's lengths: with a fixed ``num_splits`` the two launches can be captured in a CUDA graph
            once and replayed for any lengths (splits past a short sequence's end do no work).
        scale: softmax scale. out: optional ``[N, H, D]`` output. num_splits: override the heuristic.
        block_n, num_warps: KV tokens per tile (a power of two >= 16; default on a GPU 32 for one sequence,
            else 64; 16 under the interpreter) and warps of the split kernel
            (``bench.kernels.decode_attention``).
        rope: the step's RoPE and K/V store done by the split kernel itself (``RopeStore``; ``q`` is then
            before RoPE and is not written): the rotary + store launch of each layer disappears; results
            equal ``rotary_store_kv`` followed by this function (cache bit for bit; output bit for bit
            in fp32, within one ulp in compiled bf16/fp16: decode_rope.py). Needs ``D`` a power of two
            (``rope_fusable``).
        kv_scale: the layer's K and V scales (an FP8 cache's values are ``stored * scale``).

    Returns:
        ``[N, H, D]`` in ``q``'s dtype.

    Raises:
        ValueError: ``num_splits < 1``, ``rope`` tensors that do not fit (``rope_fusable``), a scale that
            is not a finite float > 0.

    Tuning (Hopper): tiles of 64 KV tokens (32 for one sequence), 4 warps, 2 stages for step 1; splits
    from ``choose_num_splits`` (132 SMs on H200). Under the interpreter: 16-token tiles.
    """
    n = q.shape[0]
    num_kv_heads = k_cache.shape[2]
    if out is None:
        out = torch.empty_like(q)
    if n == 0:
        return out
    on_gpu = q.is_cuda
    # one sequence: 32-token tiles over up to 64 splits (H200, Llama-3-8B shapes, 32 layers in a graph:
    # 6.2 vs 6.9 µs per layer at 1k tokens, 10.6 vs 11.1 at 4k; docs/benchmarks/engine.md)
    block_n = block_n or ((32 if n == 1 else 64) if on_gpu else 16)
    if num_splits is None:
        sms = _num_sms(q.device.index or 0) if on_gpu else 8
        num_splits = choose_num_splits(n, num_kv_heads, max_seq_len, block_n, sms)
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    if rope is not None and not rope_fusable(q, k_cache, v_cache, rope):
        raise ValueError("rope: k, v [N, Hkv, D] and cos, sin [N, D] with contiguous last dims, slot_mapping "
                         "[>= N], D a power of two >= 16 and k_cache, v_cache of one stride are needed")
    _launch(q, k_cache, v_cache, block_tables, seq_lens, scale, out, num_splits, block_n, num_warps, rope,
            kv_scale)
    return out


def _launch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
            seq_lens: torch.Tensor, scale: float, out: torch.Tensor, num_splits: int, block_n: int,
            num_warps: int = 4, rope: RopeStore | None = None, kv_scale: KVScale = UNIT_SCALE) -> None:
    """The two launches of ``paged_decode_attention`` (split, then reduce) over float32 partials."""
    inv_k, inv_v = inverse_scales(kv_scale)
    n, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    part_acc = torch.empty((n, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
    part_m = torch.empty((n, num_heads, num_splits), dtype=torch.float32, device=q.device)
    part_l = torch.empty_like(part_m)
    qpk = num_heads // num_kv_heads
    block_d = max(16, triton.next_power_of_2(head_dim))
    _decode_split_kernel[(n, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, part_acc, part_m, part_l,
        scale * LOG2E * kv_scale.k, float(kv_scale.v), inv_k, inv_v, num_splits,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0),
        *(_rope_args(rope) if rope is not None else (q, q, q, q, q, 0, 0, 0, 0, 0, 0)),
        NUM_HEADS=num_heads, QUERIES_PER_KV=qpk, HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1],
        BLOCK_G=max(16, triton.next_power_of_2(qpk)), BLOCK_D=block_d,
        BLOCK_N=block_n, PRECISION=_precision(q.dtype), ROPE=rope is not None, KV_FP8=is_fp8(k_cache),
        num_warps=num_warps,
        num_stages=2,
        **pdl_kwargs(q, "decode_split", late_after=GEMV_KERNELS),
    )
    _decode_reduce_kernel[(n, num_heads)](
        part_acc, part_m, part_l, out, out.stride(0), out.stride(1), num_splits,
        NUM_HEADS=num_heads, HEAD_DIM=head_dim,
        BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_D=block_d, num_warps=4,
        **pdl_kwargs(out),
    )


def gather_paged_kv(cache: torch.Tensor, block_tables: torch.Tensor, max_len: int) -> torch.Tensor:
    """Gather each sequence's first ``max_len`` KV positions: ``[S, max_len, Hkv, D]`` from ``cache``
    ``[num_blocks, block_size, Hkv, D]`` and int32 ``block_tables [S, max_blocks]`` (no host sync)."""
    block_size = cache.shape[1]
    num_blocks = math.ceil(max_len / block_size)
    gathered = cache[block_tables[:, :num_blocks].long()]  # [S, nb, bs, Hkv, D]
    return gathered.flatten(1, 2)[:, :max_len]


def paged_decode_attention_reference(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, max_seq_len: int, scale: float, kv_scale: KVScale = UNIT_SCALE,
) -> torch.Tensor:
    """Plain-torch ``paged_decode_attention`` (same arguments): gather (an FP8 cache dequantised with
    ``kv_scale``: ``dequantize_kv_reference``), mask positions ``>= seq_len``, SDPA in float32 with GQA.
    Returns ``[N, H, D]`` in ``q``'s dtype."""
    n = q.shape[0]
    k = dequantize_kv_reference(gather_paged_kv(k_cache, block_tables[:n], max_seq_len), kv_scale.k)
    v = dequantize_kv_reference(gather_paged_kv(v_cache, block_tables[:n], max_seq_len), kv_scale.v)
    k, v = k.transpose(1, 2), v.transpose(1, 2)
    positions = torch.arange(max_seq_len, device=q.device)
    mask = positions[None, :] < seq_lens[:n, None]  # [N, L]
    out = torch.nn.functional.scaled_dot_product_attention(
        q.float()[:, :, None, :], k, v, attn_mask=mask[:, None, None, :], scale=scale, enable_gqa=True
    )
    return out[:, :, 0, :].to(q.dtype)
