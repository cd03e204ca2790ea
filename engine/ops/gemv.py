"""Matrix-vector product for one-row decode steps: ``y = x @ W^T`` with ``x [1, K]`` (Triton + reference).

At batch 1 a decode step's projections are matrix-vector products bound by reading ``W`` once; cuBLAS
reaches 62–76 % of the copy bandwidth on the small-N projections of Llama-3-8B (QKV 6144 × 4096, O
4096 × 4096; docs/benchmarks/engine.md) because its tiles leave too few thread blocks in flight.
Here each program owns ``BLOCK_N`` output features and walks the whole ``K`` in ``BLOCK_K`` chunks with
float32 accumulation (the row-blocked GEMV decomposition, as in CUTLASS's ``gemm/kernel/gemv.h``); the tile
depends on N (``gemv_tile``); no split-K, so no atomics and no reduction kernel. The first weight tile is
loaded before the wait for the kernel producing ``x`` (programmatic dependent launch, engine/ops/pdl.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.ops.pdl import gdc_enter, pdl_kwargs
from engine.ops.silu_mul import load_silu_mul, silu_mul_reference


def gemv_tile(n: int, gated: bool = False, k: int | None = None) -> tuple[int, int, int]:
    """``(block_n, block_k, num_warps)`` for a ``[N, K]`` weight (``gated``: the down projection with
    SiLU·mul folded in; ``k`` None: taken as more than 2048): the best tiles of
    ``bench.kernels.gemm_decode --rows 1 --tiles ...`` on an H200 with programmatic dependent launch
    (docs/benchmarks/engine.md, docs/benchmarks/README.md), as shares of the copy bandwidth. Llama-3-8B:
    wide matrices (gate/up, LM head) 2 x 1024 with 4 warps (~101-106 %); N <= 4096 4 x 1024 with 4 warps
    (O 83.9 %, down 97.8 %; 16 x 512 with 8 warps: 76.8 %, 88.1 %), gated 8 x 1024 with 4 warps (89.8 %;
    16 x 512 x 8: 84.9 %); in between (QKV) 8 x 512 with 4 warps (89.5 %; 8 x 1024 x 8: 86.8 %).
    Qwen3-30B-A3B's attention (2026-12-04): N <= 2048 (O, 2048 x 4096) 1 x 1024 with 4 warps (74.5 %;
    4 x 1024: 64.5 %); in between with K <= 2048 (QKV, 5120 x 2048) 4 x 512 (81.7 %; 8 x 512: 78.2 %)."""
    if n >= 16384:
        return 2, 1024, 4
    if n <= 2048 and not gated:
        return 1, 1024, 4
    if n <= 4096:
        return (8, 1024, 4) if gated else (4, 1024, 4)
    return (4, 512, 4) if k is not None and k <= 2048 else (8, 512, 4)


# (block_n, block_k, num_warps) of a mixture-of-experts router's logits (N = experts <= 512, K = hidden):
# 1.19 us for Qwen3-30B-A3B's 128 x 2048 on the H200 against 1.55 us for 4 x 1024 tiles and 4.66 us
# for cuBLAS (bench.kernels.fused_moe_gemv_sweep, 2026-12-03)
ROUTER_GEMV_TILE = (2, 2048, 8)


@triton.jit
def _gemv_kernel(  # type: ignore[no-untyped-def]  # Triton kernel: arguments are typed by @triton.jit
    x_ptr, w_ptr, b_ptr, y_ptr, n_out, k_in, stride_w,
    HAS_BIAS: tl.constexpr, GATED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_GDC: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < n_out
    cols = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_w
    # the first weight tile is loaded before waiting for the kernel that produces x (weights are never
    # written during a step: engine/ops/pdl.py); each iteration then loads the next tile before its FMA
    w = tl.load(w_rows + cols[None, :], mask=row_mask[:, None] & (cols < k_in)[None, :], other=0.0)
    gdc_enter(USE_GDC)
    for k in range(0, k_in, BLOCK_K):
        kk = k + cols
        k_mask = kk < k_in
        x = load_silu_mul(x_ptr, kk, k_mask, k_in, GATED)  # GATED: x = [gate | up], silu(gate) * up
        nk = kk + BLOCK_K
        w_next = tl.load(w_rows + nk[None, :], mask=row_mask[:, None] & (nk < k_in)[None, :], other=0.0)
        acc += w.to(tl.float32) * x[None, :]
        w = w_next
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(b_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=row_mask)


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, gated: bool = False) -> None:
    width = (2 if gated else 1) * weight.shape[1] if weight.dim() == 2 else -1
    if x.dim() != 2 or x.shape[0] != 1 or weight.dim() != 2 or x.shape[1] != width:
        need = "[1, 2 * K] (gate | up)" if gated else "[1, K]"
        raise ValueError(f"gemv needs x {need} and weight [N, K]; got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")
    if x.stride(1) != 1 or weight.stride(1) != 1 or x.dtype != weight.dtype:
        raise ValueError("x and weight need a contiguous last dim and the same dtype")
    if bias is not None and (bias.shape != (weight.shape[0],) or bias.dtype != weight.dtype):
        raise ValueError(f"bias must be [{weight.shape[0]}] of {weight.dtype}, got {tuple(bias.shape)} "
                         f"{bias.dtype}")


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, gated: bool = False,
         block_n: int | None = None, block_k: int | None = None,
         num_warps: int | None = None) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` for one row (Triton), float32 accumulation.

    Args:
        x: ``[1, K]``; weight: ``[N, K]`` (an ``nn.Linear`` weight, rows may be strided); bias: ``[N]``
            or None. One dtype for all (float32/float16/bfloat16).
        gated: ``x`` is ``[1, 2 * K]``, a fused gate/up projection's output, and the product is taken with
            ``silu(x[:, :K]) * x[:, K:]`` computed while loading (SwiGLU's down projection without the
            ``silu_mul`` launch; bit-identical to ``gemv(silu_mul(x), ...)``).
        block_n, block_k, num_warps: tile (output features × inputs per step, powers of two) and warps
            per program; each one left None comes from ``gemv_tile(N, gated, K)`` (measured best on an H200).

    Returns:
        ``[1, N]`` new tensor of ``x``'s dtype.

    Raises:
        ValueError: shapes, dtypes or strides that do not fit.
    """
    _check(x, weight, bias, gated)
    n, k = weight.shape
    tile = gemv_tile(n, gated, k)
    block_n, block_k, num_warps = block_n or tile[0], block_k or tile[1], num_warps or tile[2]
    y = torch.empty((1, n), dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, weight, bias if bias is not None else weight, y, n, k, weight.stride(0),
        HAS_BIAS=bias is not None, GATED=gated, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps,
        **pdl_kwargs(x, "gemv"),
    )
    return y


def gemv_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                   gated: bool = False) -> torch.Tensor:
    """Plain-torch ``gemv``: (with ``gated``, ``silu_mul_reference`` first) ``torch.nn.functional.linear``
    in float32, rounded to ``x``'s dtype.

    Raises:
        ValueError: shapes, dtypes or strides that do not fit.
    """
    _check(x, weight, bias, gated)
    if gated:
        x = silu_mul_reference(x)
    b = bias.float() if bias is not None else None
    return torch.nn.functional.linear(x.float(), weight.float(), b).to(x.dtype)
