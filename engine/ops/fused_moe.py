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

Few pairs (decode at small batch, ``moe_path``) take the matrix-vector path instead
(``engine.ops.fused_moe_gemv``), which skips the alignment.

Both paths also take FP8 (e4m3) expert weights with their scales (``scales``; layouts, and where the
kernels apply them: ``engine.ops.fused_moe_fp8``): weight-only, the activations stay in their dtype; a
weight tile takes one block scale per output row (``moe_tile`` and ``fused_moe_gemv.gemv_scale_tile``
align the tiles to the scale blocks), never one per weight.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.ops.fused_moe_args import check_args, flat, scale_mode
from engine.ops.fused_moe_fp8 import ExpertScales, dequantize_experts, kernel_scale_args
from engine.ops.fused_moe_gemv import fused_moe_gemv
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

def moe_tile(num_pairs: int, num_experts: int, width: int, depth: int,
             block: tuple[int, int] | None = None) -> tuple[int, int, int, int]:
    """``(block_m, block_n, block_k, num_warps)`` for a grouped GEMM with ``num_pairs`` routed rows over
    ``num_experts``, ``width`` output columns and ``depth`` inputs: ``block_m`` 16 when an expert
    averages at most 16 rows (decode), else 64; ``block_n``/``block_k`` 64, smaller for narrow shapes;
    with block scales of ``block = (rows, cols)`` (cols a multiple of 16, ``check_args``), ``block_k`` at most
    the largest power of two dividing ``cols``, so that each weight tile takes one column of scales."""
    block_m = 16 if num_pairs <= 16 * num_experts else 64
    block_n = min(64, max(16, triton.next_power_of_2(width)))
    block_k = min(64, max(16, triton.next_power_of_2(depth)))
    if block is not None:
        block_k = min(block_k, block[1] & -block[1])
    return block_m, block_n, block_k, 4

def moe_path(num_tokens: int, top_k: int, num_experts: int) -> str:
    """``"gemv"`` when the ``num_tokens * top_k`` pairs are few enough that they rarely share an expert
    (at most a quarter of the experts, and at most 64): one weight read per pair costs about what the
    grouped GEMM's one read per expert does, without its alignment; else ``"grouped"``."""
    pairs = num_tokens * top_k
    return "gemv" if pairs <= min(64, num_experts // 4) or num_tokens == 1 else "grouped"

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
    check_args(x, w_gate_up, w_down, topk_weights, topk_ids, scales)
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
        PRECISION=precision, BLOCK_M=bm, BLOCK_N=bn_up, BLOCK_K=bk_up, SCALE=scale_mode(scales),
        num_warps=warps, **pdl_kwargs(x),
    )
    weights = flat(topk_weights)  # the kernels widen each routing weight to float32 as they load it
    out = torch.empty((pairs, hidden), dtype=torch.float32, device=x.device)
    _down_kernel[(blocks, triton.cdiv(hidden, bn_down))](
        act, w_down, align.sorted_ids, align.block_expert, weights, out, s_down[0],
        pairs, num_experts, inter, hidden,
        act.stride(0), w_down.stride(0), w_down.stride(1), out.stride(0), *s_down[1:],
        PRECISION=precision, BLOCK_M=bm, BLOCK_N=bn_down, BLOCK_K=bk_down, SCALE=scale_mode(scales),
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
    check_args(x, w_gate_up, w_down, topk_weights, topk_ids, scales)
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
