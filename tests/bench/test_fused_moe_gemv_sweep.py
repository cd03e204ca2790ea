"""The candidates of ``bench.kernels.fused_moe_gemv_sweep`` are valid tiles that compute the right layer
(CPU: Triton's interpreter, on the ``tiny`` shape), and its routings deal each call's experts without
repeats within a token and, while the experts last, none shared with the other calls. Timing needs a GPU
(the lead's H200 run)."""

from __future__ import annotations

import pytest
import torch

from bench.kernels.fused_moe import SHAPES, layer
from bench.kernels.fused_moe_gemv_sweep import (
    DOWN_TILES,
    ROUTER_TILES,
    UP_TILES,
    Candidate,
    candidate,
    parse_tile,
    routings,
)
from engine.ops.fused_moe import fused_moe_reference
from engine.ops.fused_moe_gemv import fused_moe_gemv
from engine.ops.gemv import gemv, gemv_reference


def test_routings_deal_disjoint_experts() -> None:
    calls = routings(16, 1, 128, 8, torch.device("cpu"))
    ids = torch.cat([i for _, i in calls]).flatten().tolist()
    assert len(set(ids)) == 128  # 16 calls x 8 experts: every expert once
    for weights, rows in routings(4, 8, 128, 8, torch.device("cpu")):
        assert all(len(set(r)) == 8 for r in rows.tolist())
        torch.testing.assert_close(weights.sum(-1), torch.ones(8))


def test_parse_tile_refuses_malformed_text() -> None:
    assert parse_tile("2x256x4x8", 4) == (2, 256, 4, 8)
    for bad in ("2x256x4", "2x0x4x8", "2x256xfour"):
        with pytest.raises(ValueError):
            parse_tile(bad, 4)


def test_candidate_sends_each_tile_to_its_own_kernel() -> None:
    # a down tile once reached the gate/up kernel, so the down rows timed gate/up tiles
    assert candidate(down="2x256x4x8") == Candidate(None, (2, 256, 4), 8, False)
    assert candidate(down="1x1024x4x8p") == Candidate(None, (1, 1024, 4), 8, True)
    assert candidate(up="8x512x4") == Candidate((8, 512, 4), None, None, None)
    assert candidate("2x1024x4", "4x256x4x2") == Candidate((2, 1024, 4), (4, 256, 4), 2, False)
    assert candidate() == Candidate()
    with pytest.raises(ValueError):
        candidate(down="2x256x4xp")


def test_every_default_candidate_computes_the_layer() -> None:
    experts, top_k, hidden, inter = SHAPES["tiny"]
    x, w_gate_up, w_down, weights, ids = layer(experts, top_k, hidden, inter, 1, torch.float32,
                                               torch.device("cpu"))
    want = fused_moe_reference(x, w_gate_up, w_down, weights, ids)
    for text in UP_TILES:
        bn, bk, warps = parse_tile(text, 3)
        got = fused_moe_gemv(x, w_gate_up, w_down, weights, ids, up_tile=(bn, bk, warps))
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5, msg=text)
    for text in DOWN_TILES:
        c = candidate(down=text)
        got = fused_moe_gemv(x, w_gate_up, w_down, weights, ids, down_tile=c.down_tile,
                             down_slots=c.down_slots, down_prefetch=c.down_prefetch)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5, msg=text)
    router = torch.randn(experts, hidden, generator=torch.Generator().manual_seed(2))
    for text in ROUTER_TILES:
        bn, bk, warps = parse_tile(text, 3)
        torch.testing.assert_close(gemv(x, router, block_n=bn, block_k=bk, num_warps=warps),
                                   gemv_reference(x, router), atol=2e-5, rtol=2e-5, msg=text)
