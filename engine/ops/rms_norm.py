"""RMSNorm, optionally fused with the residual add before it (Triton kernel + plain-torch reference).

RMSNorm: ``y = w * (x / sqrt(mean(x^2) + eps))`` (Zhang & Sennrich, "Root Mean Square Layer
Normalization", NeurIPS 2019), with the rounding of transformers' ``LlamaRMSNorm``: the mean and the
normalisation in float32, the result rounded to the input dtype, then multiplied by the weight in that
dtype. The fused form also does the decoder layer's residual add (``residual = x + residual``, rounded to
the input dtype) in the same pass, in place, so one kernel replaces five or six elementwise launches.
One Triton program normalises one row. ``rms_norm_fp8`` also quantizes the normalised row to FP8 with one
scale per token, the input an FP8 projection (``engine.ops.fp8_gemm``) would quantize to first: one pass
instead of the norm writing bf16 and the quantizer reading it back. ``qk_rms_norm`` normalises a step's
query and key heads (Qwen3's per-head ``q_norm`` and ``k_norm``, two weights) in one launch, straight from
the fused QKV output.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.ops.fp8_gemm import quantize_fp8_groups_reference, round_to_e4m3
from engine.ops.fp8_weight import FP8_DTYPE, FP8_MAX, MIN_SCALE
from engine.ops.pdl import gdc_enter, pdl_kwargs


@triton.jit
def _rms_norm_kernel(  # type: ignore[no-untyped-def]  # Triton kernel: arguments are typed by @triton.jit
    x_ptr, res_ptr, w_ptr, out_ptr, scale_ptr,
    stride_x, stride_r, stride_o,
    n_cols, eps,
    HAS_RESIDUAL: tl.constexpr, QUANT: tl.constexpr, FP8_MAX_C: tl.constexpr, MIN_SCALE_C: tl.constexpr,
    BLOCK_N: tl.constexpr, USE_GDC: tl.constexpr,
):
    gdc_enter(USE_GDC)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(r.dtype)
        tl.store(res_ptr + row * stride_r + cols, x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / n_cols
    normed = (xf / tl.sqrt(var + eps)).to(x.dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if QUANT:  # the row as rms_norm stores it, then quantized as quantize_fp8_groups(y, n_cols) does
        y = (normed * w).to(x.dtype).to(tl.float32)
        scale = tl.maximum(tl.max(tl.abs(y), axis=0) / FP8_MAX_C, MIN_SCALE_C)
        q = round_to_e4m3(tl.clamp(y / scale, -FP8_MAX_C, FP8_MAX_C))
        tl.store(out_ptr + row * stride_o + cols, q.to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(scale_ptr + row, scale)
    else:
        tl.store(out_ptr + row * stride_o + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


def _check(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> None:
    if x.dim() != 2 or weight.shape != (x.shape[1],):
        raise ValueError(f"x must be [T, N] and weight [N]; got {tuple(x.shape)} and {tuple(weight.shape)}")
    if x.stride(1) != 1:
        raise ValueError("x must have a contiguous last dim")
    if weight.dtype != x.dtype:
        raise ValueError(f"weight dtype {weight.dtype} does not match x dtype {x.dtype}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype
                                 or residual.stride(1) != 1):
        raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} does not match x "
                         f"{tuple(x.shape)} {x.dtype} (or its last dim is not contiguous)")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm of each row of ``x`` (Triton), after ``residual += x`` when ``residual`` is given.

    Args:
        x: ``[T, N]`` float32/float16/bfloat16, last dim contiguous.
        weight: ``[N]``, same dtype as ``x`` (a float32 weight with a bf16 ``x`` is refused: the kernel
            would round the product to ``x``'s dtype while transformers' module, promoting, returns float32).
        eps: added to the mean square (``config.rms_norm_eps``).
        residual: optional ``[T, N]`` of ``x``'s dtype; updated in place to ``x + residual``, and the
            norm is taken of that sum (the decoder layer's "add, then normalise").

    Returns:
        ``[T, N]`` new tensor of ``x``'s dtype.

    Raises:
        ValueError: shapes, dtypes or strides that do not fit (a weight or residual dtype other than
            ``x``'s included, naming both dtypes).
    """
    _check(x, weight, residual)
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if x.shape[0] == 0:
        return out
    n = x.shape[1]
    block = triton.next_power_of_2(n)
    res = residual if residual is not None else x
    _rms_norm_kernel[(x.shape[0],)](
        x, res, weight, out, out, x.stride(0), res.stride(0), out.stride(0), n, eps,
        HAS_RESIDUAL=residual is not None, QUANT=False, FP8_MAX_C=FP8_MAX, MIN_SCALE_C=MIN_SCALE,
        BLOCK_N=block, num_warps=min(16, max(1, block // 256)), **pdl_kwargs(x),
    )
    return out


def rms_norm_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``rms_norm`` quantized to FP8 per token in the same pass (Triton): the arithmetic of
    ``quantize_fp8_groups(rms_norm(x, weight, eps, residual), N)`` (the normalised row rounded to ``x``'s
    dtype, scale ``max(amax / 448, MIN_SCALE)``, values rounded to nearest e4m3), without writing the
    ``[T, N]`` row in ``x``'s dtype and reading it back. What an FP8 projection with per-token activation
    scales (``engine.ops.fp8_gemm``) takes. Not always the same bits as the two kernels: Triton lays the
    two kernels out differently, so a row's sum of squares can be added in another order (on an H200 a
    float32 row's scale differed in its last bit; the e4m3 values agreed).

    Args:
        x, weight, eps, residual: as ``rms_norm`` (``residual`` updated in place the same way).

    Returns:
        ``(q float8_e4m3fn [T, N], scale float32 [T, 1])``.

    Raises:
        ValueError: as ``rms_norm``.
    """
    _check(x, weight, residual)
    t, n = x.shape
    q = torch.empty((t, n), dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((t, 1), dtype=torch.float32, device=x.device)
    if t == 0:
        return q, scale
    block = triton.next_power_of_2(n)
    res = residual if residual is not None else x
    _rms_norm_kernel[(t,)](
        x, res, weight, q, scale, x.stride(0), res.stride(0), q.stride(0), n, eps,
        HAS_RESIDUAL=residual is not None, QUANT=True, FP8_MAX_C=FP8_MAX, MIN_SCALE_C=MIN_SCALE,
        BLOCK_N=block, num_warps=min(16, max(1, block // 256)), **pdl_kwargs(x),
    )
    return q, scale


def rms_norm_fp8_reference(x: torch.Tensor, weight: torch.Tensor, eps: float,
                           residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch ``rms_norm_fp8``: ``rms_norm_reference``, then ``quantize_fp8_groups_reference`` with
    one group per row. Same arguments, result and errors."""
    y = rms_norm_reference(x, weight, eps, residual)
    return quantize_fp8_groups_reference(y, y.shape[1])


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float,
                       residual: torch.Tensor | None = None) -> torch.Tensor:
    """Plain-torch ``rms_norm`` (transformers' ``LlamaRMSNorm`` arithmetic); same arguments, same
    in-place update of ``residual``.

    Raises:
        ValueError: shapes, dtypes or strides that do not fit.
    """
    _check(x, weight, residual)
    if residual is not None:
        residual.add_(x)
        x = residual
    xf = x.to(torch.float32)
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


@triton.jit
def _qk_norm_kernel(  # type: ignore[no-untyped-def]  # Triton kernel: arguments are typed by @triton.jit
    x_ptr, wq_ptr, wk_ptr, out_ptr,
    stride_xt, stride_xh, q_heads, heads, head_dim, eps_q, eps_k,
    BLOCK_D: tl.constexpr, USE_GDC: tl.constexpr,
):
    gdc_enter(USE_GDC)
    row = tl.program_id(0)
    token = (row // heads).to(tl.int64)
    head = row % heads
    cols = tl.arange(0, BLOCK_D)
    mask = cols < head_dim
    x = tl.load(x_ptr + token * stride_xt + head * stride_xh + cols, mask=mask, other=0.0)
    is_q = head < q_heads
    eps = tl.where(is_q, eps_q, eps_k)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / head_dim
    normed = (xf / tl.sqrt(var + eps)).to(x.dtype).to(tl.float32)
    wq = tl.load(wq_ptr + cols, mask=mask & is_q, other=0.0).to(tl.float32)
    wk = tl.load(wk_ptr + cols, mask=mask & (head >= q_heads), other=0.0).to(tl.float32)
    w = tl.where(is_q, wq, wk)
    out = (normed * w).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row.to(tl.int64) * head_dim + cols, out, mask=mask)


def _check_qk(qk: torch.Tensor, q_heads: int, q_weight: torch.Tensor, k_weight: torch.Tensor) -> None:
    if qk.dim() != 3 or qk.stride(2) != 1:
        raise ValueError(f"qk must be [T, heads, D] with a contiguous last dim, got {tuple(qk.shape)}")
    d = qk.shape[2]
    if not 0 <= q_heads <= qk.shape[1]:
        raise ValueError(f"q_heads must be in [0, {qk.shape[1]}], got {q_heads}")
    if q_weight.shape != (d,) or k_weight.shape != (d,):
        raise ValueError(f"q_weight and k_weight must be [{d}]; got {tuple(q_weight.shape)} and "
                         f"{tuple(k_weight.shape)}")
    if q_weight.dtype != qk.dtype or k_weight.dtype != qk.dtype:
        raise ValueError(f"q_weight dtype {q_weight.dtype} and k_weight dtype {k_weight.dtype} must both be "
                         f"qk's dtype {qk.dtype}")


def qk_rms_norm(qk: torch.Tensor, q_heads: int, q_weight: torch.Tensor, q_eps: float, k_weight: torch.Tensor,
                k_eps: float) -> torch.Tensor:
    """Per-head RMSNorm of the query and key heads of a step in one launch (Triton): head ``h`` of each
    token normalised with ``q_weight``/``q_eps`` when ``h < q_heads``, else ``k_weight``/``k_eps``; each
    head as ``rms_norm`` rounds a row (Qwen3's ``q_norm``/``k_norm``, transformers' ``Qwen3RMSNorm``). One
    program per (token, head).

    Args:
        qk: ``[T, q_heads + k_heads, D]``, float32/float16/bfloat16, last dim contiguous, other strides
            free (the query and key columns of a fused QKV projection's output, viewed per head).
        q_heads: how many leading heads are query heads.
        q_weight, k_weight: ``[D]`` each, ``qk``'s dtype (another dtype is refused, as in ``rms_norm``).
        q_eps, k_eps: the two norms' epsilons.

    Returns:
        ``[T, q_heads + k_heads, D]`` new contiguous tensor of ``qk``'s dtype.

    Raises:
        ValueError: shapes or strides that do not fit, or a weight dtype other than ``qk``'s (naming both).
    """
    _check_qk(qk, q_heads, q_weight, k_weight)
    t, heads, d = qk.shape
    out = torch.empty((t, heads, d), dtype=qk.dtype, device=qk.device)
    if t * heads == 0:
        return out
    block = triton.next_power_of_2(d)
    _qk_norm_kernel[(t * heads,)](
        qk, q_weight, k_weight, out, qk.stride(0), qk.stride(1), q_heads, heads, d, q_eps, k_eps,
        BLOCK_D=block, num_warps=min(16, max(1, block // 256)), **pdl_kwargs(qk),
    )
    return out


def qk_rms_norm_reference(qk: torch.Tensor, q_heads: int, q_weight: torch.Tensor, q_eps: float,
                          k_weight: torch.Tensor, k_eps: float) -> torch.Tensor:
    """Plain-torch ``qk_rms_norm``: ``rms_norm_reference`` over the query heads' rows and over the key
    heads' rows. Same arguments, result and errors."""
    _check_qk(qk, q_heads, q_weight, k_weight)
    t, heads, d = qk.shape
    q = rms_norm_reference(qk[:, :q_heads].reshape(-1, d), q_weight, q_eps).view(t, q_heads, d)
    k = rms_norm_reference(qk[:, q_heads:].reshape(-1, d), k_weight, k_eps).view(t, heads - q_heads, d)
    return torch.cat((q, k), dim=1)
