"""Fused small kernels (engine/ops: rms_norm, apply_rotary, silu_mul) against their plain-torch references
and against transformers' own modules. On CPU they run through Triton's interpreter (fp32, fp16); bf16 needs
a GPU (scripts/gpu_tests.sh)."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from engine.ops.fp8_gemm import quantize_fp8_groups
from engine.ops.fp8_weight import FP8_DTYPE
from engine.ops.rms_norm import rms_norm, rms_norm_fp8, rms_norm_fp8_reference, rms_norm_reference
from engine.ops.rotary import apply_rotary, apply_rotary_reference
from engine.ops.silu_mul import silu_mul, silu_mul_reference

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if CUDA else [])
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _rand(*shape: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [64, 96])
def test_rms_norm_matches_transformers(dtype, n):
    x, w = _rand(5, n, dtype=dtype), _rand(n, dtype=dtype, seed=1)
    hf = LlamaRMSNorm(n, eps=1e-6).to(DEVICE, dtype)
    hf.weight.data.copy_(w)
    want = hf(x)
    torch.testing.assert_close(rms_norm_reference(x, w, 1e-6), want, atol=0, rtol=0)
    torch.testing.assert_close(rms_norm(x, w, 1e-6), want, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rms_norm_updates_residual_in_place(dtype):
    x, r, w = _rand(4, 64, dtype=dtype), _rand(4, 64, dtype=dtype, seed=2), _rand(64, dtype=dtype, seed=3)
    summed = x + r
    want = rms_norm_reference(summed.clone(), w, 1e-5)
    res_ref, res = r.clone(), r.clone()
    got_ref = rms_norm_reference(x, w, 1e-5, residual=res_ref)
    got = rms_norm(x, w, 1e-5, residual=res)
    torch.testing.assert_close(res_ref, summed, atol=0, rtol=0)
    torch.testing.assert_close(res, summed, atol=0, rtol=0)
    torch.testing.assert_close(got_ref, want, atol=0, rtol=0)
    torch.testing.assert_close(got, want, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_on_qkv_views_matches_transformers(dtype):
    t, h, hkv, d = 3, 4, 2, 16
    qkv = _rand(t, (h + 2 * hkv) * d, dtype=dtype)
    angles = _rand(t, d // 2, dtype=torch.float32, seed=5) * 3
    cos = torch.cat([angles.cos()] * 2, -1).to(dtype)
    sin = torch.cat([angles.sin()] * 2, -1).to(dtype)
    q0, k0 = qkv[:, : h * d].view(t, h, d).clone(), qkv[:, h * d: (h + hkv) * d].view(t, hkv, d).clone()
    want_q, want_k = apply_rotary_pos_emb(q0.transpose(0, 1)[None], k0.transpose(0, 1)[None],
                                          cos[None], sin[None])
    for fn, tol in ((apply_rotary_reference, 0.0), (apply_rotary, TOL[dtype])):
        buf = qkv.clone()
        v_before = buf[:, (h + hkv) * d:].clone()
        q, k = buf[:, : h * d].view(t, h, d), buf[:, h * d: (h + hkv) * d].view(t, hkv, d)
        fn(q, k, cos, sin)
        torch.testing.assert_close(q, want_q[0].transpose(0, 1), atol=tol, rtol=tol)
        torch.testing.assert_close(k, want_k[0].transpose(0, 1), atol=tol, rtol=tol)
        assert torch.equal(buf[:, (h + hkv) * d:], v_before)  # V untouched


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_matches_transformers(dtype):
    gate_up = _rand(3, 2 * 1500, dtype=dtype)  # 1500: not a multiple of the kernel's 1024-wide tile
    gate, up = gate_up[:, :1500], gate_up[:, 1500:]
    want = torch.nn.SiLU()(gate) * up
    torch.testing.assert_close(silu_mul_reference(gate_up), want, atol=0, rtol=0)
    torch.testing.assert_close(silu_mul(gate_up), want, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_interleaved_rotary_matches_glm4(dtype):
    """``interleaved=True`` (adjacent pairs) against transformers' GLM-4 ``apply_rotary_pos_emb``, on the
    first half of each head (GLM-4's partial rotary) of views of a fused QKV output; the other dims and V
    untouched."""
    from transformers.models.glm4.modeling_glm4 import apply_rotary_pos_emb as glm4_rotary

    t, h, hkv, d, rot = 3, 4, 2, 32, 16
    qkv = _rand(t, (h + 2 * hkv) * d, dtype=dtype)
    angles = _rand(t, rot // 2, dtype=torch.float32, seed=5) * 3
    cos = torch.cat([angles.cos()] * 2, -1).to(dtype)
    sin = torch.cat([angles.sin()] * 2, -1).to(dtype)
    q0, k0 = qkv[:, : h * d].view(t, h, d).clone(), qkv[:, h * d: (h + hkv) * d].view(t, hkv, d).clone()
    want_q, want_k = glm4_rotary(q0.transpose(0, 1)[None], k0.transpose(0, 1)[None], cos[None], sin[None])
    for fn, tol in ((apply_rotary_reference, 0.0), (apply_rotary, TOL[dtype])):
        buf = qkv.clone()
        v_before = buf[:, (h + hkv) * d:].clone()
        q, k = buf[:, : h * d].view(t, h, d), buf[:, h * d: (h + hkv) * d].view(t, hkv, d)
        fn(q[..., :rot], k[..., :rot], cos, sin, interleaved=True)
        torch.testing.assert_close(q, want_q[0].transpose(0, 1), atol=tol, rtol=tol)
        torch.testing.assert_close(k, want_k[0].transpose(0, 1), atol=tol, rtol=tol)
        assert torch.equal(buf[:, (h + hkv) * d:], v_before)  # V untouched
    plain = qkv.clone()  # the halves layout gives other values: the flag is what changes the pairing
    apply_rotary_reference(plain[:, : h * d].view(t, h, d)[..., :rot],
                           plain[:, h * d: (h + hkv) * d].view(t, hkv, d)[..., :rot], cos, sin)
    assert not torch.allclose(plain[:, : h * d].view(t, h, d), want_q[0].transpose(0, 1))


def test_empty_batches_and_bad_shapes():
    x = _rand(0, 64, dtype=torch.float32)
    assert rms_norm(x, _rand(64, dtype=torch.float32), 1e-6).shape == (0, 64)
    assert silu_mul(_rand(0, 8, dtype=torch.float32)).shape == (0, 4)
    with pytest.raises(ValueError, match="weight"):
        rms_norm(_rand(2, 64, dtype=torch.float32), _rand(32, dtype=torch.float32), 1e-6)
    with pytest.raises(ValueError, match="residual"):
        rms_norm(_rand(2, 64, dtype=torch.float32), _rand(64, dtype=torch.float32), 1e-6,
                 residual=_rand(3, 64, dtype=torch.float32))
    with pytest.raises(ValueError, match="gate_up"):
        silu_mul(_rand(2, 7, dtype=torch.float32))
    q, k = _rand(2, 4, 16, dtype=torch.float32), _rand(2, 2, 16, dtype=torch.float32)
    with pytest.raises(ValueError, match="cos and sin"):
        apply_rotary(q, k, _rand(2, 8, dtype=torch.float32), _rand(2, 8, dtype=torch.float32))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("n", "k", "bias"), [(40, 1100, False), (24, 512, True), (7, 64, False)])
def test_gemv_matches_linear(dtype, n, k, bias):
    """Ragged N (not a multiple of the 8-row tile) and K (not a multiple of 512), strided weight rows (a
    slice of a merged matrix), optional bias."""
    from engine.ops.gemv import gemv, gemv_reference

    merged = _rand(n + 5, k, dtype=dtype, seed=6) * 0.05
    weight, x = merged[3:3 + n], _rand(1, k, dtype=dtype, seed=7)
    b = _rand(n, dtype=dtype, seed=8) if bias else None
    want = torch.nn.functional.linear(x.float(), weight.float(), None if b is None else b.float())
    torch.testing.assert_close(gemv_reference(x, weight, b), want.to(dtype), atol=0, rtol=0)
    got = gemv(x, weight, b)
    assert got.shape == (1, n) and got.dtype == dtype
    torch.testing.assert_close(got.float(), want, atol=TOL[dtype] * 4, rtol=TOL[dtype] * 4)
    for block_n, block_k in ((16, 256), (4, 1024)):
        torch.testing.assert_close(gemv(x, weight, b, block_n=block_n, block_k=block_k).float(), want,
                                   atol=TOL[dtype] * 4, rtol=TOL[dtype] * 4)
    with pytest.raises(ValueError, match=r"x \[1, K\]"):
        gemv(_rand(2, k, dtype=dtype), weight)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("n", "k"), [(40, 1100), (9, 512)])
def test_gated_gemv_equals_silu_mul_then_gemv(dtype, n, k):
    """SwiGLU's down projection with ``silu_mul`` folded into the GEMV's loads: bit-identical to the two
    kernels one after the other (same rounding points), close to the reference; a wrong width is named."""
    from engine.ops.gemv import gemv, gemv_reference, gemv_tile

    weight = _rand(n, k, dtype=dtype, seed=9) * 0.05
    gate_up = _rand(1, 2 * k, dtype=dtype, seed=10) * 2
    got = gemv(gate_up, weight, gated=True)  # the gated tile (gemv_tile(n, gated=True))
    block_n, block_k, num_warps = gemv_tile(n, gated=True)
    same_tile = gemv(silu_mul(gate_up), weight, block_n=block_n, block_k=block_k, num_warps=num_warps)
    assert torch.equal(got, same_tile)  # same tile: same sums
    torch.testing.assert_close(gemv_reference(gate_up, weight, gated=True),
                               gemv_reference(silu_mul_reference(gate_up), weight), atol=0, rtol=0)
    torch.testing.assert_close(got.float(), gemv_reference(gate_up, weight, gated=True).float(),
                               atol=TOL[dtype] * 4, rtol=TOL[dtype] * 4)
    with pytest.raises(ValueError, match=r"gate \| up"):
        gemv(gate_up[:, :k], weight, gated=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 3])
def test_qk_rms_norm_matches_qwen3_head_norms(dtype, tokens):
    """The query and key heads of a fused QKV output (strided: V columns after them) in one launch, each
    group with its own weight and epsilon, against transformers' ``Qwen3RMSNorm`` modules per group."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    from engine.ops.rms_norm import qk_rms_norm, qk_rms_norm_reference

    q_heads, k_heads, d = 4, 2, 32
    qkv = _rand(tokens, (q_heads + 2 * k_heads) * d, dtype=dtype)
    qk = qkv[:, :(q_heads + k_heads) * d].view(tokens, -1, d)
    norms = []
    for seed, eps in ((1, 1e-6), (2, 1e-5)):
        norm = Qwen3RMSNorm(d, eps=eps).to(DEVICE, dtype)
        norm.weight.data.copy_(_rand(d, dtype=dtype, seed=seed))
        norms.append(norm)
    want = torch.cat((norms[0](qk[:, :q_heads]), norms[1](qk[:, q_heads:])), dim=1)
    args = (q_heads, norms[0].weight, 1e-6, norms[1].weight, 1e-5)
    torch.testing.assert_close(qk_rms_norm_reference(qk, *args), want, atol=0, rtol=0)
    got = qk_rms_norm(qk, *args)
    assert got.shape == (tokens, q_heads + k_heads, d) and got.is_contiguous()
    torch.testing.assert_close(got, want, atol=TOL[dtype], rtol=TOL[dtype])
    with pytest.raises(ValueError, match="q_heads"):
        qk_rms_norm(qk, q_heads + k_heads + 1, *args[1:])
    with pytest.raises(ValueError, match="k_weight"):
        qk_rms_norm(qk, q_heads, norms[0].weight, 1e-6, norms[1].weight[:-1], 1e-5)


@pytest.mark.parametrize("fn", ["rms_norm", "rms_norm_reference"])
def test_rms_norm_refuses_a_weight_of_another_dtype(fn):
    """A float32 weight with a float16 input: the kernel would round the product to float16 while the
    reference (like transformers' module) promotes to float32, so the pair is refused by both."""
    import engine.ops.rms_norm as ops

    x = _rand(2, 64, dtype=torch.float16)
    message = r"weight dtype torch\.{} does not match x dtype torch\.{}"
    with pytest.raises(ValueError, match=message.format("float32", "float16")):
        getattr(ops, fn)(x, _rand(64, dtype=torch.float32), 1e-6)
    with pytest.raises(ValueError, match=message.format("float16", "float32")):
        getattr(ops, fn)(x.float(), _rand(64, dtype=torch.float16), 1e-6, residual=x.float().clone())


@pytest.mark.parametrize("fn", ["qk_rms_norm", "qk_rms_norm_reference"])
def test_qk_rms_norm_refuses_weights_of_another_dtype(fn):
    import engine.ops.rms_norm as ops

    qk = _rand(3, 6, 32, dtype=torch.float16)
    good, bad = _rand(32, dtype=torch.float16), _rand(32, dtype=torch.float32)
    for q_weight, k_weight in ((bad, good), (good, bad)):
        with pytest.raises(ValueError, match=rf"q_weight dtype {q_weight.dtype} and k_weight dtype "
                                             rf"{k_weight.dtype} must both be qk's dtype torch\.float16"):
            getattr(ops, fn)(qk, 4, q_weight, 1e-6, k_weight, 1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,with_residual", [(64, False), (96, True), (256, True)])
def test_rms_norm_fp8_equals_the_norm_then_the_per_token_quantizer(dtype, n, with_residual):
    """``rms_norm_fp8`` (what an FP8 projection gets from the norm before it in a prefill) gives what
    ``rms_norm`` followed by ``quantize_fp8_groups`` with one group per row gives: the residual updated
    the same way, the same e4m3 values but where a value sits at a rounding boundary, scales equal to
    float32 rounding (Triton may add the row's sum of squares in another order in the fused kernel: on an
    H200 a float32 scale differed in its last bit); and it matches its plain-torch reference."""
    x, w = _rand(7, n, dtype=dtype, seed=4) * 3, _rand(n, dtype=dtype, seed=5)
    x[2, :5] *= 40  # a row with outliers: its scale differs from the others'
    r = _rand(7, n, dtype=dtype, seed=6) if with_residual else None
    res_two, res_one, res_ref = ((r.clone(), r.clone(), r.clone()) if r is not None else (None, None, None))
    q_two, s_two = quantize_fp8_groups(rms_norm(x, w, 1e-6, residual=res_two), n)
    q, s = rms_norm_fp8(x, w, 1e-6, residual=res_one)
    assert q.dtype == FP8_DTYPE and q.shape == (7, n) and s.shape == (7, 1) and s.dtype == torch.float32
    if r is not None:
        assert torch.equal(res_one, res_two) and torch.equal(res_one, x + r)
    torch.testing.assert_close(s, s_two, rtol=1e-6, atol=0)
    # the e4m3 codes of the two agree but for a rare value on a boundary, which moves by one code
    codes, codes_two = q.view(torch.uint8).int(), q_two.view(torch.uint8).int()
    assert (codes - codes_two).abs().max().item() <= 1
    assert (codes != codes_two).float().mean().item() <= 0.01
    q_ref, s_ref = rms_norm_fp8_reference(x, w, 1e-6, residual=res_ref)
    torch.testing.assert_close(s, s_ref, rtol=TOL[dtype], atol=0)
    # each value within one e4m3 step (1/8 relative, or 2^-9 absolute below 2^-6) of the reference's
    got, want = q.float() * s, q_ref.float() * s_ref
    step = torch.maximum(want.abs() / 8, 2.0 ** -9 * s_ref)
    assert ((got - want).abs() <= step * (1 + TOL[dtype]) + TOL[dtype] * want.abs()).all()


def test_rms_norm_fp8_of_no_rows():
    q, s = rms_norm_fp8(torch.empty(0, 64, device=DEVICE), torch.ones(64, device=DEVICE), 1e-6)
    assert q.shape == (0, 64) and s.shape == (0, 1)


def test_gemv_tile_classes():
    """``gemv_tile``'s classes: Llama-3-8B's projections keep their tiles, Qwen3-30B-A3B's O (N <= 2048)
    and QKV (K <= 2048 between 4096 and 16384 rows) take theirs, and the gated down tile is untouched."""
    from engine.ops.gemv import gemv_tile

    assert gemv_tile(6144, k=4096) == (8, 512, 4) and gemv_tile(6144) == (8, 512, 4)
    assert gemv_tile(4096, k=4096) == (4, 1024, 4) and gemv_tile(4096, True, 14336) == (8, 1024, 4)
    assert gemv_tile(28672, k=4096) == (2, 1024, 4)
    assert gemv_tile(2048, k=4096) == (1, 1024, 4) and gemv_tile(2048, True, 768) == (8, 1024, 4)
    assert gemv_tile(5120, k=2048) == (4, 512, 4)
