"""The weight-only FP8 GEMVs (engine/ops/fp8_gemv.py): ``fp8_gemv`` and ``fp8_gemv_splitk`` against
``fp8_gemv_reference`` in each scale layout (through Triton's interpreter on a CPU, over ``grid``'s subset;
compiled, full grid on a GPU), ragged ``N``/``K`` and scale groups, SiLU·mul folded in, the refusals,
and the one-row dispatch's split-K tiles."""

from __future__ import annotations

import pytest
import torch

import engine.ops.fp8_gemv as fp8_gemv_module
from engine.ops.fp8_gemv import (
    fp8_gemv,
    fp8_gemv_folds_silu,
    fp8_gemv_mma,
    fp8_gemv_mma_tile,
    fp8_gemv_reference,
    fp8_gemv_splitk,
    fp8_gemv_splitk_tile,
    fp8_gemv_tile,
    measured_gpu,
)
from engine.ops.fp8_weight import FP8_DTYPE, Fp8Weight, quantize_weight_blocks, quantize_weight_per_channel
from engine.ops.silu_mul import silu_mul
from tests.engine.grid import grid

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


def quantized(wt: torch.Tensor, layout: str, block: tuple[int, int] = (128, 128)) -> Fp8Weight:
    """``wt [N, K]`` as an FP8 weight of ``layout`` on ``DEVICE``: ``block`` scales, one per output
    feature, or one for the whole matrix (the largest per-feature scale)."""
    if layout == "block":
        w = quantize_weight_blocks(wt, block)
    else:
        w = quantize_weight_per_channel(wt)
        if layout == "tensor":
            s = w.scale.amax().reshape(1)
            w = Fp8Weight((wt / s).to(FP8_DTYPE), s, "tensor")
    dev = torch.device(DEVICE)
    return Fp8Weight(w.weight.to(dev), w.scale.to(dev), w.layout, w.block)


# (N, K, layout): ragged N and K, each layout
GEMV_FULL = [(n, k, lay) for n, k in ((128, 128), (200, 320), (4096, 1024), (1000, 2100), (14336, 4096))
             for lay in ("tensor", "channel", "block")]
GEMV_CPU = [(200, 320, "tensor"), (200, 320, "channel"), (200, 320, "block")]


@pytest.mark.parametrize("tile", [None, (8, 128, 4)])  # default; and several K steps with a ragged last
@pytest.mark.parametrize("n,k,layout", grid(GEMV_FULL, GEMV_CPU))
def test_fp8_gemv_matches_reference(n: int, k: int, layout: str, tile: tuple[int, int, int] | None) -> None:
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(1, k, generator=gen)
    w = quantized(torch.randn(n, k, generator=gen) * k ** -0.5, layout)
    dev = torch.device(DEVICE)
    bias = torch.randn(n, generator=gen).to(dev)
    out = fp8_gemv(x.to(dev), w, bias, tile=tile)
    ref = fp8_gemv_reference(x.to(dev), w, bias)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-4 * ref.abs().max().item())


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("block,tile", [((128, 128), (8, 512, 4)),  # a K step spanning 3 ragged groups
                                        ((12, 64), (8, 128, 4)),  # block_n lowered to 4, 2 groups a step
                                        ((128, 128), None)])  # the default tile (fp8_gemv_tile)
