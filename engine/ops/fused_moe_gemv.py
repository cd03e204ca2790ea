"""Mixture-of-experts feed-forward for few routed pairs (decode at small batch): one matrix-vector
product per (token, expert) pair, no alignment (Triton; the reference is
``engine.ops.fused_moe.fused_moe_reference``).

Few pairs (``engine.ops.fused_moe.moe_path``): the grouped GEMM's blocks are mostly padding and a
step's cost is the alignment's dozen small launches plus too few programs streaming each expert's
weights. The matrix-vector path skips the alignment: ``_gate_up_gemv_kernel`` runs one program per
(pair, ``block_n`` columns of ``I``) and ``_down_gemv_kernel`` one per (token, ``block_n`` columns of
``H``) that walks the token's ``k`` experts in slot order, ``SLOTS`` of them read at once
(``gemv_moe_slots``: a program's loads for those experts in flight together), each a row-blocked GEMV as
``engine.ops.gemv`` (float32 products summed along the row, the same roundings as the grouped
kernels), the weighted sum kept in float32 and rounded once. With ``PREFETCH`` (one token by default,
``gemv_moe_prefetch``) every slot is read in one round and the expert ids (``topk_ids``) and the first
weight tile are loaded before the wait for the gate/up kernel (programmatic dependent launch: the ids
were written before that kernel, engine/ops/pdl.py; the routing weights are read after the wait). A
weight is read once per pair that routes to it, so the path pays off only while pairs rarely share an
expert.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.ops.fp8_gemv import E4M3_SUM_SCALE, E4M3_X_SCALE, e4m3_bits
from engine.ops.fused_moe_args import check_args, flat, scale_mode
from engine.ops.fused_moe_fp8 import ExpertScales, kernel_scale_args
from engine.ops.pdl import gdc_enter, pdl_kwargs


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
def _weight_values(w, BITS: tl.constexpr):  # type: ignore[no-untyped-def]  # Triton function
    """A loaded weight tile in float32: converted (bf16/fp16 weights, or FP8 through the hardware
    conversion), or with ``BITS`` the int8-viewed e4m3 bytes decoded by ``fp8_gemv.e4m3_bits`` (the value
    times 2**-120)."""
    if BITS:
        return e4m3_bits(w)
    return w.to(tl.float32)


@triton.jit
def _weight_inputs(x, BITS: tl.constexpr):  # type: ignore[no-untyped-def]  # Triton function
    """The float32 activations multiplied with ``_weight_values``: times ``E4M3_X_SCALE`` with ``BITS``."""
    if BITS:
        return x * E4M3_X_SCALE
    return x


@triton.jit
def _sums(y, BITS: tl.constexpr):  # type: ignore[no-untyped-def]  # Triton function
    """Float32 sums of those products back to the weights' scale: times ``E4M3_SUM_SCALE`` with ``BITS``
    (powers of two: the bits equal the converted path's)."""
    if BITS:
        return y * E4M3_SUM_SCALE
    return y


@triton.jit
def _gate_up_gemv_kernel(  # type: ignore[no-untyped-def]  # Triton kernel: arguments are typed by @triton.jit
    x_ptr, w_ptr, ids_ptr, act_ptr, s_ptr,
    top_k, hidden, inter,
    stride_xt, stride_we, stride_wn, stride_at, stride_se, stride_sn, stride_sk, scale_rows, scale_cols,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SCALE_K: tl.constexpr, USE_GDC: tl.constexpr,
    SCALE: tl.constexpr, BITS: tl.constexpr,
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
            xv = _weight_inputs(tl.load(x_row + kk, mask=k_mask, other=0.0).to(tl.float32), BITS)
            xg = xv * tl.load(gate_s + s_cols, mask=s_mask, other=0.0)[:, None]
            xu = xv * tl.load(up_s + s_cols, mask=s_mask, other=0.0)[:, None]
            w_mask = col_mask[:, None, None] & k_mask[None, :, :]
            wg = _weight_values(tl.load(gate_rows3 + kk[None, :, :], mask=w_mask, other=0.0), BITS)
            wu = _weight_values(tl.load(up_rows3 + kk[None, :, :], mask=w_mask, other=0.0), BITS)
            acc_gate3 += wg * xg[None, :, :]
            acc_up3 += wu * xu[None, :, :]
        g = _sums(tl.sum(tl.sum(acc_gate3, axis=2), axis=1), BITS)
        u = _sums(tl.sum(tl.sum(acc_up3, axis=2), axis=1), BITS)
    else:
        ks = tl.arange(0, BLOCK_K)
        acc_gate = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k in range(0, hidden, BLOCK_K):
            kk = k + ks
            k_mask = kk < hidden
            xv = _weight_inputs(tl.load(x_row + kk, mask=k_mask, other=0.0).to(tl.float32), BITS)
            w_mask = col_mask[:, None] & k_mask[None, :]
            wg = _weight_values(tl.load(gate_rows + kk[None, :], mask=w_mask, other=0.0), BITS)
            wu = _weight_values(tl.load(up_rows + kk[None, :], mask=w_mask, other=0.0), BITS)
            acc_gate += wg * xv[None, :]
            acc_up += wu * xv[None, :]
        g = _sums(tl.sum(acc_gate, axis=1), BITS)
        u = _sums(tl.sum(acc_up, axis=1), BITS)
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
    USE_GDC: tl.constexpr, SCALE: tl.constexpr, BITS: tl.constexpr, PREFETCH: tl.constexpr,
):
    # tiles are [BLOCK_N output columns, SLOTS slots of the token, BLOCK_K inputs]: SLOTS experts' weights
    # are in flight at once instead of one expert after the other
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < hidden
    cols3 = cols.to(tl.int64)[:, None, None]  # [BLOCK_N, 1, 1]
    js = tl.arange(0, SLOTS)
    if not PREFETCH:
        gdc_enter(USE_GDC)  # the activations come from the kernel just before
    total = tl.zeros((BLOCK_N,), dtype=tl.float32)
    dt = act_ptr.dtype.element_ty
    if PREFETCH:
        # every slot in one round (SLOTS >= top_k, which down_prefetches ensures: slots past SLOTS would
        # be dropped; unscaled or per-row scales): the expert ids come from the kernels before the gate/up
        # kernel, complete before this one can launch, so they and the first weight tile are loaded before
        # the wait (the ids through L2: engine/ops/pdl.py); the routing weights after it; each iteration
        # then loads the next tile before its FMA
        slot_mask = js < top_k
        pairs = token * top_k + js  # [SLOTS]
        experts = tl.load(ids_ptr + pairs, mask=slot_mask, other=0, cache_modifier=".cg").to(tl.int64)
        rows = w_ptr + experts[None, :, None] * stride_we + cols3 * stride_wn  # [BLOCK_N, SLOTS, 1]
        row_mask = col_mask[:, None, None] & slot_mask[None, :, None]
        ks3 = tl.arange(0, BLOCK_K)[None, None, :]
        w = tl.load(rows + ks3, mask=row_mask & (ks3 < inter), other=0.0)
        gdc_enter(USE_GDC)  # the activations come from the kernel just before
        a_rows = act_ptr + pairs[None, :, None] * stride_at  # [1, SLOTS, 1]
        acc = tl.zeros((BLOCK_N, SLOTS, BLOCK_K), dtype=tl.float32)
        for k in range(0, inter, BLOCK_K):
            kk = k + ks3
            av = tl.load(a_rows + kk, mask=slot_mask[None, :, None] & (kk < inter), other=0.0).to(tl.float32)
            nk = kk + BLOCK_K
            w_next = tl.load(rows + nk, mask=row_mask & (nk < inter), other=0.0)
            acc += _weight_values(w, BITS) * _weight_inputs(av, BITS)
            w = w_next
        y = _sums(tl.sum(acc, axis=2), BITS)  # [BLOCK_N, SLOTS]
        if SCALE == 1:
            s_rows = (s_ptr + experts[None, :, None] * stride_se
                      + (cols // scale_rows).to(tl.int64)[:, None, None] * stride_sn)
            y = y * tl.sum(tl.load(s_rows, mask=row_mask, other=0.0), axis=2)
        y = y.to(dt).to(tl.float32)
        route = tl.load(weights_ptr + pairs, mask=slot_mask, other=0.0).to(tl.float32)
        total += tl.sum(y * route[None, :], axis=1)
    elif SCALE == 2:
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
                av = _weight_inputs(av * sc[:, None], BITS)
                w = tl.load(rows + kk[None, :, :], mask=row_mask & k_mask[None, :, :], other=0.0)
                acc3 += _weight_values(w, BITS) * av[None, :, :]
            # each slot's sum over its chunks: [BLOCK_N, SLOTS]
            y = _sums(tl.sum(tl.reshape(tl.sum(acc3, axis=2), (BLOCK_N, SLOTS, chunks)), axis=2), BITS)
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
                w = _weight_values(tl.load(rows + kk, mask=row_mask & k_mask, other=0.0), BITS)
                acc += w * _weight_inputs(av, BITS)
            y = _sums(tl.sum(acc, axis=2), BITS)  # [BLOCK_N, SLOTS]
            if SCALE == 1:  # the sum drops the unit axis
                s_rows = s_ptr + experts[None, :, None] * stride_se + srows3  # [BLOCK_N, SLOTS, 1]
                y = y * tl.sum(tl.load(s_rows, mask=row_mask, other=0.0), axis=2)
            y = y.to(dt).to(tl.float32)
            route = tl.load(weights_ptr + pairs, mask=slot_mask, other=0.0).to(tl.float32)
            total += tl.sum(y * route[None, :], axis=1)
    tl.store(out_ptr + token * stride_ot + cols, total.to(out_ptr.dtype.element_ty), mask=col_mask)

# expert widths up to this many inputs take the tiles swept on Qwen3-30B-A3B (I = 768); wider experts
# (Mixtral's 14 336) keep the tiles of the first sweep, not re-measured
GEMV_MOE_SWEPT_INTER = 2048


def _former_tiles(num_tokens: int, inter: int, layout: str) -> bool:
    """Whether ``gemv_moe_tile`` keeps the first sweep's tiles: experts wider than
    ``GEMV_MOE_SWEPT_INTER``, block-scaled FP8 experts (not re-measured) and per-row-scaled FP8 experts
    past one token (the new tiles measured slower there)."""
    return inter > GEMV_MOE_SWEPT_INTER or layout == "block" or (layout == "channel" and num_tokens > 1)


def gemv_moe_tile(num_tokens: int, down: bool, inter: int, layout: str = "none") -> tuple[int, int, int]:
    """``(block_n, block_k, num_warps)`` of the gate/up (``down`` False) or down matrix-vector MoE
    kernel for ``num_tokens`` tokens and experts of width ``inter`` (``layout``: ``"none"`` for
    bf16/fp16 experts, ``"channel"`` / ``"block"`` for FP8 experts with per-row / block scales): the best
    of ``bench.kernels.fused_moe_gemv_sweep`` on an H200 (Qwen3-30B-A3B shape, 2026-12-04,
    docs/benchmarks/README.md), both kernels together as shares of the copy bandwidth: one token gate/up
    1 x 1024 and down 2 x 128 over all 8 slots with ``gemv_moe_prefetch`` (73.6 %; the former 2 x 1024 /
    2 x 1024 one slot at a time 58.1 %); 2 tokens 2 x 512 / 4 x 256 with 2 slots (81.7 %; former 76.7 %);
    4 tokens 2 x 512 / 8 x 128 with 2 slots (90.1 %; former 83.6 %), all with 4 warps; 3 tokens (not
    swept) as 4. Per-row-scaled FP8 experts take the one-token tiles (22.3 µs, against 26.4 µs for the
    former ones on 2026-12-03) but the former ones for more tokens, where the new ones measured slower
    (2 / 4 tokens 39.0 / 80.8 µs against 34.9 / 60.5 µs with the former tiles, a later run the same day).
    Where ``_former_tiles``: one token 2 x 1024 for both, more tokens 8 x 512 (gate/up) and 2 x 256
    (down)."""
    if _former_tiles(num_tokens, inter, layout):
        if num_tokens == 1:
            return 2, 1024, 4
        return (2, 256, 4) if down else (8, 512, 4)
    if num_tokens == 1:
        return (2, 128, 4) if down else (1, 1024, 4)
    if not down:
        return 2, 512, 4
    return (4, 256, 4) if num_tokens == 2 else (8, 128, 4)


def gemv_moe_slots(num_tokens: int, top_k: int, inter: int, layout: str = "none") -> int:
    """Slots of a token whose experts the down matrix-vector kernel reads at once (``SLOTS``; a power of
    two, the rest of the ``top_k`` slots in further rounds), with ``gemv_moe_tile``'s down tile: one
    token every slot in one round (``top_k`` rounded up to a power of two), more tokens 2; where
    ``_former_tiles``, one slot at a time for one token and 4 for more."""
    every = 1 << max(0, top_k - 1).bit_length()
    if _former_tiles(num_tokens, inter, layout):
        return 1 if num_tokens == 1 else min(4, every)
    return every if num_tokens == 1 else min(2, every)


def gemv_moe_prefetch(num_tokens: int, top_k: int, slots: int, inter: int) -> bool:
    """Whether the down matrix-vector kernel loads the expert ids and its first weight tile before waiting
    for the gate/up kernel (``PREFETCH``) by default: for one token (the only launches with PDL) with every
    slot in one round and experts no wider than ``GEMV_MOE_SWEPT_INTER`` (down 2 x 128 x 8 slots 25.60 µs
    with, 26.24 µs without, in the sweep above); for more tokens, where no PDL runs and it only reorders
    the loads, it measured slower (2 tokens 47.45 vs 45.45 µs)."""
    return num_tokens == 1 and slots >= top_k and inter <= GEMV_MOE_SWEPT_INTER


def down_prefetches(num_tokens: int, top_k: int, slots: int, inter: int, scales: ExpertScales | None,
                    requested: bool | None) -> bool:
    """Whether the down kernel runs with ``PREFETCH``: ``requested`` (None: ``gemv_moe_prefetch``), and
    only where every slot fits one round (``slots >= top_k``) and the experts are unscaled or per-row
    scaled."""
    wanted = gemv_moe_prefetch(num_tokens, top_k, slots, inter) if requested is None else requested
    return wanted and slots >= top_k and scale_mode(scales) != 2


def fused_moe_gemv(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                   topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
                   up_tile: tuple[int, int, int] | None = None,
                   down_tile: tuple[int, int, int] | None = None, down_slots: int | None = None,
                   down_prefetch: bool | None = None,
                   scales: ExpertScales | None = None, decode_bits: bool = False) -> torch.Tensor:
    """``fused_moe``'s matrix-vector path with its tiles given (``(block_n, block_k, num_warps)`` of the
    gate/up and the down kernel; None: ``gemv_moe_tile``) and the down kernel's slots read at once
    (``down_slots``, a power of two; None: ``gemv_moe_slots``; each program's down tile is then
    ``block_n x down_slots x block_k``), for tile sweeps. ``down_prefetch``: the down kernel loads the
    expert ids and its first weight tile before waiting for the gate/up kernel (``gemv_moe_prefetch``; None:
    its default), taken only where every slot fits one round (``down_slots >= top_k``) and the experts are
    unscaled or per-row scaled, else ignored. ``decode_bits`` (FP8 experts only): decode the
    e4m3 weights by integer operations as ``engine.ops.fp8_gemv`` does (the same bits as the hardware
    conversion; 0.90-0.93x its speed on an H200 at 1-8 tokens, docs/benchmarks/README.md, so ``fused_moe``
    keeps the conversion). Same arguments, result and errors as ``fused_moe``, plus ValueError for a
    ``down_slots`` that is not a power of two."""
    check_args(x, w_gate_up, w_down, topk_weights, topk_ids, scales)
    inter = w_gate_up.shape[1] // 2
    layout = "none" if scales is None else ("block" if scales.block is not None else "channel")
    slots = down_slots if down_slots is not None else gemv_moe_slots(x.shape[0], topk_ids.shape[1], inter,
                                                                     layout)
    if slots < 1 or slots & (slots - 1):
        raise ValueError(f"down_slots must be a power of two >= 1, got {slots}")
    block = scales.block if scales is not None else None
    s_up = kernel_scale_args(scales.gate_up if scales is not None else None, block, w_gate_up)
    s_down = kernel_scale_args(scales.down if scales is not None else None, block, w_down)
    t, hidden = x.shape
    top_k = topk_ids.shape[1]
    ids = flat(topk_ids)
    # before the gate/up launch: a copy kernel here must not come between it and the down kernel
    weights = flat(topk_weights)  # the kernels widen each routing weight to float32 as they load it
    act = torch.empty((t * top_k, inter), dtype=x.dtype, device=x.device)
    if t == 0:
        return torch.zeros_like(x)
    bits = decode_bits and scales is not None
    bn, bk, warps = up_tile or gemv_moe_tile(t, False, inter, layout)
    bn, scale_k = gemv_scale_tile(bn, bk, block)
    _gate_up_gemv_kernel[(t * top_k, triton.cdiv(inter, bn))](
        x, w_gate_up.view(torch.int8) if bits else w_gate_up, ids, act, s_up[0], top_k, hidden, inter,
        x.stride(0), w_gate_up.stride(0), w_gate_up.stride(1), act.stride(0), *s_up[1:],
        BLOCK_N=bn, BLOCK_K=bk, SCALE_K=scale_k, SCALE=scale_mode(scales), BITS=bits, num_warps=warps,
        **pdl_kwargs(x),
    )
    out = torch.empty((t, hidden), dtype=x.dtype, device=x.device)
    bn, bk, warps = down_tile or gemv_moe_tile(t, True, inter, layout)
    bn, scale_k = gemv_scale_tile(bn, bk, block)
    prefetch = down_prefetches(t, top_k, slots, inter, scales, down_prefetch)
    _down_gemv_kernel[(t, triton.cdiv(hidden, bn))](
        act, w_down.view(torch.int8) if bits else w_down, ids, weights, out, s_down[0], top_k, inter, hidden,
        act.stride(0), w_down.stride(0), w_down.stride(1), out.stride(0), *s_down[1:],
        BLOCK_N=bn, BLOCK_K=bk, SCALE_K=scale_k, SLOTS=slots, SCALE=scale_mode(scales), BITS=bits,
        PREFETCH=prefetch, num_warps=warps, **pdl_kwargs(x),
    )
    return out
