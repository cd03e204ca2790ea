"""Mixture-of-experts feed-forward: tokens through their routed experts' SwiGLU MLPs (Triton + reference).

Each token ``t`` was routed to ``k`` experts ``topk_ids[t]`` with weights ``topk_weights[t]``; the output is
``sum_j topk_weights[t, j] * down[e_j] @ (silu(gate[e_j] @ x_t) * (up[e_j] @ x_t))``, with each expert's
gate and up projections stored as one ``[2 I, H]`` matrix (transformers' ``*Experts.gate_up_proj``,
``[E, 2 I, H]``; ``down_proj`` ``[E, H, I]``).

The fused path (method as the "fused MoE" kernels of vLLM and SGLang, and MegaBlocks' block-sparse
grouping, Gale et al. 2022):

1. ``moe_align`` (``engine.ops.moe_align``) sorts the ``T * k`` (token, slot) pairs by expert and pads
   each expert's run to a multiple of ``block_m`` rows, on the device with a fixed-size output (no host
   sync, so a decode step stays capturable in a CUDA graph): ``sorted_ids`` holds flat pair indices
   ``t * k + j`` (padding: ``T * k``) and ``block_expert`` the expert of each ``block_m``-row block
   (``E`` for blocks past the end: their programs exit at once).
2. ``_gate_up_kernel``: a grouped GEMM, one program per (block, ``block_n`` columns of ``I``): the block's
   rows of ``x`` (gathered by token) times its expert's gate and up columns, two float32 accumulators,
   and SwiGLU in the epilogue (each projection rounded to the dtype, SiLU in float32 rounded to the
   dtype, then the product, as ``engine.ops.silu_mul`` rounds it) into ``act [T * k, I]``.
3. ``_down_kernel``: the second grouped GEMM, ``act`` rows times the expert's down projection, rounded to
   the dtype, times the pair's routing weight, into float32 ``[T * k, H]``; the ``k`` rows of each token
   are summed in float32 and rounded to the dtype once (a fixed order: deterministic, no atomics).

Empty experts own no block; an expert's last block is partly padding (masked rows read nothing and
write nothing).

Few pairs (decode at small batch, ``moe_path``): the grouped GEMM's blocks are mostly padding and a
step's cost is the alignment's dozen small launches plus too few programs streaming each expert's
weights. The matrix-vector path skips the alignment: ``_gate_up_gemv_kernel`` runs one program per
(pair, ``block_n`` columns of ``I``) and ``_down_gemv_kernel`` one per (token, ``block_n`` columns of
``H``) that walks the token's ``k`` experts in slot order, ``SLOTS`` of them read at once
(``gemv_moe_slots``: a program's loads for those experts in flight together), each a row-blocked GEMV as
``engine.ops.gemv`` (float32 products summed along the row, the same roundings as the grouped
kernels), the weighted sum kept in float32 and rounded once. A weight is read once per pair that
routes to it, so the path pays off only while pairs rarely share an expert.

Both paths also take FP8 (e4m3) expert weights with their scales (``scales``; layouts, and where the
kernels apply them: ``engine.ops.fused_moe_fp8``): weight-only, the activations stay in their dtype; a
weight tile takes one block scale per output row (``moe_tile`` and ``gemv_scale_tile`` align the tiles
to the scale blocks), never one per weight.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.ops.fused_moe_fp8 import ExpertScales, check_scale, dequantize_experts, kernel_scale_args
from engine.ops.moe_align import moe_align
from engine.ops.pdl import gdc_enter, pdl_kwargs


@triton.jit
def _gate_up_kernel(  # type: ignore[no-untyped-def]  # Triton kernel: arguments are typed by @triton.jit
    x_ptr, w_ptr, sorted_ids_ptr, block_expert_ptr, act_ptr, s_ptr,
    num_pairs, top_k, num_experts, hidden, inter,
    stride_xt, stride_we, stride_wn, stride_at, stride_se, stride_sn, stride_sk, scale_rows, scale_cols,
    PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_GDC: tl.constexpr, SCALE: tl.constexpr,
):
    gdc_enter(USE_GDC)  # the alignment and the activations come from the kernels just before
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert >= num_experts:
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    ids = tl.load(sorted_ids_ptr + rows)
    row_mask = ids < num_pairs
    tokens = (ids // top_k).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < inter
    ks = tl.arange(0, BLOCK_K)
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    gate_ptrs = w_base + cols.to(tl.int64)[None, :] * stride_wn + ks[:, None]  # [BLOCK_K, BLOCK_N]
    up_ptrs = gate_ptrs + inter * stride_wn
    x_ptrs = x_ptr + tokens[:, None] * stride_xt + ks[None, :]
    s_base = s_ptr + expert.to(tl.int64) * stride_se
    gate_srows = s_base + (cols // scale_rows).to(tl.int64)[None, :] * stride_sn  # [1, BLOCK_N]
    up_srows = s_base + ((inter + cols) // scale_rows).to(tl.int64)[None, :] * stride_sn
    dt = act_ptr.dtype.element_ty
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, hidden, BLOCK_K):
        k_mask = (k + ks) < hidden
        a = tl.load(x_ptrs + k, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w_mask = k_mask[:, None] & col_mask[None, :]
        wg = tl.load(gate_ptrs + k, mask=w_mask, other=0.0)
        wu = tl.load(up_ptrs + k, mask=w_mask, other=0.0)
        if SCALE == 2:  # FP8 weights, block scales: dequantized to the activations' dtype before the dot
            # BLOCK_K divides the block width: the tile's inputs share one column of scale tiles
            s_col = (k // scale_cols) * stride_sk
            wg = (wg.to(tl.float32) * tl.load(gate_srows + s_col, mask=col_mask[None, :], other=0.0)).to(dt)
            wu = (wu.to(tl.float32) * tl.load(up_srows + s_col, mask=col_mask[None, :], other=0.0)).to(dt)
        elif SCALE == 1:  # per-row scales: e4m3 values are exact in fp16/bf16; scaled after the sums
            wg = wg.to(dt)
            wu = wu.to(dt)
        acc_gate = tl.dot(a, wg, acc_gate, input_precision=PRECISION)
        acc_up = tl.dot(a, wu, acc_up, input_precision=PRECISION)
    if SCALE == 1:
        acc_gate = acc_gate * tl.load(gate_srows, mask=col_mask[None, :], other=0.0)
        acc_up = acc_up * tl.load(up_srows, mask=col_mask[None, :], other=0.0)
    g = acc_gate.to(dt).to(tl.float32)
    u = acc_up.to(dt).to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
    out_ptrs = act_ptr + ids.to(tl.int64)[:, None] * stride_at + cols[None, :]
    tl.store(out_ptrs, (silu * u).to(dt), mask=row_mask[:, None] & col_mask[None, :])


@triton.jit
def _down_kernel(  # type: ignore[no-untyped-def]  # Triton kernel: arguments are typed by @triton.jit
    act_ptr, w_ptr, sorted_ids_ptr, block_expert_ptr, weights_ptr, out_ptr, s_ptr,
    num_pairs, num_experts, inter, hidden,
    stride_at, stride_we, stride_wn, stride_ot, stride_se, stride_sn, stride_sk, scale_rows, scale_cols,
    PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_GDC: tl.constexpr, SCALE: tl.constexpr,
):
    gdc_enter(USE_GDC)  # the alignment and the activations come from the kernels just before
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert >= num_experts:
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    ids = tl.load(sorted_ids_ptr + rows)
    row_mask = ids < num_pairs
    ids64 = ids.to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < hidden
    ks = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + expert.to(tl.int64) * stride_we + cols.to(tl.int64)[None, :] * stride_wn + ks[:, None]
    a_ptrs = act_ptr + ids64[:, None] * stride_at + ks[None, :]
    s_rows = s_ptr + expert.to(tl.int64) * stride_se + (cols // scale_rows).to(tl.int64)[None, :] * stride_sn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, inter, BLOCK_K):
        k_mask = (k + ks) < inter
        a = tl.load(a_ptrs + k, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w_mask = k_mask[:, None] & col_mask[None, :]
        w = tl.load(w_ptrs + k, mask=w_mask, other=0.0)
        if SCALE == 2:  # BLOCK_K divides the block width: one column of scale tiles per weight tile
            sc = tl.load(s_rows + (k // scale_cols) * stride_sk, mask=col_mask[None, :], other=0.0)
            w = (w.to(tl.float32) * sc).to(act_ptr.dtype.element_ty)
        elif SCALE == 1:
            w = w.to(act_ptr.dtype.element_ty)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
    if SCALE == 1:
        acc = acc * tl.load(s_rows, mask=col_mask[None, :], other=0.0)
    y = acc.to(act_ptr.dtype.element_ty).to(tl.float32)
    route = tl.load(weights_ptr + ids64, mask=row_mask, other=0.0).to(tl.float32)
    out_ptrs = out_ptr + ids64[:, None] * stride_ot + cols[None, :]
    tl.store(out_ptrs, y * route[:, None], mask=row_mask[:, None] & col_mask[None, :])


def _check(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, topk_weights: torch.Tensor,
           topk_ids: torch.Tensor, scales: ExpertScales | None = None) -> None:
    if x.dim() != 2 or w_gate_up.dim() != 3 or w_down.dim() != 3:
        raise ValueError(f"x must be [T, H], w_gate_up [E, 2 I, H], w_down [E, H, I]; got {tuple(x.shape)}, "
                         f"{tuple(w_gate_up.shape)}, {tuple(w_down.shape)}")
    e, two_i, h = w_gate_up.shape
    if two_i % 2 or h != x.shape[1] or tuple(w_down.shape) != (e, h, two_i // 2):
        raise ValueError(f"expert weights do not fit x {tuple(x.shape)}: w_gate_up {tuple(w_gate_up.shape)}, "
                         f"w_down {tuple(w_down.shape)}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0] or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_ids and topk_weights must both be [T={x.shape[0]}, k]; got "
                         f"{tuple(topk_ids.shape)}, {tuple(topk_weights.shape)}")
    if scales is not None:
        check_scale(w_gate_up, scales.gate_up, scales.block, "w_gate_up")
        check_scale(w_down, scales.down, scales.block, "w_down")
        if scales.block is not None and (two_i // 2) % scales.block[0]:
            raise ValueError(f"block-scaled w_gate_up: I={two_i // 2} is not a multiple of the block height "
                             f"{scales.block[0]} (the gate's last scale tile would hold up rows)")
        if scales.block is not None and scales.block[1] % 16:
            raise ValueError(f"block-scaled experts: the block width {scales.block[1]} is not a multiple of "
                             f"16 (the grouped kernels' weight tiles, at least 16 inputs, must each lie in "
                             f"one column of scale tiles)")
    elif x.dtype != w_gate_up.dtype or x.dtype != w_down.dtype:
        raise ValueError(f"x and the expert weights need one dtype; got {x.dtype}, {w_gate_up.dtype}, "
                         f"{w_down.dtype}")
    if x.stride(1) != 1 or w_gate_up.stride(2) != 1 or w_down.stride(2) != 1:
        raise ValueError("x and the expert weights need a contiguous last dim")


def _flat(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a contiguous 1-D tensor of its own dtype: a view when it is already contiguous (no copy
    kernel per layer: the kernels widen bf16/fp16 routing weights to float32 as they load them)."""
    flat = t.reshape(-1)
    return flat if flat.is_contiguous() else flat.contiguous()


