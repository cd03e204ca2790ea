"""FP8 (e4m3) weight GEMMs: ``y = x @ dequant(W)^T`` with activations quantized to FP8 on the fly (w8a8).

Three weight-scale layouts, all for a ``float8_e4m3fn`` weight ``W [N, K]`` (``Fp8Weight``):

- ``"tensor"``: one float32 scale for the whole matrix (``scale [1]``), ``W_real = W * scale``;
- ``"channel"``: one scale per output feature (``scale [N]``);
- ``"block"``: one scale per ``block_n x block_k`` tile (``scale [ceil(N / block_n), ceil(K / block_k)]``,
  the last row/column of tiles ragged when ``N`` or ``K`` is not a multiple), the layout of the DeepSeek-V3,
  Qwen3-FP8 and GLM-4.5-FP8 releases (their ``weight_scale_inv`` tensors multiply, despite the name).

Activations: ``"tensor"`` / ``"channel"`` weights take a static per-tensor ``input_scale`` when the
checkpoint has one, else one scale per token (row), ``amax(|x|) / 448``; ``"block"`` weights take one
scale per token and group of ``block_k`` columns (``quantize_fp8_groups``), as in DeepSeek-V3's
``act_quant``. On CUDA the tensor/channel layouts run ``torch._scaled_mm`` (cuBLASLt FP8 tensor cores;
row-wise scales for per-token activations), the block layout the Triton kernel ``w8a8_block_gemm`` below
(for each ``block_k`` slice of ``K``: an FP8 ``tl.dot`` into float32, times the token-group scale and
the weight tile's scale; the block-scaled GEMM of DeepSeek-V3's ``fp8_gemm``). ``*_reference`` functions
are the plain-torch equivalents: they dequantize both operands to float32 and multiply (what runs on a
CPU, where no FP8 matmul exists).

FP8 e4m3: 3 mantissa bits, largest finite value 448 (``FP8_MAX``); rounding to it is to nearest-even.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine.ops.pdl import gdc_enter, pdl_kwargs
from engine.ops.silu_mul import silu_mul, silu_mul_reference

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
# the smallest scale used: an all-zero group quantizes to zeros instead of dividing by zero
_MIN_SCALE = 1e-12


@dataclass
class Fp8Weight:
    """An FP8 weight with its scales. ``weight``: ``float8_e4m3fn [N, K]``; ``scale``: float32, ``[1]``
    (``layout="tensor"``), ``[N]`` (``"channel"``) or ``[ceil(N / bn), ceil(K / bk)]`` (``"block"``, with
    ``block = (bn, bk)``); ``input_scale``: a float32 ``[1]`` static activation scale, or None (dynamic
    per-token / per-token-group scales)."""

    weight: torch.Tensor
    scale: torch.Tensor
    layout: str
    block: tuple[int, int] | None = None
    input_scale: torch.Tensor | None = None

    def __post_init__(self) -> None:
        n, k = self.weight.shape
        if self.weight.dtype != FP8_DTYPE:
            raise ValueError(f"FP8 weight must be {FP8_DTYPE}, got {self.weight.dtype}")
        if self.layout == "block":
            if self.block is None:
                raise ValueError("block layout needs block=(block_n, block_k)")
            bn, bk = self.block
            want: tuple[int, ...] = (-(-n // bn), -(-k // bk))
            if self.input_scale is not None:
                raise ValueError("block-scaled FP8 weights take dynamic activation scales only")
        elif self.layout == "channel":
            want = (n,)
        elif self.layout == "tensor":
            want = (1,)
        else:
            raise ValueError(f"unknown FP8 scale layout {self.layout!r}; use tensor, channel or block")
        if tuple(self.scale.shape) != want:
            raise ValueError(f"{self.layout} FP8 scale of a [{n}, {k}] weight must be {list(want)}, "
                             f"got {list(self.scale.shape)}")

    @property
    def out_features(self) -> int:
        return int(self.weight.shape[0])

    def nbytes(self) -> int:
        """Bytes a GEMM reads for this weight: FP8 values plus scales."""
        extra = self.input_scale.numel() * 4 if self.input_scale is not None else 0
        return self.weight.numel() + self.scale.numel() * 4 + extra


def quantize_fp8_reference(x: torch.Tensor, scale: torch.Tensor | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x [..., K]`` with a given per-tensor ``scale [1]`` or, when None, one scale per
    ``[..., :]`` row (``amax / 448``). Returns ``(q float8_e4m3fn, scale float32 [1] or [rows, 1])``."""
    xf = x.float()
    if scale is None:
        scale = (xf.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp_min(_MIN_SCALE)
    q = (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale.float()


def quantize_fp8_groups_reference(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x [M, K]`` per token and group of ``group`` columns (the last group ragged when ``group``
    does not divide ``K``). Returns ``(q float8_e4m3fn [M, K], scales float32 [M, ceil(K / group)])``."""
    m, k = x.shape
    groups = -(-k // group)
    pad = groups * group - k
    xf = torch.nn.functional.pad(x.float(), (0, pad)).view(m, groups, group)
    scale = (xf.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp_min(_MIN_SCALE)
    q = (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).view(m, groups * group)[:, :k]
    return q.contiguous(), scale[..., 0]


@triton.jit
def _round_to_e4m3(x):  # type: ignore[no-untyped-def]  # Triton helper: typed by @triton.jit
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
    q = _round_to_e4m3(tl.clamp(x / scale, -FP8_MAX_C, FP8_MAX_C))
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
                                             BLOCK=block, FP8_MAX_C=FP8_MAX, MIN_SCALE=_MIN_SCALE,
                                             GATED=gated, num_warps=warps)
    return q, s


def dequantize_fp8(w: Fp8Weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``W * scale`` as a ``[N, K]`` tensor of ``dtype`` (float32 arithmetic, then rounded once)."""
    wf = w.weight.float()
    n, k = wf.shape
    if w.layout == "block":
        assert w.block is not None
        bn, bk = w.block
        s = w.scale.float().repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
        return (wf * s).to(dtype)
    if w.layout == "channel":
        return (wf * w.scale.float()[:, None]).to(dtype)
    return (wf * w.scale.float()).to(dtype)


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
                    tile: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """Triton version of ``w8a8_block_gemm_reference``.

    Args:
        a: ``float8_e4m3fn [M, K]`` (unit column stride); a_scale: float32 ``[M, ceil(K / bk)]``.
        w: a ``"block"`` ``Fp8Weight`` (``block_k`` a power of two >= 16).
        tile: override ``block_gemm_tile(M)``.

    Returns:
        ``[M, N]`` in ``out_dtype``.
    """
    assert w.block is not None and w.layout == "block"
    bn, bk = w.block
    m, k = a.shape
    n = w.out_features
    out = torch.empty((m, n), dtype=out_dtype, device=a.device)
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
                       gated: bool = False) -> torch.Tensor:
    m = x.shape[0]
    if gated and w.input_scale is None:  # SiLU·mul folded into the per-token quantizer
        q, s = quantize_fp8_groups(x, x.shape[1] // 2, gated=True)
        return _scaled_mm_rowwise(q, s, w, bias, x.dtype)
    if gated:
        x = silu_mul(x)
    if w.input_scale is not None and w.layout == "tensor":  # both per-tensor: cuBLASLt tensor-wise mode
        q = (x.float() / w.input_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        out = torch._scaled_mm(q, w.weight.t(), scale_a=w.input_scale, scale_b=w.scale, out_dtype=x.dtype)
        return out + bias if bias is not None else out
    if w.input_scale is not None:
        q = (x.float() / w.input_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        s = w.input_scale.expand(m, 1).contiguous()
    else:
        q, s = quantize_fp8_groups(x, x.shape[1])  # one scale per token
    return _scaled_mm_rowwise(q, s, w, bias, x.dtype)


def _scaled_mm_rowwise(q: torch.Tensor, s: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None,
                       dtype: torch.dtype) -> torch.Tensor:
    w_s = w.scale.expand(w.out_features) if w.layout == "tensor" else w.scale
    # row-wise scaling needs bf16 output; the bias is added after (in the output dtype)
    y = torch._scaled_mm(q, w.weight.t(), scale_a=s, scale_b=w_s.reshape(1, -1).contiguous(),
                         out_dtype=torch.bfloat16)
    y = y.to(dtype)
    return y + bias if bias is not None else y


_LAYOUT_CODE = {"tensor": 0, "channel": 1, "block": 2}


@triton.jit
def _gemv_inputs(  # type: ignore[no-untyped-def]  # Triton function: arguments are typed by @triton.jit
    x_ptr, s_row, kk, k_mask, k_in,
    LAYOUT: tl.constexpr, GROUP_K: tl.constexpr, GATED: tl.constexpr,
):
    """The float32 inputs ``kk`` of a one-row FP8 GEMV: ``x`` (with ``GATED``, ``x = [gate | up]`` and
    silu(gate) * up as engine/ops/silu_mul.py rounds it), times the row of block scales for LAYOUT 2."""
    if GATED:
        gate = tl.load(x_ptr + kk, mask=k_mask, other=0.0)
        g = gate.to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
        up = tl.load(x_ptr + k_in + kk, mask=k_mask, other=0.0).to(tl.float32)
        x = (act * up).to(gate.dtype).to(tl.float32)
    else:
        x = tl.load(x_ptr + kk, mask=k_mask, other=0.0).to(tl.float32)
    if LAYOUT == 2:
        x = x * tl.load(s_row + kk // GROUP_K, mask=k_mask, other=0.0)
    return x


@triton.jit
def _fp8_gemv_kernel(  # type: ignore[no-untyped-def]  # Triton kernel: typed by @triton.jit
    x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, n_out, k_in, stride_w, stride_s,
    LAYOUT: tl.constexpr, GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, HAS_BIAS: tl.constexpr,
    GATED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_GDC: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < n_out
    cols = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_w
    # block scales: BLOCK_N divides GROUP_N (fp8_gemv checks), so every row of this program is in one row
    # of scale tiles and the scales multiply x (per input, not per weight)
    s_row = s_ptr + ((tl.program_id(0) * BLOCK_N) // GROUP_N) * stride_s
    # the first weight tile before waiting for the kernel that produces x (weights are never written
    # during a step: engine/ops/pdl.py); each iteration then loads the next tile before its FMA
    w = tl.load(w_rows + cols[None, :], mask=row_mask[:, None] & (cols < k_in)[None, :], other=0.0)
    gdc_enter(USE_GDC)
    for k in range(0, k_in, BLOCK_K):
        kk = k + cols
        k_mask = kk < k_in
        x = _gemv_inputs(x_ptr, s_row, kk, k_mask, k_in, LAYOUT, GROUP_K, GATED)
        nk = kk + BLOCK_K
        w_next = tl.load(w_rows + nk[None, :], mask=row_mask[:, None] & (nk < k_in)[None, :], other=0.0)
        acc += w.to(tl.float32) * x[None, :]
        w = w_next
    y = tl.sum(acc, axis=1)
    if LAYOUT == 1:
        y = y * tl.load(s_ptr + rows, mask=row_mask, other=0.0)
    elif LAYOUT == 0:
        y = y * tl.load(s_ptr)
    if HAS_BIAS:
        y = y + tl.load(b_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=row_mask)


def fp8_gemv_reference(x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None,
                       gated: bool = False) -> torch.Tensor:
    """One-row product with the activation kept in its dtype (weight-only FP8): ``x [1, K]`` (with
    ``gated``: ``[1, 2 K]`` = gate | up, first ``silu_mul_reference``) times the dequantized ``w`` in
    float32, plus ``bias``; ``[1, N]`` in ``x.dtype``."""
    if gated:
        x = silu_mul_reference(x)
    y = x.float() @ dequantize_fp8(w).T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


# bytes of FP8 weight one program reads per K step (block_n * block_k): the bf16 GEMV's measured best
# tiles (engine.ops.gemv.gemv_tile) at the same bytes, i.e. twice the K width at one byte per weight, with
# at most 64 float32 partial sums per thread (8 warps for the 16 KiB gated tile)
def fp8_gemv_tile(n: int, gated: bool = False) -> tuple[int, int, int]:
    """``(block_n, block_k, num_warps)`` of ``fp8_gemv`` for ``N`` output features: the winners of
    ``bench/kernels/fp8_gemv_sweep.py`` on an H200 for the Llama-3-8B projections (2026-12-02): 4 x 2048
    for the gated down projection, 8 x 512 for N <= 4096, 16 x 512 for wider matrices (4 warps)."""
    if gated:
        return 4, 2048, 4
    if n <= 4096:
        return 8, 512, 4
    return 16, 512, 4


def fp8_gemv(x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None,
             tile: tuple[int, int, int] | None = None, gated: bool = False) -> torch.Tensor:
    """Triton version of ``fp8_gemv_reference`` for one-row decode steps, bound by reading the FP8 weight
    once (weight-only: the activation is not quantized, which only makes the step more exact than the
    w8a8 path of larger batches). Each program owns ``block_n`` features and walks ``K`` with float32
    accumulation (the row-blocked GEMV of ``engine.ops.gemv``); tensor/channel scales multiply each
    feature's sum at the end; block scales multiply ``x`` per input (one scale per ``block_k`` inputs:
    ``block_n`` is lowered to a power of two dividing ``block_n`` of the weight's blocks so a program's
    rows share a row of scale tiles). ``gated``: ``x`` is ``[1, 2 K]`` (gate | up) and SiLU·mul is
    computed while loading, as ``engine.ops.gemv(gated=True)``. The first weight tile is loaded before
    the wait for the kernel producing ``x`` (programmatic dependent launch, engine/ops/pdl.py).

    Args:
        x: ``[1, K]`` (``[1, 2 K]`` with ``gated``), contiguous; w: ``Fp8Weight [N, K]``; bias ``[N]``
            or None; tile: override ``fp8_gemv_tile(N, gated)`` (powers of two).

    Returns:
        ``[1, N]`` in ``x.dtype``.

    Raises:
        ValueError: ``x`` of the wrong width or stride, or a block layout whose ``block_k`` is not a
            power of two.
    """
    n, k = w.weight.shape
    if x.dim() != 2 or x.shape != (1, 2 * k if gated else k) or x.stride(1) != 1:
        raise ValueError(f"fp8_gemv needs a contiguous x [1, {2 * k if gated else k}], got {tuple(x.shape)}")
    y = torch.empty((1, n), dtype=x.dtype, device=x.device)
    block_n, block_k, warps = tile or fp8_gemv_tile(n, gated)
    group_n, group_k = w.block or (1, 1)
    if w.layout == "block":
        if group_k & (group_k - 1):
            raise ValueError(f"fp8_gemv needs a power-of-two block_k, got {group_k}")
        while group_n % block_n:
            block_n //= 2
    scale = w.scale
    _fp8_gemv_kernel[(triton.cdiv(n, block_n),)](
        x, w.weight, scale, bias if bias is not None else y, y, n, k, w.weight.stride(0),
        scale.stride(0) if scale.dim() == 2 else 0, LAYOUT=_LAYOUT_CODE[w.layout], GROUP_N=group_n,
        GROUP_K=group_k, HAS_BIAS=bias is not None, GATED=gated, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=warps, **pdl_kwargs(x))
    return y


@triton.jit
def _fp8_gemv_splitk_kernel(  # type: ignore[no-untyped-def]  # Triton kernel: typed by @triton.jit
    x_ptr, w_ptr, s_ptr, part_ptr, n_out, k_in, k_per_split, stride_w, stride_s,
    LAYOUT: tl.constexpr, GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, GATED: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_GDC: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < n_out
    cols = tl.arange(0, BLOCK_K)
    # k_per_split is a multiple of BLOCK_K (>= 16): each row's slice starts 16-byte aligned, so a thread's
    # contiguous run of the row loads as one 16-byte vector
    k_start = tl.multiple_of(tl.program_id(1) * k_per_split, 16)
    k_end = tl.minimum(k_start + k_per_split, k_in)
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_w
    s_row = s_ptr + ((tl.program_id(0) * BLOCK_N) // GROUP_N) * stride_s
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    gdc_enter(USE_GDC)
    for k in range(k_start, k_end, BLOCK_K):
        kk = k + cols
        k_mask = kk < k_end
        x = _gemv_inputs(x_ptr, s_row, kk, k_mask, k_in, LAYOUT, GROUP_K, GATED)
        w = tl.load(w_rows + kk[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        acc += w.to(tl.float32) * x[None, :]
    tl.store(part_ptr + tl.program_id(1) * n_out + rows, tl.sum(acc, axis=1), mask=row_mask)


@triton.jit
def _fp8_gemv_splitk_reduce_kernel(  # type: ignore[no-untyped-def]  # Triton kernel: typed by @triton.jit
    part_ptr, s_ptr, b_ptr, y_ptr, n_out,
    SPLIT_K: tl.constexpr, LAYOUT: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr,
    USE_GDC: tl.constexpr,
):
    gdc_enter(USE_GDC)
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = rows < n_out
    y = tl.zeros((BLOCK,), dtype=tl.float32)
    for split in tl.static_range(SPLIT_K):  # fixed order: deterministic
        y += tl.load(part_ptr + split * n_out + rows, mask=mask, other=0.0)
    if LAYOUT == 1:
        y = y * tl.load(s_ptr + rows, mask=mask, other=0.0)
    elif LAYOUT == 0:
        y = y * tl.load(s_ptr)
    if HAS_BIAS:
        y = y + tl.load(b_ptr + rows, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=mask)


def fp8_gemv_splitk(x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None,
                    tile: tuple[int, int, int, int] = (4, 512, 4, 4), gated: bool = False) -> torch.Tensor:
    """Split-K variant of ``fp8_gemv`` (same arguments and result, ``fp8_gemv_reference``); ``fp8_linear``
    runs it for one-row steps where ``fp8_gemv_splitk_tile`` names a tile.

    ``tile = (block_n, block_k, num_warps, split_k)``: the grid is ``(ceil(N / block_n), split_k)``; each
    program sums ``block_n`` rows over one of ``split_k`` equal K slices (a multiple of ``block_k``, so
    every slice starts 16-byte aligned and each thread reads contiguous 16-byte runs of a row), writing
    float32 partials ``[split_k, N]``; a second kernel adds the partials in split order (deterministic),
    applies tensor/channel scales and the bias and rounds to ``x.dtype``. More programs per matrix than
    ``fp8_gemv`` for the narrow projections (N = 4096: 512 programs of 8 rows become 4096 of 4 rows x 4
    slices) at the cost of ``split_k * N * 4`` bytes of partials written and read again. Split-K GEMV as
    in "Stream-K" / split-K GEMMs (CUTLASS); block scales as ``fp8_gemv`` (``block_n`` lowered to divide
    the weight's ``block_n``).

    Raises:
        ValueError: as ``fp8_gemv``; ``block_k`` not a power of two >= 16, or ``split_k < 1``.
    """
    n, k = w.weight.shape
    if x.dim() != 2 or x.shape != (1, 2 * k if gated else k) or x.stride(1) != 1:
        raise ValueError(f"fp8_gemv_splitk needs a contiguous x [1, {2 * k if gated else k}], "
                         f"got {tuple(x.shape)}")
    block_n, block_k, warps, split_k = tile
    if block_k < 16 or block_k & (block_k - 1) or split_k < 1:
        raise ValueError(f"fp8_gemv_splitk needs block_k a power of two >= 16 and split_k >= 1, got {tile}")
    group_n, group_k = w.block or (1, 1)
    if w.layout == "block":
        if group_k & (group_k - 1):
            raise ValueError(f"fp8_gemv_splitk needs a power-of-two block_k, got {group_k}")
        while group_n % block_n:
            block_n //= 2
    k_per_split = triton.cdiv(triton.cdiv(k, split_k), block_k) * block_k
    split_k = triton.cdiv(k, k_per_split)  # no empty slice
    part = torch.empty((split_k, n), dtype=torch.float32, device=x.device)
    y = torch.empty((1, n), dtype=x.dtype, device=x.device)
    scale = w.scale
    _fp8_gemv_splitk_kernel[(triton.cdiv(n, block_n), split_k)](
        x, w.weight, scale, part, n, k, k_per_split, w.weight.stride(0),
        scale.stride(0) if scale.dim() == 2 else 0, LAYOUT=_LAYOUT_CODE[w.layout], GROUP_N=group_n,
        GROUP_K=group_k, GATED=gated, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, **pdl_kwargs(x))
    reduce_block = 256
    _fp8_gemv_splitk_reduce_kernel[(triton.cdiv(n, reduce_block),)](
        part, scale, bias if bias is not None else y, y, n, SPLIT_K=split_k, LAYOUT=_LAYOUT_CODE[w.layout],
        HAS_BIAS=bias is not None, BLOCK=reduce_block, num_warps=4, **pdl_kwargs(x))
    return y


def fp8_gemv_splitk_tile(n: int, layout: str, gated: bool = False) -> tuple[int, int, int, int] | None:
    """The split-K tile ``(block_n, block_k, num_warps, split_k)`` of a one-row FP8 step with ``n`` output
    features and weights of ``layout``, or None where ``fp8_gemv`` is faster: the winners of
    ``bench/kernels/fp8_gemv_sweep.py --candidates`` on an H200 for the Llama-3-8B projections
    (2026-12-02, shares of the same-run copy bandwidth, against ``fp8_gemv``'s tile): 8 x 512 with 4 warps
    for N <= 4096 (per channel 2 slices: o 51.8 % against 48.2 %, down 62.7 % against 47.1 %; block
    scales 4 slices: o 48.8 % against 45.4 %, down 59.2 % against 37.2 %) and N >= 16384 (2 slices: gate/up
    74.6 % against 65.8 % per channel, 76.5 % against 63.2 % block); QKV (N 6144) stays on ``fp8_gemv``
    (61.3 % / 58.2 %). The gated form (SiLU·mul folded in) keeps ``fp8_gemv``."""
    if gated or 4096 < n < 16384:
        return None
    return 8, 512, 4, 4 if layout == "block" and n <= 4096 else 2


def fp8_linear(x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None, use_kernels: bool,
               gated: bool = False) -> torch.Tensor:
    """``x [M, K] @ dequant(w)^T + bias`` as ``[M, N]`` in ``x.dtype``, activations quantized to FP8.

    ``use_kernels``: on CUDA a one-row ``x`` runs the weight-only ``fp8_gemv`` (``fp8_gemv_splitk`` where
    ``fp8_gemv_splitk_tile`` names a tile); otherwise the Triton block
    kernel (CUDA or Triton's interpreter) and, on a GPU of compute capability >= 8.9,
    ``torch._scaled_mm``; without ``use_kernels`` (or where ``_scaled_mm`` cannot run the shape) the
    plain-torch references. ``gated``: ``x`` is ``[M, 2 K]`` (gate | up, SwiGLU's down projection) and
    the product is taken with ``silu(gate) * up``: folded into the GEMV's loads or the dynamic activation
    quantizer where the kernels run (bit-identical to ``silu_mul`` first), ``silu_mul_reference`` first
    otherwise.
    """
    if use_kernels and x.is_cuda and x.shape[0] == 1:
        tile = fp8_gemv_splitk_tile(w.weight.shape[0], w.layout, gated)
        if tile is not None:
            return fp8_gemv_splitk(x.contiguous(), w, bias, tile=tile)
        return fp8_gemv(x.contiguous(), w, bias, gated=gated)
    if w.layout == "block":
        assert w.block is not None
        if use_kernels:
            q, s = quantize_fp8_groups(x, w.block[1], gated=gated)
            y = w8a8_block_gemm(q, s, w, x.dtype)
        else:
            q, s = quantize_fp8_groups_reference(silu_mul_reference(x) if gated else x, w.block[1])
            y = w8a8_block_gemm_reference(q, s, w, x.dtype)
        return y + bias if bias is not None else y
    if use_kernels and _scaled_mm_ok(x, w):
        return _scaled_fp8_linear(x, w, bias, gated)
    return scaled_fp8_linear_reference(silu_mul_reference(x) if gated else x, w, bias)


def quantize_weight_per_channel(weight: torch.Tensor) -> Fp8Weight:
    """``weight [N, K]`` (any float dtype) as FP8 with one scale per output feature (``amax / 448``),
    dynamic per-token activations: what ``--quantization fp8`` does to each projection on load."""
    q, s = quantize_fp8_reference(weight)
    return Fp8Weight(q, s[:, 0].contiguous(), "channel")


def quantize_weight_blocks(weight: torch.Tensor, block: tuple[int, int] = (128, 128)) -> Fp8Weight:
    """``weight [N, K]`` as FP8 with one scale per ``block`` tile (``amax / 448`` of the tile; ragged edge
    tiles take the amax of the values they hold), the layout of block-scaled FP8 checkpoints."""
    n, k = weight.shape
    bn, bk = block
    nb, kb = -(-n // bn), -(-k // bk)
    wf = torch.nn.functional.pad(weight.float(), (0, kb * bk - k, 0, nb * bn - n))
    tiles = wf.view(nb, bn, kb, bk)
    scale = (tiles.abs().amax(dim=(1, 3)) / FP8_MAX).clamp_min(_MIN_SCALE)  # [nb, kb]
    q = (tiles / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return Fp8Weight(q.view(nb * bn, kb * bk)[:n, :k].contiguous(), scale, "block", block)
