"""FP8 (e4m3) weight GEMMs: ``y = x @ dequant(W)^T`` with activations quantized to FP8 on the fly (w8a8),
and ``fp8_linear``, which picks the path for a step. Weights and their three scale layouts (``"tensor"``,
``"channel"``, ``"block"``): ``engine.ops.fp8_weight``.

Activations: ``"tensor"`` / ``"channel"`` weights take a static per-tensor ``input_scale`` when the
checkpoint has one, else one scale per token (row), ``amax(|x|) / 448``; ``"block"`` weights take one
scale per token and group of ``block_k`` columns (``quantize_fp8_groups``), as in DeepSeek-V3's
``act_quant``. On CUDA the tensor/channel layouts run ``torch._scaled_mm`` (cuBLASLt FP8 tensor cores;
row-wise scales for per-token activations), the block layout the Triton kernel ``w8a8_block_gemm`` below
(for each ``block_k`` slice of ``K``: an FP8 ``tl.dot`` into float32, times the token-group scale and
the weight tile's scale; the block-scaled GEMM of DeepSeek-V3's ``fp8_gemm``). One-row steps on CUDA run
the one-row products of ``engine.ops.fp8_gemv`` instead (weight-only, or on FP8 tensor cores with the
input in three e4m3 parts for wide per-channel matrices). ``*_reference`` functions are the plain-torch
equivalents: they dequantize both operands to float32 and multiply (what runs on a CPU, where no FP8
matmul exists).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine.ops.fp8_gemv import (
    fp8_gemv,
    fp8_gemv_mma,
    fp8_gemv_mma_tile,
    fp8_gemv_splitk,
    fp8_gemv_splitk_tile,
    measured_gpu,
)
from engine.ops.fp8_weight import (
    FP8_DTYPE,
    FP8_MAX,
    MIN_SCALE,
    Fp8Weight,
    dequantize_fp8,
    quantize_fp8_reference,
)
from engine.ops.silu_mul import silu_mul, silu_mul_reference


def quantize_fp8_groups_reference(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x [M, K]`` per token and group of ``group`` columns (the last group ragged when ``group``
    does not divide ``K``). Returns ``(q float8_e4m3fn [M, K], scales float32 [M, ceil(K / group)])``."""
    m, k = x.shape
    groups = -(-k // group)
    pad = groups * group - k
    xf = torch.nn.functional.pad(x.float(), (0, pad)).view(m, groups, group)
    scale = (xf.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp_min(MIN_SCALE)
    q = (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).view(m, groups * group)[:, :k]
    return q.contiguous(), scale[..., 0]


@triton.jit
def round_to_e4m3(x):  # type: ignore[no-untyped-def]  # Triton helper: typed by @triton.jit
    # float32 x (|x| <= 448) rounded to the nearest e4m3 value, ties to even, in float32 arithmetic: the
    # grid step is 2^(exponent - 3) for normal numbers and 2^-9 below 2^-6; adding and subtracting
    # 1.5 * 2^23 steps rounds to a multiple of the step. The cast to FP8 after it is then exact (Triton
    # 3.6's interpreter rounds 7.9 to 4.0 when the rounding carries into the exponent).
    biased = (x.to(tl.int32, bitcast=True) >> 23) & 0xFF
    step = ((tl.maximum(biased, 121) - 3) << 23).to(tl.float32, bitcast=True)
    magic = step * 12582912.0
    return (x + magic) - magic


@triton.jit
def _quantize_groups_kernel(  # type: ignore[no-untyped-def]  # Triton kernel: typed by @triton.jit
    x_ptr, q_ptr, s_ptr, k_in, stride_x, stride_q, n_groups,
    GROUP: tl.constexpr, BLOCK: tl.constexpr, FP8_MAX_C: tl.constexpr, MIN_SCALE: tl.constexpr,
    GATED: tl.constexpr,
):
    row = tl.program_id(0)
    g = tl.program_id(1)
    cols = g * GROUP + tl.arange(0, BLOCK)
    mask = (tl.arange(0, BLOCK) < GROUP) & (cols < k_in)
    if GATED:  # x = [gate | up]: silu(gate) * up rounded as engine/ops/silu_mul.py rounds it
        gate = tl.load(x_ptr + row.to(tl.int64) * stride_x + cols, mask=mask, other=0.0)
        up = tl.load(x_ptr + row.to(tl.int64) * stride_x + k_in + cols, mask=mask, other=0.0)
        gf = gate.to(tl.float32)
        act = (gf / (1.0 + tl.exp(-gf))).to(gate.dtype).to(tl.float32)
        x = (act * up.to(tl.float32)).to(gate.dtype).to(tl.float32)
    else:
        x = tl.load(x_ptr + row.to(tl.int64) * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), axis=0) / FP8_MAX_C, MIN_SCALE)
    q = round_to_e4m3(tl.clamp(x / scale, -FP8_MAX_C, FP8_MAX_C))
    tl.store(q_ptr + row.to(tl.int64) * stride_q + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row * n_groups + g, scale)


