"""The fused MoE kernels (engine/ops/fused_moe.py) against their per-expert torch reference and against
transformers' own experts module, over experts 8/64/128, top-k 1/2/8, 1-512 tokens and uneven loads
(one expert taking most pairs, empty experts). On CPU through Triton's interpreter over a subset
(``grid``); the full grid with bf16 on a GPU (scripts/gpu_tests.sh)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from engine.ops.fused_moe import fused_moe, fused_moe_reference, moe_path
from engine.ops.fused_moe_gemv import fused_moe_gemv
from tests.engine.grid import FULL_GRID, grid

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if CUDA else [])
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}

# (experts, top_k, tokens, routing): "uniform" draws k distinct experts per token; "skewed" sends most
# pairs to expert 0 and the rest to a few low-numbered experts (most experts empty); "one" routes every
# token's first slot to the same expert.
FULL = [(e, k, t, r) for e in (8, 64, 128) for k in (1, 2, 8) for t in (1, 7, 33, 128, 512)
        for r in ("uniform", "skewed", "one")]
CPU = [(8, 1, 1, "uniform"), (8, 2, 33, "skewed"), (8, 2, 512, "uniform"), (64, 8, 7, "skewed"),
       (128, 2, 1, "uniform"), (128, 8, 7, "one")]


def routing(experts: int, top_k: int, tokens: int, kind: str, gen: torch.Generator) -> torch.Tensor:
    """``topk_ids [tokens, top_k]`` int64, each row ``top_k`` distinct experts."""
    rows = []
    for _ in range(tokens):
        if kind == "uniform":
            rows.append(torch.randperm(experts, generator=gen)[:top_k])
            continue
        hot = 0 if kind == "one" or torch.rand((), generator=gen) < 0.8 else 1
        rest = torch.randperm(min(experts, 2 * top_k + 1), generator=gen)  # a few low-numbered experts
        rest = rest[rest != hot][: top_k - 1]
        rows.append(torch.cat([torch.tensor([hot]), rest]))
    return torch.stack(rows).to(torch.int64)


def moe_case(experts: int, top_k: int, tokens: int, kind: str, dtype: torch.dtype, hidden: int = 48,
             inter: int = 40, seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen)
    w_gate_up = torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden ** -0.5
    w_down = torch.randn(experts, hidden, inter, generator=gen) * inter ** -0.5
    ids = routing(experts, top_k, tokens, kind, gen)
    weights = torch.rand(tokens, top_k, generator=gen)
    return (x.to(dtype).to(DEVICE), w_gate_up.to(dtype).to(DEVICE), w_down.to(dtype).to(DEVICE),
            weights.to(DEVICE), ids.to(DEVICE))


# the matrix-vector path runs one program per pair and column tile: under the interpreter only few pairs;
# the routing reaches no branch of its kernels (no alignment), so one 7-token case (with empty experts)
GEMV_CPU = [(8, 1, 1, "uniform"), (64, 2, 7, "skewed"), (128, 2, 1, "uniform")]
CASES = [(*case, "grouped") for case in grid(FULL, CPU)] + [(*case, "gemv") for case in grid(FULL, GEMV_CPU)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("experts,top_k,tokens,kind,path", CASES)
def test_fused_moe_matches_reference(experts, top_k, tokens, kind, path, dtype):
    x, w_gate_up, w_down, weights, ids = moe_case(experts, top_k, tokens, kind, dtype)
    hits = torch.bincount(ids.flatten().cpu(), minlength=experts)
    if kind != "uniform" and 2 * top_k + 1 < experts:
        assert (hits == 0).any()  # uneven: empty experts
    if kind == "one":
        assert int(hits.max()) >= tokens  # one expert takes every token
    got = fused_moe(x, w_gate_up, w_down, weights, ids, path=path)
    want = fused_moe_reference(x, w_gate_up, w_down, weights, ids)
    assert got.dtype == dtype and got.shape == x.shape
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])


def test_reference_matches_transformers_experts():
    """The reference is transformers' Qwen3-MoE experts module (per-expert loop) in float32."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    cfg = Qwen3MoeConfig(hidden_size=48, moe_intermediate_size=40, num_experts=8)
    cfg._experts_implementation = "eager"
    module = Qwen3MoeExperts(cfg)
    x, w_gate_up, w_down, weights, ids = moe_case(8, 2, 9, "skewed", torch.float32)
    module.gate_up_proj.data.copy_(w_gate_up.cpu())
    module.down_proj.data.copy_(w_down.cpu())
    want = module(x.cpu(), ids.cpu(), weights.cpu())
    torch.testing.assert_close(fused_moe_reference(x, w_gate_up, w_down, weights, ids).cpu(), want,
                               atol=1e-6, rtol=1e-5)


