"""FP8 matrix-vector products for one-row (batch-1 decode) steps: ``y [1, N] = x [1, K] @ dequant(W)^T +
bias`` with the activation kept in its dtype (Triton + reference).

Three kernels, each bound by reading the FP8 weight once. Two are weight-only over the same inputs
(``_gemv_inputs``: ``x``, with ``gated`` SiLU·mul of ``[gate | up]`` folded into the loads, times the
block scales where the weight has them): ``fp8_gemv``, one program per ``block_n`` output features
walking all of ``K`` (the row-blocked GEMV of ``engine.ops.gemv``), and ``fp8_gemv_splitk``, which splits
``K`` into slices for more programs on narrow matrices and adds the float32 partials in a second kernel.
Both decode the e4m3 weights by integer operations (``e4m3_bits``; ``decode=0`` keeps the hardware
conversion, for comparison): a one-row product does one multiply-add per weight byte, and the conversion
(e4m3 to float16 to float32) made it bound by instruction issue, not memory (H200, 2026-12-04: 40-64 % of
the copy bandwidth converted against 60-77 % decoded, same tiles). The third, ``fp8_gemv_mma``, does no
per-weight arithmetic at all: FP8 tensor cores with the input cut into three e4m3 parts (faster for wide
per-channel matrices only). ``fp8_gemv_tile``, ``fp8_gemv_splitk_tile`` and ``fp8_gemv_mma_tile`` hold
the measured choices; ``fp8_gemv_reference`` is the plain-torch product. Weights and their scale layouts:
``engine.ops.fp8_weight``; ``engine.ops.fp8_gemm.fp8_linear`` picks between these and the w8a8 GEMMs.
"""

from __future__ import annotations

import functools
from typing import Literal

import torch
import triton
import triton.language as tl

from engine.ops.fp8_weight import Fp8Weight, dequantize_fp8
from engine.ops.pdl import gdc_enter, pdl_kwargs
from engine.ops.silu_mul import load_silu_mul, silu_mul_reference

_LAYOUT_CODE = {"tensor": 0, "channel": 1, "block": 2}


@functools.cache
def _device_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


MeasuredGpu = Literal["h100", "h200"]


