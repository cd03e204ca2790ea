"""The FP8 GEMMs (engine/ops/fp8_gemm.py) and weights (engine/ops/fp8_weight.py): the Triton token-group
quantizer and the w8a8 block-scaled GEMM against their plain-torch references (through Triton's
interpreter on a CPU, over ``grid``'s subset; compiled, full grid on a GPU), ragged ``M``/``N``/``K``
edges included; the weight quantizers against the FP8 rounding bound; on a GPU of compute capability
>= 8.9 the ``torch._scaled_mm`` path against its reference. The one-row GEMVs: test_fp8_gemv.py."""

from __future__ import annotations

import pytest
import torch

from engine.ops.fp8_gemm import (
    fp8_linear,
    quantize_fp8_groups,
    quantize_fp8_groups_reference,
    scaled_fp8_linear_reference,
    w8a8_block_gemm,
    w8a8_block_gemm_reference,
)
from engine.ops.fp8_weight import (
    FP8_DTYPE,
    FP8_MAX,
    Fp8Weight,
    dequantize_fp8,
    quantize_weight_blocks,
    quantize_weight_per_channel,
)
from engine.ops.silu_mul import silu_mul, silu_mul_reference
from tests.engine.grid import grid

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
FP8_MM = CUDA and torch.cuda.get_device_capability() >= (8, 9)

# (M tokens, N out, K in, block): multiples of 128 and ragged edges in each of M, N, K
FULL = [(m, n, k, b) for m in (1, 5, 16, 33, 200) for n, k in ((128, 128), (256, 384), (200, 320),
                                                               (1024, 512)) for b in ((128, 128), (64, 128))]
CPU = [(1, 128, 128, (128, 128)), (5, 200, 320, (128, 128)), (33, 256, 384, (128, 128)),
       (16, 200, 320, (64, 128))]


def _case(m: int, n: int, k: int, block: tuple[int, int], seed: int = 0) -> tuple[torch.Tensor, Fp8Weight]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen)
    x[:, :7] *= 30  # an outlier group: its scale differs from the others'
    w = torch.randn(n, k, generator=gen) * k ** -0.5
    w[: min(n, 3)] *= 10  # one tile row with a larger scale
    fw = quantize_weight_blocks(w, block)
    dev = torch.device(DEVICE)
    return x.to(dev), Fp8Weight(fw.weight.to(dev), fw.scale.to(dev), "block", block)