def test_moe_path_picks_gemv_only_for_few_pairs():
    assert moe_path(1, 8, 128) == "gemv"  # a batch-1 decode of Qwen3-30B-A3B: 8 pairs over 128 experts
    assert moe_path(1, 2, 8) == "gemv"  # one token always (its k experts are distinct)
    assert moe_path(4, 8, 128) == "gemv"  # 32 pairs <= 128 / 4
    assert moe_path(5, 8, 128) == "grouped"
    assert moe_path(2, 2, 8) == "grouped"  # 4 pairs over 8 experts would share experts often
    assert moe_path(512, 8, 128) == "grouped"


def test_fused_moe_refuses_mismatched_shapes():
    x, w_gate_up, w_down, weights, ids = moe_case(8, 2, 3, "uniform", torch.float32)
    with pytest.raises(ValueError, match="expert weights do not fit"):
        fused_moe(x, w_gate_up, w_down[:, :, :-1], weights, ids)
    with pytest.raises(ValueError, match="topk_ids and topk_weights"):
        fused_moe(x, w_gate_up, w_down, weights[:, :1], ids)
    with pytest.raises(ValueError, match="path must be"):
        fused_moe(x, w_gate_up, w_down, weights, ids, path="dense")
    assert fused_moe(x[:0], w_gate_up, w_down, weights[:0], ids[:0]).shape == (0, 48)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_fused_moe_decode_is_cuda_graph_capturable():
    """A batch-1 decode's MoE replays from a CUDA graph with new routing each step (no host sync)."""
    assert FULL_GRID
    x, w_gate_up, w_down, weights, ids = moe_case(64, 8, 1, "uniform", torch.bfloat16)
    assert moe_path(1, 8, 64) == "gemv"
    static_x, static_w, static_ids = x.clone(), weights.clone(), ids.clone()
    fused_moe(static_x, w_gate_up, w_down, static_w, static_ids)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe(static_x, w_gate_up, w_down, static_w, static_ids)
    for seed in range(3):
        x2, _, _, w2, ids2 = moe_case(64, 8, 1, "uniform", torch.bfloat16, seed=seed + 10)
        static_x.copy_(x2)
        static_w.copy_(w2)
        static_ids.copy_(ids2)
        graph.replay()
        want = fused_moe_reference(x2, w_gate_up, w_down, w2, ids2)
        torch.testing.assert_close(out.float(), want.float(), atol=2e-2, rtol=2e-2)


class _DispatchLog(TorchDispatchMode):
    """Records every aten op run under it as ``(name, kwargs)``."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, dict]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append((str(func), dict(kwargs or {})))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("path", ["gemv", "grouped"])
def test_half_precision_routing_weights_are_not_cast_before_the_kernels(path):
    """Qwen3-MoE's router rounds its weights to the model dtype: ``fused_moe`` hands them to the kernels as
    they are (each widened to float32 as it is loaded), so no float32 cast runs per layer, and the result
    equals the reference's with the same weights."""
    x, w_gate_up, w_down, weights, ids = moe_case(8, 2, 3, "uniform", torch.float16)
    weights = weights.to(torch.float16)
    with _DispatchLog() as log:
        got = fused_moe(x, w_gate_up, w_down, weights, ids, path=path)
    casts = [op for op, kw in log.ops if op.startswith("aten._to_copy") and kw.get("dtype") == torch.float32]
    assert casts == []
    want = fused_moe_reference(x, w_gate_up, w_down, weights, ids)
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[torch.float16], rtol=TOL[torch.float16])


DOWN_SLOT_CASES = [(8, 1, 8), (8, 2, 4), (3, 1, 2), (2, 1, 4), (3, 2, 4)]  # (top_k, tokens, slots)


def _prefetch_taken(top_k: int, slots: int, scale: str | None) -> bool:
    return slots >= top_k and scale != "block"


@pytest.mark.parametrize("scale", [None, "channel", "block"])
@pytest.mark.parametrize("top_k,tokens,slots", DOWN_SLOT_CASES)
def test_down_prefetch_is_taken_only_where_the_slots_fit_one_round_without_block_scales(scale, top_k, tokens,
                                                                                        slots):
    """``down_prefetch=True`` runs the down kernel with ``PREFETCH`` only where every slot fits one round and
    the experts are not block-scaled; elsewhere it is the kernel without (so the kernel test below runs
    prefetch only where it is taken)."""
    from engine.ops.fused_moe_fp8 import ExpertScales
    from engine.ops.fused_moe_gemv import down_prefetches

    one = torch.ones(1)
    scales = None if scale is None else ExpertScales(one, one, (16, 16) if scale == "block" else None)
    inter = 32 if scale == "block" else 40
    assert down_prefetches(tokens, top_k, slots, inter, scales, True) == _prefetch_taken(top_k, slots, scale)
    assert not down_prefetches(tokens, top_k, slots, inter, scales, False)


@pytest.mark.parametrize("top_k,tokens,slots,scale,prefetch", [
    (*case, scale, prefetch) for prefetch in (False, True) for scale in (None, "channel", "block")
    for case in DOWN_SLOT_CASES if not prefetch or _prefetch_taken(case[0], case[2], scale)])