def _scale_mode(scales: ExpertScales | None) -> int:
    """The kernels' ``SCALE``: 0 unquantized weights, 1 FP8 with per-row scales, 2 FP8 with block scales."""
    return 0 if scales is None else 1 if scales.block is None else 2


def moe_tile(num_pairs: int, num_experts: int, width: int, depth: int,
             block: tuple[int, int] | None = None) -> tuple[int, int, int, int]:
    """``(block_m, block_n, block_k, num_warps)`` for a grouped GEMM with ``num_pairs`` routed rows over
    ``num_experts``, ``width`` output columns and ``depth`` inputs: ``block_m`` 16 when an expert
    averages at most 16 rows (decode), else 64; ``block_n``/``block_k`` 64, smaller for narrow shapes;
    with block scales of ``block = (rows, cols)`` (cols a multiple of 16, ``_check``), ``block_k`` at most
    the largest power of two dividing ``cols``, so that each weight tile takes one column of scales."""
    block_m = 16 if num_pairs <= 16 * num_experts else 64
    block_n = min(64, max(16, triton.next_power_of_2(width)))
    block_k = min(64, max(16, triton.next_power_of_2(depth)))
    if block is not None:
        block_k = min(block_k, block[1] & -block[1])
    return block_m, block_n, block_k, 4