def test_fp8_gemv_block_scales_per_input(block: tuple[int, int], tile: tuple[int, int, int] | None,
                                         gated: bool) -> None:
    """Block scales multiply ``x`` per input (a program's rows share one row of scale tiles; ``block_n``
    lowered to divide the weight's ``block_n``), across K steps wider and narrower than a scale group
    and a ragged last group; ``gated`` folds SiLU·mul of ``[gate | up]`` in: bit-identical to
    ``silu_mul`` then the plain GEMV (same rounding points), close to the reference. Half precision
    (bf16 on a GPU; fp16 on a CPU, where the interpreter's bf16 rounding differs from torch's) so the
    activation's rounding is visible."""
    gen = torch.Generator().manual_seed(7)
    n, k = 200, 320
    wt = torch.randn(n, k, generator=gen) * k ** -0.5
    wt[:, 64:128] *= 20  # one column of scale tiles larger than the others
    fw = quantize_weight_blocks(wt, block)
    dev = torch.device(DEVICE)
    dtype = torch.bfloat16 if CUDA else torch.float16
    w = Fp8Weight(fw.weight.to(dev), fw.scale.to(dev), "block", block)
    x = torch.randn(1, 2 * k if gated else k, generator=gen).to(dev, dtype)
    out = fp8_gemv(x, w, None, tile=tile, gated=gated)
    ref = fp8_gemv_reference(x, w, None, gated=gated)
    assert out.dtype == dtype
    if gated:
        assert torch.equal(out, fp8_gemv(silu_mul(x), w, None, tile=tile))
    # both round one float32 sum to the output dtype: within one ulp
    ulp = 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -10
    torch.testing.assert_close(out.float(), ref.float(), rtol=ulp, atol=ulp * ref.abs().max().item())
    wrong = Fp8Weight(w.weight, w.scale.mean().expand_as(w.scale).contiguous(), "block", block)
    assert (fp8_gemv(x, wrong, None, tile=tile, gated=gated).float() - ref.float()).abs().max() > 0.1


def test_fp8_gemv_refuses_wrong_width() -> None:
    w = quantize_weight_per_channel(torch.randn(16, 32))
    with pytest.raises(ValueError, match=r"contiguous x \[1, 64\]"):
        fp8_gemv(torch.randn(1, 32), w, None, gated=True)


@pytest.mark.parametrize("layout,tile,gated", [("channel", (8, 64, 4, 3), False),  # 3 slices of 128: ragged
                                               ("tensor", (4, 128, 4, 1), True),  # one slice
                                               ("block", (8, 32, 4, 4), True)])  # block_n lowered to 4
def test_fp8_gemv_splitk_matches_reference(layout: str, tile: tuple[int, int, int, int], gated: bool) -> None:
    """The split-K GEMV candidate (``fp8_gemv_splitk``) equals ``fp8_gemv_reference`` within float32
    summation order, over ragged K slices, a single slice, block scales whose rows need a lowered
    ``block_n``, with and without SiLU·mul folded in; a wrong scale is caught."""
    gen = torch.Generator().manual_seed(8)
    n, k = 70, 320  # 70: a ragged last row block
    wt = torch.randn(n, k, generator=gen) * k ** -0.5
    wt[:, 64:128] *= 20
    w = quantized(wt, layout, (12, 64))
    dev = torch.device(DEVICE)
    x = torch.randn(1, 2 * k if gated else k, generator=gen).to(dev)
    bias = torch.randn(n, generator=gen).to(dev)
    out = fp8_gemv_splitk(x, w, bias, tile=tile, gated=gated)
    ref = fp8_gemv_reference(x, w, bias, gated=gated)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-4 * ref.abs().max().item())
    wrong = Fp8Weight(w.weight, w.scale * 1.5, w.layout, w.block)
    assert (fp8_gemv_splitk(x, wrong, bias, tile=tile, gated=gated) - ref).abs().max() > 0.1
    with pytest.raises(ValueError, match="split_k"):
        fp8_gemv_splitk(x, w, bias, tile=(8, 24, 4, 2), gated=gated)