def test_down_gemv_slots_read_at_once_match_the_reference(scale, top_k, tokens, slots, prefetch):
    """The down matrix-vector kernel reading ``slots`` of a token's experts at once (all of them, a part of
    them over several rounds, or more slots than ``top_k`` with the rest masked) equals the reference and,
    up to float reassociation, the one-expert-at-a-time kernel; FP8 experts with per-row or block scales
    too; with ``down_prefetch`` where it is taken (the slots fit one round and the scales are not block
    scales; elsewhere it runs the kernel without, which the cases without cover). A ``down_slots`` that is
    not a power of two is refused."""
    from engine.ops.fused_moe_fp8 import ExpertScales, quantize_experts
    from engine.ops.fused_moe_gemv import down_prefetches

    dtype = torch.float16
    # width 40: two full 16-input chunks and a ragged one (block scales need a width their blocks divide)
    inter = 32 if scale == "block" else 40
    x, w_gate_up, w_down, weights, ids = moe_case(16, top_k, tokens, "uniform", torch.float32, inter=inter)
    scales = None
    if scale is not None:
        block = (16, 16) if scale == "block" else None
        w_gate_up, s_up = quantize_experts(w_gate_up, block)
        w_down, s_down = quantize_experts(w_down, block)
        scales = ExpertScales(s_up, s_down, block)
    else:
        w_gate_up, w_down = w_gate_up.to(dtype), w_down.to(dtype)
    x = x.to(dtype)
    # block_k 16 < inter: several rounds over the inputs; 8 of the 48 outputs per program (no column tail
    # with 4 either)
    tile = (8, 16, 4)
    # the gate/up kernel (not what this test is about: the cases above run it on its default tiles) with 8
    # columns per program and two rounds over the 48 inputs (the second ragged) instead of the default 1
    # or 2 columns in one round: a quarter to an eighth of its interpreted programs
    up = (8, 32, 4)
    got = fused_moe_gemv(x, w_gate_up, w_down, weights, ids, up_tile=up, down_tile=tile, down_slots=slots,
                         scales=scales, down_prefetch=prefetch)
    assert down_prefetches(tokens, top_k, slots, inter, scales, prefetch) == (prefetch and slots >= top_k
                                                                       and scale != "block")
    one = fused_moe_gemv(x, w_gate_up, w_down, weights, ids, up_tile=up, down_tile=tile, down_slots=1,
                         scales=scales)
    want = fused_moe_reference(x, w_gate_up, w_down, weights, ids, scales=scales)
    # FP8 scales: the matrix-vector kernels never round a dequantized weight to the dtype, the reference does
    atol = TOL[dtype] * (3 if scale is not None else 1)
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=TOL[dtype])
    torch.testing.assert_close(got.float(), one.float(), atol=TOL[dtype], rtol=TOL[dtype])
    with pytest.raises(ValueError, match="down_slots"):
        fused_moe_gemv(x, w_gate_up, w_down, weights, ids, down_slots=3, scales=scales)


def test_gemv_tiles_per_token_count_expert_width_and_fp8():
    """The matrix-vector path's defaults: Qwen3-30B-A3B-wide experts take the swept tiles (one token every
    slot at once, with the prefetch), per-row-scaled FP8 experts the former tiles past one token, and
    block-scaled FP8 experts and experts wider than the sweep the former tiles throughout."""
    from engine.ops.fused_moe_gemv import gemv_moe_prefetch, gemv_moe_slots, gemv_moe_tile

    assert gemv_moe_tile(1, False, 768) == (1, 1024, 4) and gemv_moe_tile(1, True, 768) == (2, 128, 4)
    assert gemv_moe_tile(1, True, 768, "channel") == (2, 128, 4)
    assert gemv_moe_tile(1, True, 768, "block") == (2, 1024, 4)
    assert gemv_moe_tile(2, True, 768) == (4, 256, 4) and gemv_moe_tile(4, True, 768) == (8, 128, 4)
    assert gemv_moe_tile(2, False, 768) == (2, 512, 4)
    assert gemv_moe_tile(2, False, 768, "channel") == (8, 512, 4)
    assert gemv_moe_tile(2, True, 768, "channel") == (2, 256, 4)
    assert gemv_moe_tile(1, True, 14336) == (2, 1024, 4)
    assert gemv_moe_slots(1, 8, 768) == 8 and gemv_moe_slots(1, 2, 768) == 2
    assert gemv_moe_slots(1, 3, 768) == 4
    assert gemv_moe_slots(2, 8, 768) == 2 and gemv_moe_slots(2, 8, 768, "channel") == 4
    assert gemv_moe_slots(1, 2, 14336) == 1 and gemv_moe_slots(1, 8, 768, "block") == 1
    assert gemv_moe_prefetch(1, 8, 8, 768) and not gemv_moe_prefetch(2, 8, 2, 768)
    assert not gemv_moe_prefetch(1, 8, 4, 768) and not gemv_moe_prefetch(1, 2, 2, 14336)