def measured_gpu(device: torch.device) -> MeasuredGpu:
    """Whose one-row measurements a CUDA ``device`` takes: ``"h100"`` for the H100 SXM ("H100 80GB HBM3",
    the one measured), else ``"h200"`` (where the tiles below were first measured; also what GPUs not
    measured get, the H100 PCIe and NVL included). The two differ where the H100's lower memory bandwidth
    (3.35 against 4.8 TB/s, the same 132 SMs) leaves the decoded GEMV memory-bound rather than bound by
    instruction issue (``fp8_gemv_mma_tile``, ``fp8_gemv_folds_silu``)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return "h100" if "H100 80GB HBM3" in _device_name(index) else "h200"


def fp8_gemv_folds_silu(gpu: MeasuredGpu, layout: str) -> bool:
    """Whether a one-row FP8 down projection takes ``[gate | up]`` and folds SiLU·mul into the GEMV's
    loads (``fp8_gemv(gated=True)``, one kernel) rather than ``silu_mul`` first and the plain GEMV: on an
    H100 for per-channel and per-tensor weights (``bench/kernels/fp8_gemv_sweep.py --candidates``,
    Llama-3-8B down, 2026-12-06: 86.5 % of the copy bandwidth folded against 83.7 % for the two kernels);
    not on an H200 (322.1 against 320.3 tok/s for the two kernels, 2026-12-04) nor for block scales (the
    H100 not measured)."""
    return gpu == "h100" and layout != "block"


# ``e4m3_bits`` decodes a weight as its value times 2**-120; the inputs are multiplied by 2**64 and the sums
# by 2**56, powers of two that change no rounding while every input stays below 2**64 in magnitude (no
# overflow) and every product and partial sum above 2**-70 (no float32 subnormal)
E4M3_X_SCALE = tl.constexpr(18446744073709551616.0)
E4M3_SUM_SCALE = tl.constexpr(72057594037927936.0)


@triton.jit
def e4m3_bits(w):  # type: ignore[no-untyped-def]  # Triton function: arguments are typed by @triton.jit
    """float32 ``value * 2**-120`` of int8-viewed e4m3 weights ``w``, by integer operations alone: the
    sign bit moved to bit 31 and the 7 exponent/mantissa bits to bits 20-26 make a float32 whose exponent
    is the e4m3 exponent re-biased from 7 to 127 (subnormals land on float32 subnormals, which Triton's
    float32 arithmetic keeps). Fewer issue slots than the hardware conversion (e4m3 -> f16 -> f32, module
    docstring). The two NaN codes decode as +-480 (quantized weights never hold them)."""
    v = w.to(tl.int32)  # sign-extended: bits 27-31 copy the sign
    return ((v << 20) & -2014314496).to(tl.float32, bitcast=True)  # mask 0x87F00000


@triton.jit
def _fp8_products(w, x, DECODE: tl.constexpr):  # type: ignore[no-untyped-def]  # Triton function
    """``w * x[None, :]`` in float32 for an FP8 tile ``w`` [BLOCK_N, BLOCK_K]: DECODE 0 converts the
    weights (``w`` typed float8e4nv), DECODE 1 decodes their bits (``w`` typed int8, ``e4m3_bits``) and
    scales ``x`` by 2**64 (the caller multiplies the sums by ``E4M3_SUM_SCALE``)."""
    if DECODE == 1:
        return e4m3_bits(w) * (x * E4M3_X_SCALE)[None, :]
    return w.to(tl.float32) * x[None, :]


@triton.jit
def _gemv_inputs(  # type: ignore[no-untyped-def]  # Triton function: arguments are typed by @triton.jit
    x_ptr, s_row, kk, k_mask, k_in,
    LAYOUT: tl.constexpr, GROUP_K: tl.constexpr, GATED: tl.constexpr,
):
    """The float32 inputs ``kk`` of a one-row FP8 GEMV: ``x`` (with ``GATED``, ``x = [gate | up]`` and
    silu(gate) * up as engine/ops/silu_mul.py rounds it), times the row of block scales for LAYOUT 2."""
    x = load_silu_mul(x_ptr, kk, k_mask, k_in, GATED)
    if LAYOUT == 2:
        x = x * tl.load(s_row + kk // GROUP_K, mask=k_mask, other=0.0)
    return x


@triton.jit
def _scale_bias_store(  # type: ignore[no-untyped-def]  # Triton function: arguments are typed by @triton.jit
    y, rows, mask, s_ptr, b_ptr, y_ptr, LAYOUT: tl.constexpr, HAS_BIAS: tl.constexpr,
):
    """Store the float32 sums ``y`` of output features ``rows``: times their tensor (LAYOUT 0) or channel
    (LAYOUT 1) scale (block scales were applied to the inputs), plus the bias, rounded to ``y_ptr``'s
    dtype."""
    if LAYOUT == 1:
        y = y * tl.load(s_ptr + rows, mask=mask, other=0.0)
    elif LAYOUT == 0:
        y = y * tl.load(s_ptr)
    if HAS_BIAS:
        y = y + tl.load(b_ptr + rows, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _fp8_gemv_kernel(  # type: ignore[no-untyped-def]  # Triton kernel: typed by @triton.jit
    x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, n_out, k_in, stride_w, stride_s,
    LAYOUT: tl.constexpr, GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, HAS_BIAS: tl.constexpr,
    GATED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DECODE: tl.constexpr,
    USE_GDC: tl.constexpr,
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
        acc += _fp8_products(w, x, DECODE)
        w = w_next
    y = tl.sum(acc, axis=1)
    if DECODE == 1:
        y = y * E4M3_SUM_SCALE
    _scale_bias_store(y, rows, row_mask, s_ptr, b_ptr, y_ptr, LAYOUT, HAS_BIAS)


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


def fp8_gemv_tile(n: int, gated: bool = False, layout: str = "channel") -> tuple[int, int, int]:
    """``(block_n, block_k, num_warps)`` of ``fp8_gemv`` for ``N`` output features of a ``layout`` weight:
    the winners of ``bench/kernels/fp8_gemv_sweep.py --candidates`` on an H200 for the Llama-3-8B
    projections with the weights decoded by integer operations (2026-12-04, shares of the same-run copy
    bandwidth): 8 x 1024 for N <= 4096 and the gated form (o 60.3 %, gated down 68.9 %) and for block
    scales below N = 16384 (QKV 59.9 % against 42.9 % at 8 x 512: one scale load per 1024 inputs), else
    8 x 512 (per-channel QKV 60.8 %, gate/up 77.3 %), 4 warps."""
    if gated or n <= 4096 or (layout == "block" and n < 16384):
        return 8, 1024, 4
    return 8, 512, 4


def _weight_operand(w: Fp8Weight, decode: int) -> torch.Tensor:
    """The weight as the kernels read it: e4m3 for DECODE 0, its bytes viewed as int8 for DECODE 1."""
    if decode not in (0, 1):
        raise ValueError(f"decode must be 0 (convert) or 1 (bits), got {decode}")
    return w.weight.view(torch.int8) if decode == 1 else w.weight


def _check_x(name: str, x: torch.Tensor, k: int, gated: bool) -> None:
    """Raise ValueError (naming ``name``) unless ``x`` is a contiguous ``[1, K]`` (``[1, 2 K]`` with
    ``gated``)."""
    if x.dim() != 2 or x.shape != (1, 2 * k if gated else k) or x.stride(1) != 1:
        raise ValueError(f"{name} needs a contiguous x [1, {2 * k if gated else k}], got {tuple(x.shape)}")


def _scale_groups(name: str, w: Fp8Weight, block_n: int) -> tuple[int, int, int]:
    """``(group_n, group_k, block_n)``: the weight's scale block (``(1, 1)`` unless block-scaled) and
    ``block_n`` halved until it divides ``group_n``, so a program's rows share one row of scale tiles.

    Raises:
        ValueError: (naming ``name``) a block layout whose ``block_k`` is not a power of two.
    """
    group_n, group_k = w.block or (1, 1)
    if w.layout == "block":
        if group_k & (group_k - 1):
            raise ValueError(f"{name} needs a power-of-two block_k, got {group_k}")
        while group_n % block_n:
            block_n //= 2
    return group_n, group_k, block_n


def fp8_gemv(x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None,
             tile: tuple[int, int, int] | None = None, gated: bool = False, decode: int = 1) -> torch.Tensor:
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
            or None; tile: override ``fp8_gemv_tile(N, gated, w.layout)`` (powers of two).
        decode: 1 (default) decodes the e4m3 bytes by integer operations (``e4m3_bits``; the inputs,
            block scales applied, must stay below 2**64 in magnitude, and the bits equal the conversion's
            while every product and partial sum is above 2**-70); 0 runs the hardware conversion.

    Returns:
        ``[1, N]`` in ``x.dtype``.

    Raises:
        ValueError: ``x`` of the wrong width or stride, a block layout whose ``block_k`` is not a power
            of two, or ``decode`` not 0 or 1.
    """
    n, k = w.weight.shape
    _check_x("fp8_gemv", x, k, gated)
    y = torch.empty((1, n), dtype=x.dtype, device=x.device)
    block_n, block_k, warps = tile or fp8_gemv_tile(n, gated, w.layout)
    group_n, group_k, block_n = _scale_groups("fp8_gemv", w, block_n)
    scale = w.scale
    _fp8_gemv_kernel[(triton.cdiv(n, block_n),)](
        x, _weight_operand(w, decode), scale, bias if bias is not None else y, y, n, k, w.weight.stride(0),
        scale.stride(0) if scale.dim() == 2 else 0, LAYOUT=_LAYOUT_CODE[w.layout], GROUP_N=group_n,
        GROUP_K=group_k, HAS_BIAS=bias is not None, GATED=gated, BLOCK_N=block_n, BLOCK_K=block_k,
        DECODE=decode, num_warps=warps, **pdl_kwargs(x, "fp8_gemv"))
    return y