def test_one_row_steps_take_split_k_where_it_measured_faster() -> None:
    """``fp8_linear``'s one-row dispatch (the H200 sweep's winners): ``fp8_gemv`` for every per-channel
    and per-tensor projection; with block scales split-K for the narrow (o, down) and wide (gate/up)
    projections, ``fp8_gemv`` for QKV-like widths and the gated form."""
    assert fp8_gemv_splitk_tile(4096, "channel") is None
    assert fp8_gemv_splitk_tile(28672, "tensor") is None
    assert fp8_gemv_splitk_tile(4096, "block") == (8, 512, 4, 4)
    assert fp8_gemv_splitk_tile(28672, "block") == (8, 512, 4, 2)
    assert fp8_gemv_splitk_tile(6144, "channel") is None
    assert fp8_gemv_splitk_tile(4096, "channel", gated=True) is None
    # FP8 tensor cores for wide per-channel / per-tensor matrices only
    assert fp8_gemv_mma_tile(28672, "channel") == (128, 256, 4, 1, 3)
    assert fp8_gemv_mma_tile(28672, "tensor") == (128, 256, 4, 1, 3)
    assert fp8_gemv_mma_tile(28672, "block") is None
    assert fp8_gemv_mma_tile(6144, "channel") is None
    assert fp8_gemv_mma_tile(28672, "channel", gated=True) is None
    # block scales: 1024-wide K steps below N = 16384 (one scale load per 1024 inputs)
    assert fp8_gemv_tile(6144, layout="block") == (8, 1024, 4)
    assert fp8_gemv_tile(6144, layout="channel") == (8, 512, 4)


def test_an_h100_takes_its_own_measured_one_row_choices(monkeypatch: pytest.MonkeyPatch) -> None:
    """An H100 SXM (by device name) runs wide per-channel matrices on the decoded GEMV, not the MMA, and
    folds SiLU·mul into the one-row down GEMV (not for block scales); an H200 and any other GPU (other H100
    variants too: not measured) keep the H200's choices."""
    names = {0: "NVIDIA H100 80GB HBM3", 1: "NVIDIA H200", 2: "NVIDIA A100-SXM4-80GB", 3: "NVIDIA H100 PCIe",
             4: "NVIDIA H100 NVL"}
    monkeypatch.setattr(fp8_gemv_module, "_device_name", lambda index: names[index])
    gpus = [measured_gpu(torch.device("cuda", i)) for i in range(5)]
    assert gpus == ["h100", "h200", "h200", "h200", "h200"]  # only the H100 measured (SXM) takes its own
    assert fp8_gemv_mma_tile(28672, "channel", gpu="h100") is None
    assert fp8_gemv_mma_tile(28672, "channel", gpu="h200") == (128, 256, 4, 1, 3)
    assert fp8_gemv_folds_silu("h100", "channel") and fp8_gemv_folds_silu("h100", "tensor")
    assert not fp8_gemv_folds_silu("h100", "block") and not fp8_gemv_folds_silu("h200", "channel")


