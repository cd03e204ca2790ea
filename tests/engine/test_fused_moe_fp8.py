"""FP8 expert weights in the fused MoE kernels (engine/ops/fused_moe.py with engine/ops/fused_moe_fp8.py):
both paths (matrix-vector, grouped GEMM) and both scale layouts (per output row, per tile) against the
reference on the dequantized weights, and within FP8's error of the unquantized experts, over experts
8/64, top-k 1/2/8, 1-64 tokens and uneven loads. On CPU through Triton's interpreter over a subset
(``grid``)."""

from __future__ import annotations

import pytest
import torch

from engine.ops.fp8_weight import FP8_DTYPE
from engine.ops.fused_moe import fused_moe, fused_moe_reference, moe_tile
from engine.ops.fused_moe_fp8 import ExpertScales, dequantize_experts, quantize_experts
from engine.ops.fused_moe_gemv import fused_moe_gemv, gemv_scale_tile
from tests.engine.grid import grid
from tests.engine.test_fused_moe import DEVICE, DTYPES, TOL, moe_case

# block-scaled cases use small tiles so that the CPU shapes span several (and a ragged last column tile:
# hidden 48 over bk 32); the checkpoints' (128, 128) is the same code with other divisors
BLOCK = (16, 32)
LAYOUTS = ("channel", "block")
FULL = [(e, k, t, r, lay, p) for e in (8, 64) for k in (1, 2, 8) for t in (1, 7, 33, 64)
        for r in ("uniform", "skewed", "one") for lay in LAYOUTS for p in ("gemv", "grouped")
        if k <= e]
CPU = [(8, 1, 1, "uniform", "channel", "gemv"), (64, 2, 1, "skewed", "block", "gemv"),
       (8, 2, 7, "one", "channel", "grouped"), (8, 2, 33, "skewed", "channel", "grouped"),
       (64, 8, 7, "skewed", "block", "grouped"), (8, 1, 64, "uniform", "block", "grouped")]


