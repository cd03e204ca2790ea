"""The FP8 GEMV candidates of ``bench.kernels.fp8_gemv_sweep --candidates`` compute the right product
(CPU: Triton's interpreter for the kernels, torch's CPU ``_scaled_mm``; compiled on a GPU, with the
engine's own dispatch among them), and the sweep's check catches a wrong one. Timing needs a GPU (the
lead's H200 run)."""

from __future__ import annotations

import pytest
import torch

from bench.kernels.fp8_gemv_sweep import (
    BITS_TILES,
    CHECK_TOL,
    CONVERT_TILES,
    MMA_TILES,
    SPLITK_TILES,
    _candidates,
    _check,
)
from engine.ops.fp8_weight import Fp8Weight, quantize_weight_blocks, quantize_weight_per_channel

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("layout,gated", [("channel", False), ("channel", True), ("block", False)])
def test_every_candidate_passes_its_check_and_a_wrong_one_fails(layout: str, gated: bool) -> None:
    n, k = 64, 256
    gen = torch.Generator().manual_seed(3)
    wt = torch.randn(n, k, generator=gen) * k ** -0.5
    w = quantize_weight_blocks(wt) if layout == "block" else quantize_weight_per_channel(wt)
    dev = torch.device(DEVICE)
    w = Fp8Weight(w.weight.to(dev), w.scale.to(dev), w.layout, w.block)
    x = torch.randn(1, 2 * k if gated else k, generator=gen).to(dev, torch.float16)
    cands = _candidates(layout, n, k, gated, device=DEVICE)
    names = [name for name, _, _ in cands]
    scaled_mm = 2 if layout == "channel" else 0
    engine = 1 if DEVICE == "cuda" else 0  # fp8_linear's one-row GEMV dispatch runs on CUDA only
    assert len(cands) == (engine + len(BITS_TILES) + len(SPLITK_TILES) + len(CONVERT_TILES) + len(MMA_TILES)
                          + scaled_mm + 2 * gated)
    assert ("scaled_mm swapAB" in names) == (layout == "channel")
    for name, fn, weight_only in cands:
        assert _check(fn, x, w, weight_only, gated) <= CHECK_TOL, name
    # a candidate that reads the scales wrong (1.5x) is caught by the same check
    wrong = Fp8Weight(w.weight, w.scale * 1.5, w.layout, w.block)
    name, fn, weight_only = cands[-1]

    def broken(x: torch.Tensor, _: Fp8Weight) -> torch.Tensor:
        return fn(x, wrong)
    assert _check(broken, x, w, weight_only, gated) > CHECK_TOL, name