def _every_code(n: int, k: int) -> torch.Tensor:
    """``[n, k]`` e4m3 weights cycling through all 254 finite codes (subnormals and both zeros included)."""
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes != 0x7F) & (codes != 0xFF)]
    return codes.repeat(-(-n * k // codes.numel()))[:n * k].reshape(n, k).view(FP8_DTYPE)


@pytest.mark.parametrize("layout", ["channel", "block"])
@pytest.mark.parametrize("gated,magnitude", [(False, 1.0), (True, 1.0), (False, 1e9)])
def test_bits_decode_equals_the_conversion(layout: str, gated: bool, magnitude: float) -> None:
    """``decode=1`` (weights decoded by integer operations, inputs and sums scaled by powers of two) gives
    the same bits as the e4m3 conversion for every finite code, subnormals included (compiled on a GPU:
    float32 subnormals are kept by the kernel's arithmetic), in ``fp8_gemv`` and ``fp8_gemv_splitk``, for
    ordinary inputs and inputs of 1e9 (the scaling keeps them finite)."""
    gen = torch.Generator().manual_seed(9)
    n, k = 64, 512
    dev = torch.device(DEVICE)
    q = _every_code(n, k).to(dev)
    if layout == "block":
        w = Fp8Weight(q, (torch.rand(1, 4, generator=gen) + 0.5).to(dev), "block", (128, 128))
    else:
        w = Fp8Weight(q, (torch.rand(n, generator=gen) + 0.5).to(dev), "channel")
    x = (torch.randn(1, 2 * k if gated else k, generator=gen) * magnitude).to(dev)
    for tile in [(8, 128, 4), (4, 256, 4)]:
        assert torch.equal(fp8_gemv(x, w, None, tile=tile, gated=gated, decode=1),
                           fp8_gemv(x, w, None, tile=tile, gated=gated, decode=0))
    split = (8, 128, 4, 2)
    assert torch.equal(fp8_gemv_splitk(x, w, None, tile=split, gated=gated, decode=1),
                       fp8_gemv_splitk(x, w, None, tile=split, gated=gated, decode=0))
    ref = fp8_gemv_reference(x, w, None, gated=gated)
    torch.testing.assert_close(fp8_gemv(x, w, None, tile=(8, 128, 4), gated=gated, decode=1), ref,
                               rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    with pytest.raises(ValueError, match="decode"):
        fp8_gemv(x, w, None, gated=gated, decode=2)


def test_subnormal_weights_decode_exactly() -> None:
    """Weights holding only e4m3 subnormals (+-1..7 * 2**-9) and zeros: the product equals the float32
    reference to rounding and is not zero (a decoder or arithmetic that flushed subnormals would return
    0 or only the bias)."""
    gen = torch.Generator().manual_seed(11)
    n, k = 16, 256
    codes = torch.tensor([0x00, 0x01, 0x02, 0x03, 0x04, 0x05, 0x06, 0x07, 0x80, 0x81, 0x83, 0x87],
                         dtype=torch.uint8)
    q = codes[torch.randint(0, codes.numel(), (n, k), generator=gen)].view(FP8_DTYPE)
    dev = torch.device(DEVICE)
    w = Fp8Weight(q.to(dev), torch.ones(n).to(dev), "channel")
    x = torch.randn(1, k, generator=gen).to(dev)
    out = fp8_gemv(x, w, None, tile=(8, 128, 4))
    ref = fp8_gemv_reference(x, w, None)
    assert ref.abs().max() > 1e-3
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6 * ref.abs().max().item())


@pytest.mark.parametrize("layout", ["channel", "block"])
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("tile", [(64, 128, 4, 1, 2), (32, 256, 4, 3, 2), (16, 64, 4, 2, 2)])
def test_fp8_gemv_mma_matches_reference(layout: str, gated: bool,
                                        tile: tuple[int, int, int, int, int]) -> None:
    """The FP8 tensor-core GEMV (``fp8_gemv_mma``: inputs in three e4m3 parts per chunk) equals the
    reference within the half-precision output's rounding, over ragged rows, split K, block scales and
    inputs spanning 2**20 in magnitude; a wrong scale is caught."""
    gen = torch.Generator().manual_seed(10)
    n, k = 200, 512
    wt = torch.randn(n, k, generator=gen) * k ** -0.5
    wt[:, 128:256] *= 20
    w = quantized(wt, layout)
    dev = torch.device(DEVICE)
    dtype = torch.bfloat16 if CUDA else torch.float16
    x = torch.randn(1, 2 * k if gated else k, generator=gen)
    x[0, :k // 2] *= 2.0 ** 10
    x[0, k // 2:k] *= 2.0 ** -10
    x = x.to(dev, dtype)
    out = fp8_gemv_mma(x, w, None, tile=tile, gated=gated)
    ref = fp8_gemv_reference(x.float(), w, None, gated=gated)
    ulp = 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -10
    torch.testing.assert_close(out.float(), ref, rtol=2 * ulp, atol=2 * ulp * ref.abs().max().item())
    wrong = Fp8Weight(w.weight, w.scale * 1.5, w.layout, w.block)
    assert (fp8_gemv_mma(x, wrong, None, tile=tile, gated=gated).float() - ref).abs().max() > 0.1