def fp8_case(experts: int, top_k: int, tokens: int, kind: str, layout: str, dtype: torch.dtype
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, ExpertScales,
                        torch.Tensor, torch.Tensor]:
    """x, FP8 gate/up and down, routing weights and ids, scales, and the unquantized weights."""
    x, w_gate_up, w_down, weights, ids = moe_case(experts, top_k, tokens, kind, torch.float32, inter=32)
    block = BLOCK if layout == "block" else None
    q_up, s_up = quantize_experts(w_gate_up, block)
    q_down, s_down = quantize_experts(w_down, block)
    return (x.to(dtype), q_up, q_down, weights, ids, ExpertScales(s_up, s_down, block),
            w_gate_up.to(dtype), w_down.to(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("experts,top_k,tokens,kind,layout,path", grid(FULL, CPU))
def test_fp8_fused_moe_matches_dequantized_reference(experts, top_k, tokens, kind, layout, path, dtype):
    case = fp8_case(experts, top_k, tokens, kind, layout, dtype)
    x, q_up, q_down, weights, ids, scales, w_up, w_down = case
    if kind != "uniform" and 2 * top_k + 1 < experts:
        assert (torch.bincount(ids.flatten().cpu(), minlength=experts) == 0).any()  # empty experts
    got = fused_moe(x, q_up, q_down, weights, ids, path=path, scales=scales)
    want = fused_moe_reference(x, q_up, q_down, weights, ids, scales=scales)
    assert got.dtype == dtype and got.shape == x.shape
    # per-row scales (both paths) and block scales in the matrix-vector path: the kernel multiplies the scale
    # into a float32 sum or into the activations, the reference rounds every dequantized weight to the dtype
    # first (relative 2^-11 in fp16, 2^-8 in bf16): over the hidden and expert widths' terms, a few outputs
    # near zero differ by a few times the dtype's tolerance
    unrounded = layout == "channel" or path == "gemv"
    atol = TOL[dtype] * (3 if unrounded and dtype != torch.float32 else 1)
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=TOL[dtype])
    # the reference is the unquantized reference on the dequantized weights
    deq = fused_moe_reference(x, dequantize_experts(q_up, scales.gate_up, scales.block, dtype),
                              dequantize_experts(q_down, scales.down, scales.block, dtype), weights, ids)
    torch.testing.assert_close(want, deq, atol=0, rtol=0)
    # and within FP8's rounding (3 mantissa bits) of the unquantized experts: the dequantized reference
    # itself is up to 9.3 % off over the full grid (one token, two experts, block scales: 64-2-1-uniform)
    exact = fused_moe_reference(x, w_up, w_down, weights, ids).float()
    err = (got.float() - exact).norm() / exact.norm()
    assert err < 0.1, err


def tile_varied(w: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """``w [E, N, K]`` times a factor in [1/4, 4] per 8 x 8 tile: scale tiles (and parts of them) then
    differ by up to 16x, so a scale applied to the wrong rows or inputs moves the result far past the
    tolerance."""
    e, n, k = w.shape
    f = torch.exp2(torch.rand(e, -(-n // 8), -(-k // 8), generator=gen) * 4 - 2)
    return w * f.repeat_interleave(8, 1)[:, :n].repeat_interleave(8, 2)[:, :, :k]


# (block, gate/up tile, down tile): block heights that the default tile rows do not divide (24: 8 rows,
# then 16 halved), widths a tile's inputs span several of (16 under 128-input tiles) or that are not a
# power of two (48: chunks of 16), and ragged last scale tiles (hidden 80 over widths 32 and 48, I 48 over
# 32); (48, 128) has scale tiles wider than the experts, under the default tiles' widths
ALIGN = [((16, 32), (8, 64, 4), (8, 64, 4)), ((24, 48), (16, 128, 4), (16, 16, 4)),
         ((8, 16), (2, 1024, 4), (4, 128, 4)), ((48, 128), (8, 512, 4), (2, 256, 4))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("block,up_tile,down_tile", ALIGN)
def test_block_scaled_tiles_aligned_to_the_scale_blocks(block, up_tile, down_tile, dtype):
    """Block-scaled experts whose shapes and blocks do not fit the tiles as they come: both paths (the
    matrix-vector one at given tiles, two slots at once in the down kernel) equal the reference on the
    dequantized weights and stay within FP8's error of the unquantized experts."""
    gen = torch.Generator().manual_seed(3)
    experts, top_k, tokens, hidden, inter = 8, 2, 3, 80, 48
    x = torch.randn(tokens, hidden, generator=gen).to(dtype).to(DEVICE)
    w_up = tile_varied(torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden ** -0.5, gen)
    w_down = tile_varied(torch.randn(experts, hidden, inter, generator=gen) * inter ** -0.5, gen)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)]).to(DEVICE)
    weights = torch.rand(tokens, top_k, generator=gen).to(DEVICE)
    q_up, s_up = quantize_experts(w_up, block)
    q_down, s_down = quantize_experts(w_down, block)
    scales = ExpertScales(s_up.to(DEVICE), s_down.to(DEVICE), block)
    q_up, q_down = q_up.to(DEVICE), q_down.to(DEVICE)
    want = fused_moe_reference(x, q_up, q_down, weights, ids, scales=scales).float()
    exact = fused_moe_reference(x, w_up.to(dtype).to(DEVICE), w_down.to(dtype).to(DEVICE), weights,
                                ids).float()
    gemv = fused_moe_gemv(x, q_up, q_down, weights, ids, up_tile=up_tile, down_tile=down_tile, down_slots=2,
                          scales=scales).float()
    grouped = fused_moe(x, q_up, q_down, weights, ids, path="grouped", scales=scales).float()
    # the matrix-vector kernels multiply the scales into the activations (no dequantized weight rounded to
    # the dtype, as the reference does); the grouped kernels round them as the reference does
    torch.testing.assert_close(gemv, want, atol=3 * TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(grouped, want, atol=TOL[dtype], rtol=TOL[dtype])
    for got in (gemv, grouped):
        assert (got - exact).norm() / exact.norm() < 0.08


def test_tiles_fit_the_scale_blocks():
    """``gemv_scale_tile`` halves the rows until they divide the block height and cuts the inputs into
    power-of-two chunks dividing the block width; ``moe_tile`` narrows the grouped kernels' inputs to
    one column of scale tiles; neither changes an unscaled or per-row-scaled tile."""
    assert gemv_scale_tile(2, 1024, (128, 128)) == (2, 128)
    assert gemv_scale_tile(8, 512, (128, 128)) == (8, 128)
    assert gemv_scale_tile(16, 64, (24, 48)) == (8, 16)
    assert gemv_scale_tile(8, 16, (3, 32)) == (1, 16)
    assert gemv_scale_tile(8, 1024, None) == (8, 1024)
    assert moe_tile(8, 128, 768, 2048, (128, 128)) == (16, 64, 64, 4)
    assert moe_tile(8, 128, 768, 2048, (128, 48)) == (16, 64, 16, 4)
    assert moe_tile(8, 128, 768, 2048, (16, 32)) == (16, 64, 32, 4)
    assert moe_tile(8, 128, 768, 2048) == (16, 64, 64, 4)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_quantize_experts_round_trip(layout):
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(3, 40, 48, generator=gen)
    w[1, :16] = 0.0  # an all-zero row / tile quantizes to zeros
    block = BLOCK if layout == "block" else None
    q, s = quantize_experts(w, block)
    assert q.dtype == FP8_DTYPE and q.shape == w.shape and s.dtype == torch.float32
    assert tuple(s.shape) == ((3, 40) if block is None else (3, 3, 2))  # ragged: 40 rows / 16, 48 cols / 32
    back = dequantize_experts(q, s, block, torch.float32)
    assert torch.equal(back[1, :16], torch.zeros(16, 48))
    # e4m3 keeps 3 mantissa bits: each value within 2^-4 of itself, relative to its row / tile amax
    assert ((back - w).abs() <= w.abs() / 16 + 1e-6 + s.amax() * 2 ** -9).all()
    assert (back.abs().amax(dim=2) <= w.abs().amax(dim=2) * (1 + 1 / 16)).all()


def test_fp8_scales_refused_when_they_do_not_fit():
    x, q_up, q_down, weights, ids, scales, w_up, _ = fp8_case(8, 2, 3, "uniform", "channel", torch.float32)
    bad = ExpertScales(scales.gate_up[:, :-1], scales.down)
    with pytest.raises(ValueError, match="w_gate_up: scale"):
        fused_moe(x, q_up, q_down, weights, ids, scales=bad)
    with pytest.raises(ValueError, match=r"not torch\.float8_e4m3fn"):
        fused_moe(x, w_up, q_down, weights, ids, scales=scales)
    with pytest.raises(ValueError, match="one dtype"):  # FP8 weights without scales
        fused_moe(x, q_up, q_down, weights, ids)
    # block-scaled gate/up with I (32) not a multiple of the block height: gate and up would share a tile
    tall_up, tall_s = quantize_experts(w_up.float(), (24, 32))
    down_q, down_s = quantize_experts(torch.randn(8, 48, 32), (24, 32))
    with pytest.raises(ValueError, match="not a multiple of the block height 24"):
        fused_moe(x, tall_up.to(DEVICE), down_q.to(DEVICE), weights, ids,
                  scales=ExpertScales(tall_s.to(DEVICE), down_s.to(DEVICE), (24, 32)))
    # a block width that is not a multiple of 16: no grouped weight tile (>= 16 inputs) fits in a column
    narrow_up, narrow_s = quantize_experts(w_up.float(), (16, 24))
    down_q, down_s = quantize_experts(torch.randn(8, 48, 32), (16, 24))
    for path in ("gemv", "grouped"):
        with pytest.raises(ValueError, match="block width 24 is not a multiple of 16"):
            fused_moe(x, narrow_up.to(DEVICE), down_q.to(DEVICE), weights, ids, path=path,
                      scales=ExpertScales(narrow_s.to(DEVICE), down_s.to(DEVICE), (16, 24)))


@pytest.mark.parametrize("layout,tokens,slots", [("channel", 1, 1), ("channel", 1, 2), ("channel", 3, 2),
                                                 ("block", 1, 1), ("block", 3, 2)])
def test_decoded_weights_give_the_converted_bits(layout, tokens, slots):
    """``fused_moe_gemv(decode_bits=True)``: the e4m3 experts decoded by integer operations (every finite
    code, subnormals included, in the weights) give the same bits as the hardware conversion, per-row and
    block scales, one and several slots at once (two at one token: the down kernel's prefetching path)."""
    gen = torch.Generator().manual_seed(4)
    experts, top_k, hidden, inter = 8, 2, 64, 32
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes != 0x7F) & (codes != 0xFF)]

    def every_code(*shape: int) -> torch.Tensor:
        n = 1
        for d in shape:
            n *= d
        picks = torch.randint(0, codes.numel(), (n,), generator=gen)
        return codes[picks].reshape(shape).view(FP8_DTYPE).to(DEVICE)
    block = BLOCK if layout == "block" else None
    q_up, q_down = every_code(experts, 2 * inter, hidden), every_code(experts, hidden, inter)
    _, s_up = quantize_experts(torch.randn(experts, 2 * inter, hidden, generator=gen), block)
    _, s_down = quantize_experts(torch.randn(experts, hidden, inter, generator=gen), block)
    scales = ExpertScales(s_up.to(DEVICE), s_down.to(DEVICE), block)
    x = torch.randn(tokens, hidden, generator=gen).to(DEVICE)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)]).to(DEVICE)
    weights = torch.rand(tokens, top_k, generator=gen).to(DEVICE)
    converted = fused_moe_gemv(x, q_up, q_down, weights, ids, down_slots=slots, scales=scales)
    decoded = fused_moe_gemv(x, q_up, q_down, weights, ids, down_slots=slots, scales=scales, decode_bits=True)
    assert torch.equal(decoded, converted)
    want = fused_moe_reference(x, q_up, q_down, weights, ids, scales=scales)
    torch.testing.assert_close(decoded, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
