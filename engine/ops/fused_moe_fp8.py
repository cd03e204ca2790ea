"""FP8 (e4m3) expert weights for ``engine.ops.fused_moe``: their scales, quantization and dequantization.

Weight-only FP8: a stacked expert weight ``W [E, N, K]`` is stored as float8_e4m3fn ``Q`` with float32
scales, ``W ~ Q * scale``, either one scale per output row (``block`` None: ``scale [E, N]``, what
``--quantization fp8`` makes) or one per ``(bn, bk)`` tile (``scale [E, ceil(N / bn), ceil(K / bk)]``, the
``weight_scale_inv`` tensors of block-scaled FP8 checkpoints such as Qwen3-30B-A3B-FP8 and
GLM-4.5-Air-FP8). ``fused_moe``'s kernels read the FP8 weights and dequantize in registers, loading
each scale once per weight tile (block scales: once per tile and chunk of inputs), never once per weight:

- grouped kernels, block scales: per weight tile before the products (``float32(Q) * scale`` rounded to
  the activations' dtype, exactly what ``dequantize_experts`` computes; ``moe_tile`` keeps a tile's
  inputs inside one column of scale tiles);
- matrix-vector kernels, block scales: multiplied into the activations, one scale per (row of scale
  tiles, chunk of inputs under one scale) as ``engine.ops.fp8_gemv`` does, the products of the e4m3
  values and the scaled float32 activations summed in float32 (``fused_moe_gemv.gemv_scale_tile`` keeps
  a program's outputs in one row of scale tiles and its chunks in one column); a dequantized weight is
  never rounded to the dtype;
- per-row scales (both paths): once per output after its float32 sum (e4m3 values are exact in
  fp16/bf16, so the products are exact).

Where the scale is not applied to the weight, only its placement differs from the dequantized weights:
at most one rounding of each weight to the dtype. Either way the result is ``fused_moe_reference`` of the
dequantized weights within the dtype's rounding. Block scales need a block width that is a multiple of
16 (the grouped kernels' smallest weight tile) and, for the stacked gate/up, ``I`` a multiple of the
block height.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.ops.fp8_weight import FP8_DTYPE, FP8_MAX, MIN_SCALE

# scale columns of a per-row scale: wider than any weight, so every column maps to scale column 0
_ROW_SCALE_COLS = 1 << 30


@dataclass(frozen=True)
class ExpertScales:
    """Scales of FP8 expert weights ``w_gate_up [E, 2 I, H]`` and ``w_down [E, H, I]``.

    Attributes:
        gate_up: float32 ``[E, 2 I]`` (``block`` None) or ``[E, ceil(2 I / bn), ceil(H / bk)]``.
        down: float32 ``[E, H]`` or ``[E, ceil(H / bn), ceil(I / bk)]``.
        block: ``(bn, bk)`` weight rows and columns per scale, or None for one scale per row.
    """

    gate_up: torch.Tensor
    down: torch.Tensor
    block: tuple[int, int] | None = None


def scale_shape(num_experts: int, rows: int, cols: int, block: tuple[int, int] | None) -> tuple[int, ...]:
    """The scale shape of an ``[E, rows, cols]`` FP8 weight: ``[E, rows]`` or ``[E, ceil(rows / bn),
    ceil(cols / bk)]``."""
    if block is None:
        return (num_experts, rows)
    return (num_experts, -(-rows // block[0]), -(-cols // block[1]))


def check_scale(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None, name: str) -> None:
    """Raise ValueError unless ``weight`` is float8_e4m3fn ``[E, N, K]`` and ``scale`` float32 of
    ``scale_shape`` on its device (``name`` labels the message)."""
    e, n, k = weight.shape
    want = scale_shape(e, n, k, block)
    if weight.dtype != FP8_DTYPE:
        raise ValueError(f"{name}: scales given but the weight is {weight.dtype}, not {FP8_DTYPE}")
    if tuple(scale.shape) != want or scale.dtype != torch.float32 or scale.device != weight.device:
        raise ValueError(f"{name}: scale {tuple(scale.shape)} {scale.dtype} on {scale.device}; expected "
                         f"float32 {want} on {weight.device}")


def kernel_scale_args(scale: torch.Tensor | None, block: tuple[int, int] | None,
                      like: torch.Tensor) -> tuple[torch.Tensor, int, int, int, int, int]:
    """``(scale, stride_e, stride_n, stride_k, rows per scale, cols per scale)`` as ``fused_moe``'s kernels
    take them; without a scale, ``like`` stands in for the pointer (never read) with unit divisors."""
    if scale is None:
        return like, 0, 0, 0, 1, 1
    if block is None:
        return scale, scale.stride(0), scale.stride(1), 0, 1, _ROW_SCALE_COLS
    return scale, scale.stride(0), scale.stride(1), scale.stride(2), block[0], block[1]


@torch.no_grad()
def quantize_experts(weight: torch.Tensor,
                     block: tuple[int, int] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight [E, N, K]`` (any float dtype) as ``(float8_e4m3fn [E, N, K], float32 scale)``, each scale
    ``amax / 448`` of its row (``block`` None) or of its ``(bn, bk)`` tile (ragged edge tiles: the amax of
    the values they hold), values rounded to nearest-even after division. On ``weight``'s device."""
    e, n, k = weight.shape
    if block is None:
        wf = weight.float()
        scale = (wf.abs().amax(dim=2) / FP8_MAX).clamp_min(MIN_SCALE)  # [E, N]
        return (wf / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale
    bn, bk = block
    nb, kb = -(-n // bn), -(-k // bk)
    wf = torch.nn.functional.pad(weight.float(), (0, kb * bk - k, 0, nb * bn - n))
    tiles = wf.view(e, nb, bn, kb, bk)
    scale = (tiles.abs().amax(dim=(2, 4)) / FP8_MAX).clamp_min(MIN_SCALE)  # [E, nb, kb]
    q = (tiles / scale[:, :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(e, nb * bn, kb * bk)[:, :n, :k].contiguous(), scale


def dequantize_experts(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None,
                       dtype: torch.dtype) -> torch.Tensor:
    """``float32(weight) * scale`` rounded to ``dtype`` once: ``[E, N, K]`` (the kernels' dequantization).

    Raises:
        ValueError: ``check_scale`` refuses the pair."""
    check_scale(weight, scale, block, "dequantize_experts")
    wf = weight.float()
    _, n, k = wf.shape
    if block is None:
        return (wf * scale[..., None]).to(dtype)
    s = scale.repeat_interleave(block[0], 1)[:, :n].repeat_interleave(block[1], 2)[:, :, :k]
    return (wf * s).to(dtype)
