"""RMSNorm, optionally fused with the residual add before it (Triton kernel + plain-torch reference).

RMSNorm: ``y = w * (x / sqrt(mean(x^2) + eps))`` (Zhang & Sennrich, "Root Mean Square Layer
Normalization", NeurIPS 2019), with the rounding of transformers' ``LlamaRMSNorm``: the mean and the
normalisation in float32, the result rounded to the input dtype, then multiplied by the weight in that
dtype. The fused form also does the decoder layer's residual add (``residual = x + residual``, rounded to
the input dtype) in the same pass, in place, so one kernel replaces five or six elementwise launches.
One Triton program normalises one row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.ops.pdl import gdc_enter, pdl_kwargs


@triton.jit
def _rms_norm_kernel(  # type: ignore[no-untyped-def]  # Triton kernel: arguments are typed by @triton.jit
    x_ptr, res_ptr, w_ptr, out_ptr,
    stride_x, stride_r, stride_o,
    n_cols, eps,
    HAS_RESIDUAL: tl.constexpr,
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
    tl.store(out_ptr + row * stride_o + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


def _check(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> None:
    if x.dim() != 2 or weight.shape != (x.shape[1],):
        raise ValueError(f"x must be [T, N] and weight [N]; got {tuple(x.shape)} and {tuple(weight.shape)}")
    if x.stride(1) != 1:
        raise ValueError("x must have a contiguous last dim")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype
                                 or residual.stride(1) != 1):
        raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} does not match x "
                         f"{tuple(x.shape)} {x.dtype} (or its last dim is not contiguous)")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm of each row of ``x`` (Triton), after ``residual += x`` when ``residual`` is given.

    Args:
        x: ``[T, N]`` float32/float16/bfloat16, last dim contiguous.
        weight: ``[N]``, same dtype as ``x``.
        eps: added to the mean square (``config.rms_norm_eps``).
        residual: optional ``[T, N]`` of ``x``'s dtype; updated in place to ``x + residual``, and the
            norm is taken of that sum (the decoder layer's "add, then normalise").

    Returns:
        ``[T, N]`` new tensor of ``x``'s dtype.

    Raises:
        ValueError: shapes, dtypes or strides that do not fit.
    """
    _check(x, weight, residual)
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if x.shape[0] == 0:
        return out
    n = x.shape[1]
    block = triton.next_power_of_2(n)
    res = residual if residual is not None else x
    _rms_norm_kernel[(x.shape[0],)](
        x, res, weight, out, x.stride(0), res.stride(0), out.stride(0), n, eps,
        HAS_RESIDUAL=residual is not None, BLOCK_N=block, num_warps=min(16, max(1, block // 256)),
        **pdl_kwargs(x),
    )
    return out


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
