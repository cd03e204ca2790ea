"""SwiGLU activation of the fused gate/up projection: ``silu(gate) * up`` (Triton kernel + reference).

SwiGLU (Shazeer, "GLU Variants Improve Transformer", 2020) as in transformers' ``LlamaMLP``:
``down_proj(act_fn(gate_proj(x)) * up_proj(x))`` with ``act_fn = silu``. Here ``gate_proj`` and
``up_proj`` are one GEMM whose output is ``[gate | up]``; this kernel reads both halves once and writes
the product. SiLU is computed in float32 and rounded to the dtype before the multiply, like torch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.ops.pdl import gdc_enter, pdl_kwargs


@triton.jit
def _silu_mul_kernel(  # type: ignore[no-untyped-def]  # Triton kernel: arguments are typed by @triton.jit
    x_ptr, out_ptr, stride_x, stride_o, n_cols,
    BLOCK: tl.constexpr, USE_GDC: tl.constexpr,
):
    gdc_enter(USE_GDC)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + n_cols + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (act * up.to(tl.float32)).to(gate.dtype), mask=mask)


@triton.jit
def load_silu_mul(  # type: ignore[no-untyped-def]  # Triton function: arguments are typed by @triton.jit
    x_ptr, kk, k_mask, k_in, GATED: tl.constexpr,
):
    """The float32 inputs ``kk`` (masked by ``k_mask``) of a one-row product, for the GEMV kernels that
    fold SwiGLU into their loads: ``x[kk]``, or with ``GATED`` (``x = [gate | up]``, halves ``k_in``
    wide) ``silu(gate) * up`` rounded at the same points as ``_silu_mul_kernel``."""
    if GATED:
        gate = tl.load(x_ptr + kk, mask=k_mask, other=0.0)
        g = gate.to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
        up = tl.load(x_ptr + k_in + kk, mask=k_mask, other=0.0).to(tl.float32)
        x = (act * up).to(gate.dtype).to(tl.float32)
    else:
        x = tl.load(x_ptr + kk, mask=k_mask, other=0.0).to(tl.float32)
    return x


def _check(gate_up: torch.Tensor) -> None:
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 or gate_up.stride(1) != 1:
        raise ValueError(f"gate_up must be [T, 2 * I] with a contiguous last dim, got {tuple(gate_up.shape)}")


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate_up[:, :I]) * gate_up[:, I:]`` (Triton).

    Args:
        gate_up: ``[T, 2 * I]`` (the fused gate/up projection's output), last dim contiguous.

    Returns:
        ``[T, I]`` new tensor of ``gate_up``'s dtype.

    Raises:
        ValueError: odd width or a non-contiguous last dim.
    """
    _check(gate_up)
    t, width = gate_up.shape
    out = torch.empty((t, width // 2), dtype=gate_up.dtype, device=gate_up.device)
    if t == 0:
        return out
    block = 1024
    _silu_mul_kernel[(t, triton.cdiv(width // 2, block))](
        gate_up, out, gate_up.stride(0), out.stride(0), width // 2, BLOCK=block, num_warps=4,
        **pdl_kwargs(gate_up),
    )
    return out


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """Plain-torch ``silu_mul`` (transformers' ``LlamaMLP`` arithmetic); same argument and errors."""
    _check(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up