def quantize_fp8_groups(x: torch.Tensor, group: int,
                        gated: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of ``quantize_fp8_groups_reference`` (one program per token and group; ``group=K``
    gives one scale per token). ``x``: ``[M, K]`` with unit column stride; with ``gated``, ``[M, 2 K]``
    (a fused gate/up projection's output) and what is quantized is ``silu(gate) * up`` computed while
    loading, rounded to ``x.dtype`` as ``engine.ops.silu_mul`` rounds it (bit-identical to
    ``quantize_fp8_groups(silu_mul(x), group)``, without writing and re-reading the product)."""
    if x.stride(1) != 1:
        x = x.contiguous()
    m, k = x.shape
    if gated:
        if k % 2:
            raise ValueError(f"gated quantization needs x [M, 2 K] (gate | up), got {tuple(x.shape)}")
        k //= 2
    groups = -(-k // group)
    q = torch.empty((m, k), dtype=FP8_DTYPE, device=x.device)
    s = torch.empty((m, groups), dtype=torch.float32, device=x.device)
    if m:
        block = triton.next_power_of_2(group)
        # ~32 float32 values per thread: a whole row (group=K, up to 16384 wide) in 4 warps would spill
        warps = max(1, min(16, block // 1024))
        _quantize_groups_kernel[(m, groups)](x, q, s, k, x.stride(0), q.stride(0), groups, GROUP=group,
                                             BLOCK=block, FP8_MAX_C=FP8_MAX, MIN_SCALE=MIN_SCALE,
                                             GATED=gated, num_warps=warps)
    return q, s


def w8a8_block_gemm_reference(a: torch.Tensor, a_scale: torch.Tensor, w: Fp8Weight,
                              out_dtype: torch.dtype) -> torch.Tensor:
    """``[M, N]``: dequantized ``a`` (FP8 ``[M, K]`` times ``a_scale [M, ceil(K / bk)]`` per token group)
    times the dequantized block-scaled ``w``, in float32, rounded to ``out_dtype``."""
    assert w.block is not None
    k = a.shape[1]
    af = a.float() * a_scale.float().repeat_interleave(w.block[1], 1)[:, :k]
    return (af @ dequantize_fp8(w).T).to(out_dtype)


@triton.jit
def _w8a8_block_kernel(  # type: ignore[no-untyped-def]  # Triton kernel: typed by @triton.jit
    a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr, m_rows, n_out, k_in, stride_a, stride_as, stride_b, stride_bs,
    stride_c, GROUP_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SWIZZLE_M: tl.constexpr,
):
    # programs in groups of SWIZZLE_M row tiles, column tiles inner: the programs running at once share
    # a few A row tiles and W column tiles in L2 (the grouped ordering of Triton's matmul tutorial)
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(m_rows, BLOCK_M)
    tiles_n = tl.cdiv(n_out, BLOCK_N)
    per_group = SWIZZLE_M * tiles_n
    first_m = (pid // per_group) * SWIZZLE_M
    group_m = tl.minimum(tiles_m - first_m, SWIZZLE_M)
    pid_m = first_m + (pid % per_group) % group_m
    pid_n = (pid % per_group) // group_m
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_mask = rm < m_rows
    n_mask = rn < n_out
    a_rows = a_ptr + rm.to(tl.int64)[:, None] * stride_a
    b_rows = b_ptr + rn.to(tl.int64)[None, :] * stride_b
    as_rows = as_ptr + rm * stride_as
    bs_rows = bs_ptr + (rn // GROUP_N) * stride_bs
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(k_in, BLOCK_K)):  # BLOCK_K == the weight's block_k: one scale per step
        kk = kb * BLOCK_K + rk
        k_mask = kk < k_in
        a = tl.load(a_rows + kk[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_rows + kk[:, None], mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        a_s = tl.load(as_rows + kb, mask=m_mask, other=0.0)
        b_s = tl.load(bs_rows + kb, mask=n_mask, other=0.0)
        acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
    c = c_ptr + rm.to(tl.int64)[:, None] * stride_c + rn[None, :]
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def block_gemm_tile(m: int) -> tuple[int, int, int, int]:
    """``(block_m, block_n, num_warps, num_stages)`` of ``w8a8_block_gemm`` for ``m`` rows: small tiles
    in ``M`` for decode-sized batches (the weight read dominates), 64 x 128 for prefill (the best of
    ``bench/kernels/fp8_gemv_sweep.py --gemm-tokens 8192`` on an H200, 2026-12-02)."""
    if m <= 16:
        return 16, 64, 4, 4
    return (64, 64, 4, 4) if m <= 64 else (64, 128, 4, 4)


def w8a8_block_gemm(a: torch.Tensor, a_scale: torch.Tensor, w: Fp8Weight, out_dtype: torch.dtype,
                    tile: tuple[int, int, int, int] | None = None,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """Triton version of ``w8a8_block_gemm_reference``.

    Args:
        a: ``float8_e4m3fn [M, K]`` (unit column stride); a_scale: float32 ``[M, ceil(K / bk)]``.
        w: a ``"block"`` ``Fp8Weight`` (``block_k`` a power of two >= 16).
        tile: override ``block_gemm_tile(M)``.
        out: where to write the product (``[M, N]`` of ``out_dtype``, unit column stride); a new tensor
            when None.

    Returns:
        ``[M, N]`` in ``out_dtype`` (``out`` when given).

    Raises:
        ValueError: ``out`` of another shape or dtype, or with a column stride other than 1.
    """
    assert w.block is not None and w.layout == "block"
    bn, bk = w.block
    m, k = a.shape
    n = w.out_features
    if out is None:
        out = torch.empty((m, n), dtype=out_dtype, device=a.device)
    elif out.shape != (m, n) or out.dtype != out_dtype or (n > 1 and out.stride(1) != 1):
        raise ValueError(f"out must be [{m}, {n}] {out_dtype} with unit column stride, got "
                         f"{tuple(out.shape)} {out.dtype} strides {out.stride()}")
    if m == 0:
        return out
    block_m, block_n, warps, stages = tile or block_gemm_tile(m)
    scale = w.scale.contiguous()
    a_scale = a_scale.contiguous()
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    _w8a8_block_kernel[grid](a, a_scale, w.weight, scale, out, m, n, k, a.stride(0), a_scale.stride(0),
                             w.weight.stride(0), scale.stride(0), out.stride(0), GROUP_N=bn,
                             BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=bk, SWIZZLE_M=8, num_warps=warps,
                             num_stages=stages)
    return out


@functools.lru_cache(maxsize=16)
def _fp8_tensor_cores(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (8, 9)


def _scaled_mm_ok(x: torch.Tensor, w: Fp8Weight) -> bool:
    """Whether ``torch._scaled_mm`` can run this product: a CUDA device of compute capability >= 8.9 and
    ``K``, ``N`` multiples of 16 (cuBLASLt's FP8 alignment)."""
    if not x.is_cuda or not _fp8_tensor_cores(x.device.index or 0):
        return False
    n, k = w.weight.shape
    return k % 16 == 0 and n % 16 == 0


def scaled_fp8_linear_reference(x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None) -> torch.Tensor:
    """Tensor/channel layouts in plain torch: quantize ``x [M, K]`` (static ``input_scale`` or per
    token), dequantize both, multiply in float32, add ``bias``; ``[M, N]`` in ``x.dtype``."""
    q, s = quantize_fp8_reference(x, w.input_scale)
    y = (q.float() * s) @ dequantize_fp8(w).T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def _scaled_fp8_linear(x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None,
                       gated: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
    m = x.shape[0]
    if gated and w.input_scale is None:  # SiLU·mul folded into the per-token quantizer
        q, s = quantize_fp8_groups(x, x.shape[1] // 2, gated=True)
        return _scaled_mm_rowwise(q, s, w, bias, x.dtype, out)
    if gated:
        x = silu_mul(x)
    if w.input_scale is not None and w.layout == "tensor":  # both per-tensor: cuBLASLt tensor-wise mode
        q = (x.float() / w.input_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        y = torch._scaled_mm(q, w.weight.t(), scale_a=w.input_scale, scale_b=w.scale, out_dtype=x.dtype)
        return _into(y + bias if bias is not None else y, out)
    if w.input_scale is not None:
        q = (x.float() / w.input_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        s = w.input_scale.expand(m, 1).contiguous()
    else:
        q, s = quantize_fp8_groups(x, x.shape[1])  # one scale per token
    return _scaled_mm_rowwise(q, s, w, bias, x.dtype, out)


def _into(y: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """``y``, copied into ``out`` when given (a product computed where it could not be written there)."""
    return out.copy_(y) if out is not None else y


def _scaled_mm_rowwise(q: torch.Tensor, s: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None,
                       dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    w_s = w.scale.expand(w.out_features) if w.layout == "tensor" else w.scale
    scale_b = w_s.reshape(1, -1).contiguous()
    # row-wise scaling needs bf16 output; the bias is added after (in the output dtype)
    if out is not None and dtype == torch.bfloat16:
        torch._scaled_mm(q, w.weight.t(), scale_a=s, scale_b=scale_b, out_dtype=torch.bfloat16, out=out)
        return out.add_(bias) if bias is not None else out
    y = torch._scaled_mm(q, w.weight.t(), scale_a=s, scale_b=scale_b, out_dtype=torch.bfloat16)
    y = y.to(dtype)
    return _into(y + bias if bias is not None else y, out)


@dataclass(frozen=True)
class Fp8Activation:
    """Activations already quantized the way ``fp8_linear`` would quantize them for a per-token-scaled
    ``torch._scaled_mm`` (``engine.ops.rms_norm.rms_norm_fp8`` makes them).

    Attributes:
        q: float8_e4m3fn ``[M, K]``, row-major.
        scale: float32 ``[M, 1]``, one scale per token.
        dtype: the dtype of the activations they stand for, which the product is returned in.
    """

    q: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype


def takes_fp8_activation(x: torch.Tensor, w: Fp8Weight) -> bool:
    """Whether ``fp8_linear(x, w, ..., use_kernels=True)`` would quantize ``x`` per token for
    ``torch._scaled_mm`` (more than one row on a GPU that runs it, a tensor- or channel-scaled weight with
    no static ``input_scale``), so an ``Fp8Activation`` of ``x`` can be given to ``fp8_linear_quantized``
    instead, with the same result."""
    return (x.shape[0] > 1 and w.layout in ("tensor", "channel") and w.input_scale is None
            and _scaled_mm_ok(x, w))


def fp8_linear_quantized(a: Fp8Activation, w: Fp8Weight, bias: torch.Tensor | None,
                         out: torch.Tensor | None = None) -> torch.Tensor:
    """``fp8_linear`` of activations already quantized per token (``takes_fp8_activation``): one
    ``torch._scaled_mm``; ``[M, N]`` in ``a.dtype``, written into ``out`` (contiguous ``[M, N]``) when
    given."""
    return _scaled_mm_rowwise(a.q, a.scale, w, bias, a.dtype, out)


def fp8_linear(x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None, use_kernels: bool,
               gated: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x [M, K] @ dequant(w)^T + bias`` as ``[M, N]`` in ``x.dtype``, activations quantized to FP8.

    ``use_kernels``: on CUDA a one-row ``x`` runs the weight-only ``fp8_gemv`` (``fp8_gemv_mma`` where
    ``fp8_gemv_mma_tile`` names a tile, ``fp8_gemv_splitk`` where ``fp8_gemv_splitk_tile`` does);
    otherwise the Triton block kernel (CUDA or Triton's interpreter) and, on a GPU of compute capability
    >= 8.9, ``torch._scaled_mm``; without ``use_kernels`` (or where ``_scaled_mm`` cannot run the shape) the
    plain-torch references. ``gated``: ``x`` is ``[M, 2 K]`` (gate | up, SwiGLU's down projection) and
    the product is taken with ``silu(gate) * up``: folded into the GEMV's loads or the dynamic activation
    quantizer where the kernels run (bit-identical to ``silu_mul`` first), ``silu_mul_reference`` first
    otherwise. ``out``: a contiguous ``[M, N]`` of ``x``'s dtype the product is written into (by the block
    kernel and by row-scaled bf16 ``torch._scaled_mm`` themselves, copied there by the other paths);
    returned.
    """
    if use_kernels and x.is_cuda and x.shape[0] == 1:
        mma = fp8_gemv_mma_tile(w.weight.shape[0], w.layout, gated, measured_gpu(x.device))
        if mma is not None:
            return _into(fp8_gemv_mma(x.contiguous(), w, bias, tile=mma), out)
        tile = fp8_gemv_splitk_tile(w.weight.shape[0], w.layout, gated)
        if tile is not None:
            return _into(fp8_gemv_splitk(x.contiguous(), w, bias, tile=tile), out)
        return _into(fp8_gemv(x.contiguous(), w, bias, gated=gated), out)
    if w.layout == "block":
        assert w.block is not None
        if use_kernels:
            q, s = quantize_fp8_groups(x, w.block[1], gated=gated)
            y = w8a8_block_gemm(q, s, w, x.dtype, out=out)
            return y.add_(bias) if bias is not None else y
        q, s = quantize_fp8_groups_reference(silu_mul_reference(x) if gated else x, w.block[1])
        y = w8a8_block_gemm_reference(q, s, w, x.dtype)
        return _into(y + bias if bias is not None else y, out)
    if use_kernels and _scaled_mm_ok(x, w):
        return _scaled_fp8_linear(x, w, bias, gated, out)
    return _into(scaled_fp8_linear_reference(silu_mul_reference(x) if gated else x, w, bias), out)
