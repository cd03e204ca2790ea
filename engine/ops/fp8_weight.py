"""FP8 (e4m3) weights: the format's constants, a weight with its scales (``Fp8Weight``), per-row
quantization and dequantization in plain torch, and the quantizers ``--quantization fp8`` and the tests use.

Three weight-scale layouts, all for a ``float8_e4m3fn`` weight ``W [N, K]``:

- ``"tensor"``: one float32 scale for the whole matrix (``scale [1]``), ``W_real = W * scale``;
- ``"channel"``: one scale per output feature (``scale [N]``);
- ``"block"``: one scale per ``block_n x block_k`` tile (``scale [ceil(N / block_n), ceil(K / block_k)]``,
  the last row/column of tiles ragged when ``N`` or ``K`` is not a multiple), the layout of the DeepSeek-V3,
  Qwen3-FP8 and GLM-4.5-FP8 releases (their ``weight_scale_inv`` tensors multiply, despite the name).

FP8 e4m3: 3 mantissa bits, largest finite value 448 (``FP8_MAX``); rounding to it is to nearest-even.
The GEMMs that consume these weights: ``engine.ops.fp8_gemm`` (w8a8, and the ``fp8_linear`` dispatch)
and ``engine.ops.fp8_gemv`` (weight-only, one row).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
# the smallest scale used: an all-zero group quantizes to zeros instead of dividing by zero
MIN_SCALE = 1e-12


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
        scale = (xf.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp_min(MIN_SCALE)
    q = (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale.float()


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
    scale = (tiles.abs().amax(dim=(1, 3)) / FP8_MAX).clamp_min(MIN_SCALE)  # [nb, kb]
    q = (tiles / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return Fp8Weight(q.view(nb * bn, kb * bk)[:n, :k].contiguous(), scale, "block", block)