@pytest.mark.parametrize("m,n,k,block", grid(FULL, CPU))
def test_quantize_groups_matches_reference(m: int, n: int, k: int, block: tuple[int, int]) -> None:
    x, _ = _case(m, n, k, block)
    q, s = quantize_fp8_groups(x, block[1])
    q_ref, s_ref = quantize_fp8_groups_reference(x, block[1])
    assert q.dtype == FP8_DTYPE and s.shape == (m, -(-k // block[1]))
    torch.testing.assert_close(s, s_ref, rtol=1e-6, atol=0)
    assert torch.equal(q.float(), q_ref.float())  # same division, same round-to-nearest-even
    # every group's largest magnitude maps to the top of the FP8 range
    assert q.float().abs().amax().item() == FP8_MAX


# FP8 tensor-core MMA (Hopper wgmma, Ada mma) does not accumulate in full float32: DeepSeek-V3's report
# (arXiv 2412.19437, section 3.3.2) measures about 14 retained bits, which is why the kernel adds each
# block_k slice's tl.dot into a float32 accumulator (the promotion the report describes; one slice here
# is at most 128 wide). Within one slice, the products of each MMA k-step (32 FP8 products) are aligned to
# the largest of them and cut to ~13 fraction bits, so each product loses at most 2^-13 of the step's
# largest |a_i * b_i|; 32 of them lose at most 32 * 2^-13 = 2^-8 of it, which is <= 2^-8 of the step's
# sum of |a_i * b_i|. Summed over the steps: |error| <= 2^-8 * (|A| @ |W|^T) per output element (scales
# included), plus float32 rounding. The interpreter (CPU) multiplies in float32: only the summation order
# differs from the reference there, and its tolerance stays tight.
MMA_FP8_REL = 2.0 ** -8


def _assert_block_gemm_close(out: torch.Tensor, q: torch.Tensor, s: torch.Tensor, w: Fp8Weight) -> None:
    ref = w8a8_block_gemm_reference(q, s, w, torch.float32)
    if not out.is_cuda:  # float32 products and sums: only the summation order differs
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-4 * ref.abs().max().item())
        return
    assert w.block is not None
    k = q.shape[1]
    a_abs = (q.float() * s.repeat_interleave(w.block[1], 1)[:, :k]).abs()
    bound = MMA_FP8_REL * (a_abs @ dequantize_fp8(w).abs().T) + 1e-5 * ref.abs() + 1e-6
    err = (out - ref).abs()
    worst = (err / bound).max().item()
    assert worst <= 1.0, f"error {err.max().item():.4g} exceeds the FP8 MMA bound (worst ratio {worst:.3g})"


@pytest.mark.parametrize("m,n,k,block", grid(FULL, CPU))
def test_block_gemm_matches_reference(m: int, n: int, k: int, block: tuple[int, int]) -> None:
    x, w = _case(m, n, k, block)
    q, s = quantize_fp8_groups_reference(x, block[1])
    out = w8a8_block_gemm(q, s, w, torch.float32)
    _assert_block_gemm_close(out, q, s, w)


@pytest.mark.parametrize("tile", [(16, 32, 4, 2), (32, 64, 4, 2)])
def test_block_gemm_other_tiles(tile: tuple[int, int, int, int]) -> None:
    """A tile narrower than the weight's block_n (scales gathered per column) and a wider M tile."""
    x, w = _case(40, 200, 320, (128, 128), seed=1)
    q, s = quantize_fp8_groups_reference(x, 128)
    out = w8a8_block_gemm(q, s, w, torch.float32, tile=tile)
    _assert_block_gemm_close(out, q, s, w)


def test_block_gemm_grouped_program_order_covers_every_tile() -> None:
    """13 row tiles (a full group of 8 and a ragged one of 5) times 4 column tiles: the grouped program
    order maps the 52 programs onto every output tile once."""
    x, w = _case(200, 200, 128, (128, 128), seed=2)
    q, s = quantize_fp8_groups_reference(x, 128)
    out = w8a8_block_gemm(q, s, w, torch.float32, tile=(16, 64, 4, 2))
    _assert_block_gemm_close(out, q, s, w)


def test_block_gemm_close_to_unquantized_product() -> None:
    """The w8a8 result is within FP8's rounding of the float32 product: each operand carries a relative
    error of at most 2^-4 per element (3 mantissa bits, round to nearest), random signs, so the
    product's error is about 2^-4 * sqrt(2 / 3) of an element's contribution per term; 5 % of the output's
    spread bounds it with room (measured ~2.5 %)."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(8, 256, generator=gen)
    wt = torch.randn(192, 256, generator=gen) * 256 ** -0.5
    w = quantize_weight_blocks(wt)
    y = fp8_linear(x, w, None, use_kernels=False)
    exact = x @ wt.T
    rel = ((y - exact).norm() / exact.norm()).item()
    assert rel < 0.05, rel
    assert rel > 0  # quantization did happen


def test_weight_quantizers_round_trip() -> None:
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(200, 320, generator=gen)
    for fw in (quantize_weight_blocks(w), quantize_weight_per_channel(w)):
        back = dequantize_fp8(fw)
        # e4m3 normal numbers: relative rounding error <= 2^-4; values far below the scale are subnormal
        err = (back - w).abs()
        assert (err <= w.abs() * 2 ** -4 + 2e-3 * w.abs().amax()).all()
    blocks = quantize_weight_blocks(w)
    assert blocks.scale.shape == (2, 3)  # ragged edge tiles: 200 = 128 + 72, 320 = 2 * 128 + 64
    assert quantize_weight_per_channel(w).scale.shape == (200,)


def test_scale_layout_checked() -> None:
    w = torch.zeros(4, 8, dtype=FP8_DTYPE)
    with pytest.raises(ValueError, match="channel FP8 scale"):
        Fp8Weight(w, torch.ones(1), "channel")
    with pytest.raises(ValueError, match="unknown FP8 scale layout"):
        Fp8Weight(w, torch.ones(1), "row")
    with pytest.raises(ValueError, match="dynamic activation scales only"):
        Fp8Weight(w, torch.ones(1, 1), "block", (128, 128), input_scale=torch.ones(1))


@pytest.mark.gpu
@pytest.mark.skipif(not FP8_MM, reason="torch._scaled_mm needs a GPU of compute capability >= 8.9")
@pytest.mark.parametrize("layout,static", [("channel", False), ("tensor", False), ("tensor", True),
                                           ("channel", True)])
@pytest.mark.parametrize("m", [1, 17, 256])
def test_scaled_mm_matches_reference(layout: str, static: bool, m: int) -> None:
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(m, 512, generator=gen).to("cuda", torch.bfloat16)
    wt = torch.randn(384, 512, generator=gen) * 512 ** -0.5
    fw = quantize_weight_per_channel(wt)
    scale = fw.scale if layout == "channel" else fw.scale.amax().reshape(1)
    q = (wt / (scale[:, None] if layout == "channel" else scale)).to(FP8_DTYPE)
    inp = (x.float().abs().amax() / FP8_MAX).reshape(1) if static else None
    w = Fp8Weight(q.cuda(), scale.cuda(), layout, input_scale=inp)
    bias = torch.randn(384, generator=gen).to("cuda", torch.bfloat16)
    out = fp8_linear(x, w, bias, use_kernels=True)
    ref = scaled_fp8_linear_reference(x, w, bias)
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2,
                               atol=2e-2 * ref.float().abs().max().item())


@pytest.mark.parametrize("m,k,group", [(3, 320, 128), (2, 320, 320)])  # ragged groups; one per token
def test_quantize_groups_gated_equals_silu_mul_first(m: int, k: int, group: int) -> None:
    """SiLU·mul of ``[gate | up]`` folded into the quantizer: bit-identical to ``silu_mul`` then the
    quantizer (same rounding points), and to the plain-torch path within the activation's rounding;
    ``fp8_linear(gated=True)`` equals ``silu_mul`` first, on the kernels' and the references' paths."""
    gen = torch.Generator().manual_seed(8)
    dtype = torch.bfloat16 if CUDA else torch.float16  # the interpreter's bf16 rounding differs from torch's
    x = (torch.randn(m, 2 * k, generator=gen) * 3).to(DEVICE, dtype)
    q, s = quantize_fp8_groups(x, group, gated=True)
    q1, s1 = quantize_fp8_groups(silu_mul(x), group)
    assert q.shape == (m, k) and s.shape == (m, -(-k // group))
    assert torch.equal(q.float(), q1.float()) and torch.equal(s, s1)
    _, s_ref = quantize_fp8_groups_reference(silu_mul_reference(x), group)
    torch.testing.assert_close(s, s_ref, rtol=2e-3, atol=0)
    w = quantize_weight_blocks(torch.randn(64, k, generator=gen) * k ** -0.5, (64, 128))
    w = Fp8Weight(w.weight.to(DEVICE), w.scale.to(DEVICE), "block", w.block)
    if m > 1:  # one row on a GPU is the GEMV (its own test)
        assert torch.equal(fp8_linear(x, w, None, use_kernels=True, gated=True),
                           fp8_linear(silu_mul(x), w, None, use_kernels=True))
    assert torch.equal(fp8_linear(x, w, None, use_kernels=False, gated=True),
                       fp8_linear(silu_mul_reference(x), w, None, use_kernels=False))
    with pytest.raises(ValueError, match=r"\[M, 2 K\]"):
        quantize_fp8_groups(x[:, :-1], group, gated=True)


@pytest.mark.gpu
@pytest.mark.skipif(not FP8_MM, reason="torch._scaled_mm needs a GPU of compute capability >= 8.9")
def test_scaled_mm_gated_equals_silu_mul_first() -> None:
    """Per-channel weights with dynamic activations: SiLU·mul folded into the per-token quantizer before
    ``torch._scaled_mm`` gives the product of ``silu_mul`` first, bit for bit."""
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(17, 1024, generator=gen).to("cuda", torch.bfloat16)
    w = quantize_weight_per_channel(torch.randn(384, 512, generator=gen) * 512 ** -0.5)
    w = Fp8Weight(w.weight.cuda(), w.scale.cuda(), "channel")
    assert torch.equal(fp8_linear(x, w, None, use_kernels=True, gated=True),
                       fp8_linear(silu_mul(x), w, None, use_kernels=True))


def test_block_gemm_and_fp8_linear_write_into_out() -> None:
    """``out=``: the block kernel writes the product into a given ``[M, N]`` (here the left columns of a
    wider buffer, the way the fused model hands a QKV projection cuDNN's buffer), the bias added in place
    by ``fp8_linear``: the values of the fresh-tensor call; other shapes or dtypes are refused."""
    m, n, k, block = 33, 256, 384, (128, 128)
    x, w = _case(m, n, k, block, seed=3)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(4)).to(x.device)
    q, s = quantize_fp8_groups(x, block[1])
    wide = torch.full((m, n + 64), float("nan"), device=x.device)
    got = w8a8_block_gemm(q, s, w, torch.float32, out=wide[:, :n])
    assert got.data_ptr() == wide.data_ptr() and torch.equal(got, w8a8_block_gemm(q, s, w, torch.float32))
    assert wide[:, n:].isnan().all()  # nothing written past the product's columns
    into = torch.empty(m, n, device=x.device)
    assert fp8_linear(x, w, bias, use_kernels=True, out=into) is into
    assert torch.equal(into, fp8_linear(x, w, bias, use_kernels=True))
    with pytest.raises(ValueError, match="out must be"):
        w8a8_block_gemm(q, s, w, torch.float32, out=torch.empty(m, n, dtype=torch.float16, device=x.device))
    with pytest.raises(ValueError, match="out must be"):
        w8a8_block_gemm(q, s, w, torch.float32, out=torch.empty(m + 1, n, device=x.device))