def gemv_scale_tile(block_n: int, block_k: int, block: tuple[int, int] | None) -> tuple[int, int]:
    """``(block_n, scale_k)`` that the matrix-vector MoE kernels run a ``block_n x block_k`` tile (powers of
    two) with: unscaled or per-row scales (``block`` None) ``(block_n, block_k)``; block scales of
    ``block = (rows, cols)``: ``block_n`` halved until it divides ``rows`` (a program's outputs then lie in
    one row of scale tiles) and ``scale_k`` the largest power of two dividing both ``block_k`` and ``cols``
    (the inputs under one scale that the kernels multiply into the activations at once)."""
    if block is None:
        return block_n, block_k
    while block[0] % block_n:
        block_n //= 2
    return block_n, min(block_k, block[1] & -block[1])


@triton.jit
def _gate_up_gemv_kernel(  # type: ignore[no-untyped-def]  # Triton kernel: arguments are typed by @triton.jit
    x_ptr, w_ptr, ids_ptr, act_ptr, s_ptr,
    top_k, hidden, inter,
    stride_xt, stride_we, stride_wn, stride_at, stride_se, stride_sn, stride_sk, scale_rows, scale_cols,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SCALE_K: tl.constexpr, USE_GDC: tl.constexpr,
    SCALE: tl.constexpr,
):
    pair = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < inter
    gdc_enter(USE_GDC)  # the routing comes from the kernels just before
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    token = (pair // top_k).to(tl.int64)
    gate_rows = w_ptr + expert * stride_we + cols.to(tl.int64)[:, None] * stride_wn  # [BLOCK_N, 1]
    up_rows = gate_rows + inter * stride_wn
    x_row = x_ptr + token * stride_xt
    s_base = s_ptr + expert * stride_se
    dt = act_ptr.dtype.element_ty
    if SCALE == 2:
        # block scales: the program's rows lie in one row of scale tiles (BLOCK_N divides the block height)
        # and SCALE_K divides the block width, so the tile is [BLOCK_N, CHUNKS, SCALE_K] with one gate and
        # one up scale per chunk of SCALE_K inputs, multiplied into x (fused_moe_fp8's module docstring)
        chunks: tl.constexpr = BLOCK_K // SCALE_K
        cs = tl.arange(0, chunks)
        offs = cs[:, None] * SCALE_K + tl.arange(0, SCALE_K)[None, :]  # [CHUNKS, SCALE_K]
        first = tl.program_id(1) * BLOCK_N
        gate_s = s_base + (first // scale_rows).to(tl.int64) * stride_sn
        up_s = s_base + ((inter + first) // scale_rows).to(tl.int64) * stride_sn
        gate_rows3 = gate_rows[:, :, None]  # [BLOCK_N, 1, 1]
        up_rows3 = up_rows[:, :, None]
        acc_gate3 = tl.zeros((BLOCK_N, chunks, SCALE_K), dtype=tl.float32)
        acc_up3 = tl.zeros((BLOCK_N, chunks, SCALE_K), dtype=tl.float32)
        for k in range(0, hidden, BLOCK_K):
            kk = k + offs
            k_mask = kk < hidden
            starts = k + cs * SCALE_K  # [CHUNKS]
            s_mask = starts < hidden
            s_cols = (starts // scale_cols).to(tl.int64) * stride_sk
            xv = tl.load(x_row + kk, mask=k_mask, other=0.0).to(tl.float32)
            xg = xv * tl.load(gate_s + s_cols, mask=s_mask, other=0.0)[:, None]
            xu = xv * tl.load(up_s + s_cols, mask=s_mask, other=0.0)[:, None]
            w_mask = col_mask[:, None, None] & k_mask[None, :, :]
            wg = tl.load(gate_rows3 + kk[None, :, :], mask=w_mask, other=0.0).to(tl.float32)
            wu = tl.load(up_rows3 + kk[None, :, :], mask=w_mask, other=0.0).to(tl.float32)
            acc_gate3 += wg * xg[None, :, :]
            acc_up3 += wu * xu[None, :, :]
        g = tl.sum(tl.sum(acc_gate3, axis=2), axis=1)
        u = tl.sum(tl.sum(acc_up3, axis=2), axis=1)
    else:
        ks = tl.arange(0, BLOCK_K)
        acc_gate = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k in range(0, hidden, BLOCK_K):
            kk = k + ks
            k_mask = kk < hidden
            xv = tl.load(x_row + kk, mask=k_mask, other=0.0).to(tl.float32)
            w_mask = col_mask[:, None] & k_mask[None, :]
            wg = tl.load(gate_rows + kk[None, :], mask=w_mask, other=0.0).to(tl.float32)
            wu = tl.load(up_rows + kk[None, :], mask=w_mask, other=0.0).to(tl.float32)
            acc_gate += wg * xv[None, :]
            acc_up += wu * xv[None, :]
        g = tl.sum(acc_gate, axis=1)
        u = tl.sum(acc_up, axis=1)
        if SCALE == 1:  # per-row scales times the float32 sums
            g = g * tl.load(s_base + (cols // scale_rows).to(tl.int64) * stride_sn, mask=col_mask, other=0.0)
            u = u * tl.load(s_base + ((inter + cols) // scale_rows).to(tl.int64) * stride_sn, mask=col_mask,
                            other=0.0)
    g = g.to(dt).to(tl.float32)
    u = u.to(dt).to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
    tl.store(act_ptr + pair.to(tl.int64) * stride_at + cols, (silu * u).to(dt), mask=col_mask)


@triton.jit
def _down_gemv_kernel(  # type: ignore[no-untyped-def]  # Triton kernel: arguments are typed by @triton.jit
    act_ptr, w_ptr, ids_ptr, weights_ptr, out_ptr, s_ptr,
    top_k, inter, hidden,
    stride_at, stride_we, stride_wn, stride_ot, stride_se, stride_sn, stride_sk, scale_rows, scale_cols,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SCALE_K: tl.constexpr, SLOTS: tl.constexpr,
    USE_GDC: tl.constexpr, SCALE: tl.constexpr,
):
    # tiles are [BLOCK_N output columns, SLOTS slots of the token, BLOCK_K inputs]: SLOTS experts' weights
    # are in flight at once instead of one expert after the other
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < hidden
    cols3 = cols.to(tl.int64)[:, None, None]  # [BLOCK_N, 1, 1]
    js = tl.arange(0, SLOTS)
    gdc_enter(USE_GDC)  # the activations come from the kernel just before
    total = tl.zeros((BLOCK_N,), dtype=tl.float32)
    dt = act_ptr.dtype.element_ty
    if SCALE == 2:
        # block scales: the program's rows lie in one row of scale tiles (BLOCK_N divides the block height)
        # and SCALE_K divides the block width; the slots' inputs are cut into chunks of SCALE_K, chunk m
        # of slot m // CHUNKS, each with one scale multiplied into the activations: [BLOCK_N, SLOTS *
        # CHUNKS, SCALE_K] tiles (fused_moe_fp8's module docstring)
        chunks: tl.constexpr = BLOCK_K // SCALE_K
        ms = tl.arange(0, SLOTS * chunks)
        m_slot = ms // chunks
        m_offs = (ms % chunks) * SCALE_K  # [SLOTS * CHUNKS]
        kc = tl.arange(0, SCALE_K)
        srow = ((tl.program_id(1) * BLOCK_N) // scale_rows).to(tl.int64) * stride_sn
        for j0 in range(0, top_k, SLOTS):
            m_mask = (j0 + m_slot) < top_k
            m_pairs = token * top_k + j0 + m_slot
            m_experts = tl.load(ids_ptr + m_pairs, mask=m_mask, other=0).to(tl.int64)
            rows = w_ptr + m_experts[None, :, None] * stride_we + cols3 * stride_wn  # [BLOCK_N, M, 1]
            s_m = s_ptr + m_experts * stride_se + srow
            a_m = act_ptr + m_pairs * stride_at
            row_mask = col_mask[:, None, None] & m_mask[None, :, None]
            acc3 = tl.zeros((BLOCK_N, SLOTS * chunks, SCALE_K), dtype=tl.float32)
            for k in range(0, inter, BLOCK_K):
                starts = k + m_offs
                kk = starts[:, None] + kc[None, :]  # [M, SCALE_K]
                k_mask = kk < inter
                av = tl.load(a_m[:, None] + kk, mask=m_mask[:, None] & k_mask, other=0.0).to(tl.float32)
                sc = tl.load(s_m + (starts // scale_cols).to(tl.int64) * stride_sk,
                             mask=m_mask & (starts < inter), other=0.0)
                av = av * sc[:, None]
                w = tl.load(rows + kk[None, :, :], mask=row_mask & k_mask[None, :, :], other=0.0)
                acc3 += w.to(tl.float32) * av[None, :, :]
            # each slot's sum over its chunks: [BLOCK_N, SLOTS]
            y = tl.sum(tl.reshape(tl.sum(acc3, axis=2), (BLOCK_N, SLOTS, chunks)), axis=2)
            y = y.to(dt).to(tl.float32)
            slot_mask = (j0 + js) < top_k
            route = tl.load(weights_ptr + token * top_k + j0 + js, mask=slot_mask, other=0.0).to(tl.float32)
            total += tl.sum(y * route[None, :], axis=1)
    else:
        srows3 = (cols // scale_rows).to(tl.int64)[:, None, None] * stride_sn
        ks = tl.arange(0, BLOCK_K)
        for j0 in range(0, top_k, SLOTS):
            slot_mask = (j0 + js) < top_k
            pairs = token * top_k + j0 + js  # [SLOTS]
            experts = tl.load(ids_ptr + pairs, mask=slot_mask, other=0).to(tl.int64)
            rows = w_ptr + experts[None, :, None] * stride_we + cols3 * stride_wn  # [BLOCK_N, SLOTS, 1]
            a_rows = act_ptr + pairs[None, :, None] * stride_at  # [1, SLOTS, 1]
            row_mask = col_mask[:, None, None] & slot_mask[None, :, None]
            acc = tl.zeros((BLOCK_N, SLOTS, BLOCK_K), dtype=tl.float32)
            for k in range(0, inter, BLOCK_K):
                kk = (k + ks)[None, None, :]  # [1, 1, BLOCK_K]
                k_mask = kk < inter
                av = tl.load(a_rows + kk, mask=slot_mask[None, :, None] & k_mask, other=0.0).to(tl.float32)
                w = tl.load(rows + kk, mask=row_mask & k_mask, other=0.0).to(tl.float32)
                acc += w * av
            y = tl.sum(acc, axis=2)  # [BLOCK_N, SLOTS]
            if SCALE == 1:  # the sum drops the unit axis
                s_rows = s_ptr + experts[None, :, None] * stride_se + srows3  # [BLOCK_N, SLOTS, 1]
                y = y * tl.sum(tl.load(s_rows, mask=row_mask, other=0.0), axis=2)
            y = y.to(dt).to(tl.float32)
            route = tl.load(weights_ptr + pairs, mask=slot_mask, other=0.0).to(tl.float32)
            total += tl.sum(y * route[None, :], axis=1)
    tl.store(out_ptr + token * stride_ot + cols, total.to(out_ptr.dtype.element_ty), mask=col_mask)


def moe_path(num_tokens: int, top_k: int, num_experts: int) -> str:
    """``"gemv"`` when the ``num_tokens * top_k`` pairs are few enough that they rarely share an expert
    (at most a quarter of the experts, and at most 64): one weight read per pair costs about what the
    grouped GEMM's one read per expert does, without its alignment; else ``"grouped"``."""
    pairs = num_tokens * top_k
    return "gemv" if pairs <= min(64, num_experts // 4) or num_tokens == 1 else "grouped"


def gemv_moe_tile(num_tokens: int, down: bool) -> tuple[int, int, int]:
    """``(block_n, block_k, num_warps)`` of the gate/up (``down`` False) or down matrix-vector MoE
    kernel for ``num_tokens`` tokens: the best of ``bench.kernels.fused_moe_gemv_sweep`` on an H200
    (Qwen3-30B-A3B shape, 2026-12-03, docs/benchmarks/README.md): one token 2 x 1024 with 4 warps for both
    (gate/up and down together 58 % of the copy bandwidth; every other tile 46-58 %); more tokens 8 x 512
    (gate/up) and 2 x 256 (down, with ``gemv_moe_slots`` 4) with 4 warps (kernel alone at 2 / 4 / 8 tokens
    78 / 85 / 89 %; down 4 x 512 one slot at a time: 75 / 81 / 87 %; serving takes this path only up to
    ``moe_path``'s pair limit). Swept with bf16 experts; FP8 experts take the same tiles (block-scaled ones
    through ``gemv_scale_tile``), not re-measured."""
    if num_tokens == 1:
        return 2, 1024, 4
    return (2, 256, 4) if down else (8, 512, 4)


def gemv_moe_slots(num_tokens: int, top_k: int) -> int:
    """Slots of a token whose experts the down matrix-vector kernel reads at once (``SLOTS``; a power of
    two, the rest of the ``top_k`` slots in further rounds): one token 1 (one expert after the other; the
    sweep found no gain), more tokens 4 (or ``top_k`` rounded up to a power of two when smaller), the
    sweep's best with ``gemv_moe_tile``'s 2 x 256 down tile."""
    if num_tokens == 1:
        return 1
    return min(4, 1 << max(0, top_k - 1).bit_length())


def fused_moe_gemv(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                   topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
                   up_tile: tuple[int, int, int] | None = None,
                   down_tile: tuple[int, int, int] | None = None, down_slots: int | None = None,
                   scales: ExpertScales | None = None) -> torch.Tensor:
    """``fused_moe``'s matrix-vector path with its tiles given (``(block_n, block_k, num_warps)`` of the
    gate/up and the down kernel; None: ``gemv_moe_tile``) and the down kernel's slots read at once
    (``down_slots``, a power of two; None: ``gemv_moe_slots``; each program's down tile is then
    ``block_n x down_slots x block_k``), for tile sweeps. Same arguments, result and errors as
    ``fused_moe``, plus ValueError for a ``down_slots`` that is not a power of two."""
    _check(x, w_gate_up, w_down, topk_weights, topk_ids, scales)
    slots = down_slots if down_slots is not None else gemv_moe_slots(x.shape[0], topk_ids.shape[1])
    if slots < 1 or slots & (slots - 1):
        raise ValueError(f"down_slots must be a power of two >= 1, got {slots}")
    block = scales.block if scales is not None else None
    s_up = kernel_scale_args(scales.gate_up if scales is not None else None, block, w_gate_up)
    s_down = kernel_scale_args(scales.down if scales is not None else None, block, w_down)
    t, hidden = x.shape
    inter = w_gate_up.shape[1] // 2
    top_k = topk_ids.shape[1]
    ids = _flat(topk_ids)
    act = torch.empty((t * top_k, inter), dtype=x.dtype, device=x.device)
    if t == 0:
        return torch.zeros_like(x)
    bn, bk, warps = up_tile or gemv_moe_tile(t, down=False)
    bn, scale_k = gemv_scale_tile(bn, bk, block)
    _gate_up_gemv_kernel[(t * top_k, triton.cdiv(inter, bn))](
        x, w_gate_up, ids, act, s_up[0], top_k, hidden, inter,
        x.stride(0), w_gate_up.stride(0), w_gate_up.stride(1), act.stride(0), *s_up[1:],
        BLOCK_N=bn, BLOCK_K=bk, SCALE_K=scale_k, SCALE=_scale_mode(scales), num_warps=warps,
        **pdl_kwargs(x),
    )
    weights = _flat(topk_weights)  # the kernels widen each routing weight to float32 as they load it
    out = torch.empty((t, hidden), dtype=x.dtype, device=x.device)
    bn, bk, warps = down_tile or gemv_moe_tile(t, down=True)
    bn, scale_k = gemv_scale_tile(bn, bk, block)
    _down_gemv_kernel[(t, triton.cdiv(hidden, bn))](
        act, w_down, ids, weights, out, s_down[0], top_k, inter, hidden,
        act.stride(0), w_down.stride(0), w_down.stride(1), out.stride(0), *s_down[1:],
        BLOCK_N=bn, BLOCK_K=bk, SCALE_K=scale_k, SLOTS=slots, SCALE=_scale_mode(scales), num_warps=warps,
        **pdl_kwargs(x),
    )
    return out


def fused_moe(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, *, block_m: int | None = None, path: str | None = None,
              scales: ExpertScales | None = None) -> torch.Tensor:
    """The routed experts' SwiGLU MLPs, weighted and summed per token (Triton).

    Args:
        x: ``[T, H]`` float32/float16/bfloat16, last dim contiguous.
        w_gate_up: ``[E, 2 I, H]`` (rows ``[0, I)`` gate, ``[I, 2 I)`` up), x's dtype, or float8_e4m3fn
            with ``scales``.
        w_down: ``[E, H, I]``, x's dtype, or float8_e4m3fn with ``scales``.
        topk_weights: ``[T, k]`` routing weights (any float dtype; used in float32).
        topk_ids: ``[T, k]`` integer experts in ``[0, E)``.
        block_m: rows per block (power of two >= 16) of the grouped path; default from ``moe_tile``.
        path: ``"grouped"`` (aligned grouped GEMMs) or ``"gemv"`` (one matrix-vector product per pair);
            default from ``moe_path``.
        scales: FP8 weights' scales (``engine.ops.fused_moe_fp8``), applied in the kernels (block scales
            per weight tile in the grouped path and to the activations in the matrix-vector path, per-row
            scales to each output's sum); block scales need ``I`` a multiple of ``bn`` and ``bk`` a
            multiple of 16.

    Returns:
        ``[T, H]`` new tensor of x's dtype.

    Raises:
        ValueError: shapes, dtypes, scales or strides that do not fit; an unknown ``path``.
    """
    _check(x, w_gate_up, w_down, topk_weights, topk_ids, scales)
    if path not in (None, "grouped", "gemv"):
        raise ValueError(f"path must be 'grouped' or 'gemv', got {path!r}")
    t, hidden = x.shape
    num_experts, two_i, _ = w_gate_up.shape
    inter = two_i // 2
    top_k = topk_ids.shape[1]
    pairs = t * top_k
    if pairs == 0:
        return torch.zeros_like(x)
    if (path or moe_path(t, top_k, num_experts)) == "gemv":
        return fused_moe_gemv(x, w_gate_up, w_down, topk_weights, topk_ids, scales=scales)
    block = scales.block if scales is not None else None
    tile_m, bn_up, bk_up, warps = moe_tile(pairs, num_experts, inter, hidden, block)
    _, bn_down, bk_down, _ = moe_tile(pairs, num_experts, hidden, inter, block)
    bm = block_m or tile_m
    align = moe_align(topk_ids, num_experts, bm)
    s_up = kernel_scale_args(scales.gate_up if scales is not None else None, block, w_gate_up)
    s_down = kernel_scale_args(scales.down if scales is not None else None, block, w_down)
    blocks = align.block_expert.numel()
    precision = "ieee" if x.dtype == torch.float32 else "tf32"  # fp32: exact products (no TF32 rounding)
    act = torch.empty((pairs, inter), dtype=x.dtype, device=x.device)
    _gate_up_kernel[(blocks, triton.cdiv(inter, bn_up))](
        x, w_gate_up, align.sorted_ids, align.block_expert, act, s_up[0],
        pairs, top_k, num_experts, hidden, inter,
        x.stride(0), w_gate_up.stride(0), w_gate_up.stride(1), act.stride(0), *s_up[1:],
        PRECISION=precision, BLOCK_M=bm, BLOCK_N=bn_up, BLOCK_K=bk_up, SCALE=_scale_mode(scales),
        num_warps=warps, **pdl_kwargs(x),
    )
    weights = _flat(topk_weights)  # the kernels widen each routing weight to float32 as they load it
    out = torch.empty((pairs, hidden), dtype=torch.float32, device=x.device)
    _down_kernel[(blocks, triton.cdiv(hidden, bn_down))](
        act, w_down, align.sorted_ids, align.block_expert, weights, out, s_down[0],
        pairs, num_experts, inter, hidden,
        act.stride(0), w_down.stride(0), w_down.stride(1), out.stride(0), *s_down[1:],
        PRECISION=precision, BLOCK_M=bm, BLOCK_N=bn_down, BLOCK_K=bk_down, SCALE=_scale_mode(scales),
        num_warps=warps, **pdl_kwargs(x),
    )
    return out.view(t, top_k, hidden).sum(dim=1).to(x.dtype)


def fused_moe_reference(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                        topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                        scales: ExpertScales | None = None) -> torch.Tensor:
    """Plain-torch ``fused_moe``: a loop over the experts hit (transformers' ``*Experts.forward``
    arithmetic: each projection in the dtype, ``silu(gate) * up``), the weighted outputs accumulated in
    float32 and rounded to x's dtype once; FP8 weights (``scales``) dequantized to x's dtype first. Same
    arguments and errors."""
    _check(x, w_gate_up, w_down, topk_weights, topk_ids, scales)
    if scales is not None:
        w_gate_up = dequantize_experts(w_gate_up, scales.gate_up, scales.block, x.dtype)
        w_down = dequantize_experts(w_down, scales.down, scales.block, x.dtype)
    acc = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    weights = topk_weights.to(torch.float32)
    for expert in torch.unique(topk_ids).tolist():
        token, slot = torch.where(topk_ids == expert)
        gate, up = torch.nn.functional.linear(x[token], w_gate_up[expert]).chunk(2, dim=-1)
        y = torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, w_down[expert])
        acc.index_add_(0, token, y.float() * weights[token, slot, None])
    return acc.to(x.dtype)