@triton.jit
def _fp8_gemv_splitk_kernel(  # type: ignore[no-untyped-def]  # Triton kernel: typed by @triton.jit
    x_ptr, w_ptr, s_ptr, part_ptr, n_out, k_in, k_per_split, stride_w, stride_s,
    LAYOUT: tl.constexpr, GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, GATED: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DECODE: tl.constexpr, USE_GDC: tl.constexpr,
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
        acc += _fp8_products(w, x, DECODE)
    y = tl.sum(acc, axis=1)
    if DECODE == 1:
        y = y * E4M3_SUM_SCALE
    tl.store(part_ptr + tl.program_id(1) * n_out + rows, y, mask=row_mask)


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
    _scale_bias_store(y, rows, mask, s_ptr, b_ptr, y_ptr, LAYOUT, HAS_BIAS)


def fp8_gemv_splitk(x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None,
                    tile: tuple[int, int, int, int] = (4, 512, 4, 4), gated: bool = False,
                    decode: int = 1) -> torch.Tensor:
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
    _check_x("fp8_gemv_splitk", x, k, gated)
    block_n, block_k, warps, split_k = tile
    if block_k < 16 or block_k & (block_k - 1) or split_k < 1:
        raise ValueError(f"fp8_gemv_splitk needs block_k a power of two >= 16 and split_k >= 1, got {tile}")
    group_n, group_k, block_n = _scale_groups("fp8_gemv_splitk", w, block_n)
    k_per_split = triton.cdiv(triton.cdiv(k, split_k), block_k) * block_k
    split_k = triton.cdiv(k, k_per_split)  # no empty slice
    part = torch.empty((split_k, n), dtype=torch.float32, device=x.device)
    y = torch.empty((1, n), dtype=x.dtype, device=x.device)
    scale = w.scale
    _fp8_gemv_splitk_kernel[(triton.cdiv(n, block_n), split_k)](
        x, _weight_operand(w, decode), scale, part, n, k, k_per_split, w.weight.stride(0),
        scale.stride(0) if scale.dim() == 2 else 0, LAYOUT=_LAYOUT_CODE[w.layout], GROUP_N=group_n,
        GROUP_K=group_k, GATED=gated, BLOCK_N=block_n, BLOCK_K=block_k, DECODE=decode, num_warps=warps,
        **pdl_kwargs(x))
    _reduce_partials(part, w, bias, y, x)
    return y


def _reduce_partials(part: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None, y: torch.Tensor,
                     x: torch.Tensor) -> None:
    """Write ``y [1, N]``: the float32 partials ``part [S, N]`` added in slice order, times the weight's
    tensor/channel scales, plus ``bias`` (``_fp8_gemv_splitk_reduce_kernel``)."""
    split_k, n = part.shape
    reduce_block = 256
    _fp8_gemv_splitk_reduce_kernel[(triton.cdiv(n, reduce_block),)](
        part, w.scale, bias if bias is not None else y, y, n, SPLIT_K=split_k, LAYOUT=_LAYOUT_CODE[w.layout],
        HAS_BIAS=bias is not None, BLOCK=reduce_block, num_warps=4, **pdl_kwargs(x))


def fp8_gemv_mma_tile(n: int, layout: str, gated: bool = False,
                      gpu: MeasuredGpu = "h200") -> tuple[int, int, int, int, int] | None:
    """The ``fp8_gemv_mma`` tile of a one-row FP8 step on ``gpu`` (``measured_gpu``), or None where the
    CUDA-core GEMVs are faster: the H200 sweep (``bench/kernels/fp8_gemv_sweep.py --candidates``,
    2026-12-04) found it ahead only for wide per-channel/per-tensor matrices (N >= 16384: gate/up 84.0 % of
    the copy bandwidth in 128 x 256 tiles, 4 warps, 3 stages, one K slice, against 77.8 % for
    ``fp8_gemv``); QKV, o and down 38-54 %, and block scales (chunks of at most one 128-wide scale group)
    56 % against split-K's 72.8 %. On an H100 (2026-12-06) ``fp8_gemv`` wins the wide case too: gate/up
    94.0 % in 8 x 512 tiles against 88.4 % for this tile."""
    if gated or layout == "block" or n < 16384 or gpu == "h100":
        return None
    return 128, 256, 4, 1, 3


def fp8_gemv_splitk_tile(n: int, layout: str, gated: bool = False) -> tuple[int, int, int, int] | None:
    """The split-K tile ``(block_n, block_k, num_warps, split_k)`` of a one-row FP8 step with ``n`` output
    features and weights of ``layout``, or None where ``fp8_gemv`` is faster: the winners of
    ``bench/kernels/fp8_gemv_sweep.py --candidates`` on an H200 for the Llama-3-8B projections (shares of
    the same-run copy bandwidth, 2026-12-04): block scales only, 8 x 512 with 4 warps, 4 slices for
    N <= 4096 (o 47.2 % against 46.5 % for ``fp8_gemv``, 2 slices 48.6 %, within the spread; down after
    ``silu_mul`` 62.5 % against 51.0 %) and 2 for N >= 16384 (gate/up 72.3 % against 67.0 %); QKV-like
    widths, the gated form and every per-channel or per-tensor shape (``fp8_gemv`` 60-77 % there,
    split-K 47-71 %) keep ``fp8_gemv``."""
    if gated or 4096 < n < 16384 or layout != "block":
        return None
    return 8, 512, 4, 4 if n <= 4096 else 2


@triton.jit
def _fp8_gemv_mma_kernel(  # type: ignore[no-untyped-def]  # Triton kernel: typed by @triton.jit
    x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, part_ptr, n_out, k_in, k_per_split, stride_w, stride_s,
    LAYOUT: tl.constexpr, GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, HAS_BIAS: tl.constexpr,
    GATED: tl.constexpr, SPLIT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_GDC: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < n_out
    cols = tl.arange(0, BLOCK_K)
    part_col = tl.arange(0, 16)[None, :]
    k_start = tl.multiple_of(tl.program_id(1) * k_per_split, 16)
    k_end = tl.minimum(k_start + k_per_split, k_in)
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_w
    s_row = s_ptr + ((tl.program_id(0) * BLOCK_N) // GROUP_N) * stride_s
    acc = tl.zeros((BLOCK_N, 16), dtype=tl.float32)
    gdc_enter(USE_GDC)
    for k in range(k_start, k_end, BLOCK_K):
        kk = k + cols
        k_mask = kk < k_end
        x = load_silu_mul(x_ptr, kk, k_mask, k_in, GATED)
        # the chunk scaled by a power of two that puts its largest magnitude in [128, 256), then cut into
        # three e4m3 parts (each the rounding of what the parts before it left): columns 0-2 of the MMA's
        # B operand, zeros in the rest
        e = (tl.max(tl.abs(x), axis=0).to(tl.int32, bitcast=True) >> 23) & 255
        e = tl.minimum(tl.maximum(e, 8), 254)
        xs = x * ((261 - e) << 23).to(tl.float32, bitcast=True)
        back = ((e - 7) << 23).to(tl.float32, bitcast=True)
        if LAYOUT == 2:  # BLOCK_K <= GROUP_K (fp8_gemv_mma checks): one block scale for the chunk's rows
            back = back * tl.load(s_row + k // GROUP_K)
        hi = xs.to(tl.float8e4nv).to(tl.float32)
        mid = (xs - hi).to(tl.float8e4nv).to(tl.float32)
        lo = (xs - hi - mid).to(tl.float8e4nv).to(tl.float32)
        parts = tl.where(part_col == 0, hi[:, None],
                         tl.where(part_col == 1, mid[:, None], tl.where(part_col == 2, lo[:, None], 0.0)))
        w = tl.load(w_rows + kk[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        acc += tl.dot(w, parts.to(tl.float8e4nv)) * back
    y = tl.sum(acc, axis=1)  # columns 3-15 are zero
    if SPLIT:
        tl.store(part_ptr + tl.program_id(1) * n_out + rows, y, mask=row_mask)
    else:
        _scale_bias_store(y, rows, row_mask, s_ptr, b_ptr, y_ptr, LAYOUT, HAS_BIAS)


def fp8_gemv_mma(x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None,
                 tile: tuple[int, int, int, int, int] = (64, 256, 4, 1, 3),
                 gated: bool = False) -> torch.Tensor:
    """``fp8_gemv`` on FP8 tensor cores with no per-weight arithmetic: the weight tile goes to the MMA as
    loaded; the token's inputs, chunk by chunk of ``block_k``, are scaled by a power of two and cut into
    three e4m3 parts (``hi`` the rounding of the scaled input, ``mid`` of what ``hi`` left, ``lo`` of what
    both left: about 12 significant bits for inputs within 2**10 of the chunk's largest, against bf16's
    8), placed in columns 0-2 of a 16-column operand (the smallest MMA width); the float32 sums of the
    three columns are scaled back. Not bit-exact to the weight-only product: the parts drop what lies
    below e4m3's range in a chunk and Hopper's FP8 MMA accumulates with reduced precision inside each
    chunk (about 14 bits, DeepSeek-V3 technical report, section 3.3.2), whose float32 sums are added.
    ``tile = (block_n, block_k, num_warps, split_k, num_stages)``; with ``split_k > 1`` the float32
    partials are added in split order by the reduce kernel of ``fp8_gemv_splitk``; block scales need
    ``block_k`` within one scale group (lowered to it). Same arguments, result and errors as
    ``fp8_gemv_splitk``."""
    n, k = w.weight.shape
    _check_x("fp8_gemv_mma", x, k, gated)
    block_n, block_k, warps, split_k, stages = tile
    if block_k < 32 or block_k & (block_k - 1) or split_k < 1 or block_n < 16:
        raise ValueError(f"fp8_gemv_mma needs block_n >= 16, block_k a power of two >= 32, split_k >= 1, "
                         f"got {tile}")
    group_n, group_k, block_n = _scale_groups("fp8_gemv_mma", w, block_n)
    if w.layout == "block":
        block_k = min(block_k, group_k)
        if block_n < 16 or block_k < 32:
            raise ValueError(f"fp8_gemv_mma needs block scales of >= 16 x 32, got {w.block}")
    k_per_split = triton.cdiv(triton.cdiv(k, split_k), block_k) * block_k
    split_k = triton.cdiv(k, k_per_split)
    y = torch.empty((1, n), dtype=x.dtype, device=x.device)
    part = torch.empty((split_k, n), dtype=torch.float32, device=x.device) if split_k > 1 else y
    scale = w.scale
    _fp8_gemv_mma_kernel[(triton.cdiv(n, block_n), split_k)](
        x, w.weight, scale, bias if bias is not None else y, y, part, n, k, k_per_split, w.weight.stride(0),
        scale.stride(0) if scale.dim() == 2 else 0, LAYOUT=_LAYOUT_CODE[w.layout], GROUP_N=group_n,
        GROUP_K=group_k, HAS_BIAS=bias is not None, GATED=gated, SPLIT=split_k > 1, BLOCK_N=block_n,
        BLOCK_K=block_k, num_warps=warps, num_stages=stages, **pdl_kwargs(x))
    if split_k > 1:
        _reduce_partials(part, w, bias, y, x)
    return y
