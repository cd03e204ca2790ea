"""The candidates of ``bench.kernels.fused_moe_gemv_sweep`` are valid tiles that compute the right layer
(CPU: Triton's interpreter, on the ``tiny`` shape), and its routings deal each call's experts without
repeats within a token and, while the experts last, none shared with the other calls. Timing needs a GPU
(the lead's H200 run)."""

from __future__ import annotations

import pytest
import torch

from bench.kernels import fused_moe_gemv_sweep as sweep
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
from engine.ops.fused_moe_gemv import fused_moe_gemv, gemv_moe_slots, gemv_moe_tile
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
    # the kernel a candidate does not tile runs one program per pair or token (its one-token default
    # tiles run one per output column or two: under the interpreter, most of each candidate's time)
    whole_up, whole_down = (inter, hidden, 4), (hidden, inter, 4)
    for text in UP_TILES:
        bn, bk, warps = parse_tile(text, 3)
        got = fused_moe_gemv(x, w_gate_up, w_down, weights, ids, up_tile=(bn, bk, warps),
                             down_tile=whole_down)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5, msg=text)
    for text in DOWN_TILES:
        c = candidate(down=text)
        got = fused_moe_gemv(x, w_gate_up, w_down, weights, ids, up_tile=whole_up, down_tile=c.down_tile,
                             down_slots=c.down_slots, down_prefetch=c.down_prefetch)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5, msg=text)
    router = torch.randn(experts, hidden, generator=torch.Generator().manual_seed(2))
    for text in ROUTER_TILES:
        bn, bk, warps = parse_tile(text, 3)
        torch.testing.assert_close(gemv(x, router, block_n=bn, block_k=bk, num_warps=warps),
                                   gemv_reference(x, router), atol=2e-5, rtol=2e-5, msg=text)


@pytest.mark.parametrize("layout", ["channel", "block"])
def test_fp8_sweep_rows_run_the_fp8_experts(layout: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--fp8``: every row runs the quantized experts with their scales (errors against the dequantizing
    reference within ``--atol``), the default row names the tiles of the FP8 layout, and a prefetching down
    tile is refused for block scales only. Timing is patched out (it replays CUDA graphs)."""
    monkeypatch.setattr(sweep, "per_call_seconds", lambda fn, calls, replays: 1e-6)
    monkeypatch.setitem(SHAPES, "tiny", (8, 2, 128, 128))  # one 128 x 128 scale block per expert width
    args = sweep.build_parser().parse_args(["--shape", "tiny", "--fp8", layout, "--calls", "2",
                                            "--router-tiles", "--up-tiles", "2x1024x4", "8x256x4",
                                            "--down-tiles", "4x256x4x2", "2x128x4x8p"])
    w_gate_up, w_down, scales = sweep.experts_weights("tiny", torch.float32, layout, torch.device("cpu"))
    assert w_gate_up.dtype == w_down.dtype == torch.float8_e4m3fn and scales is not None
    assert (scales.block is None) == (layout == "channel")
    row = sweep.sweep_tokens(args, 1, 1e12, w_gate_up, w_down, torch.device("cpu"), scales, torch.float32)
    _, top_k, hidden, inter = SHAPES["tiny"]
    assert row["bytes_per_call"] == 2 * 3 * inter * hidden  # two distinct experts, one byte per weight
    up, down = gemv_moe_tile(1, False, inter, layout), gemv_moe_tile(1, True, inter, layout)
    slots = gemv_moe_slots(1, top_k, inter, layout)
    assert row["default"]["up"] == "x".join(map(str, up))
    assert row["default"]["down"].removesuffix("p") == "x".join(map(str, (*down, slots)))
    assert row["default"]["down"].endswith("p") == (layout == "channel")  # one token: prefetch, per row
    for kind in ("up", "down"):
        for name, r in row[kind].items():
            if layout == "block" and name.endswith("p"):
                assert "error" in r and "block scales" in r["error"], name
            else:
                assert r["ok"] and r["max_abs_err"] <= args.atol, (name, r)
    assert set(row["up"]) == {"2x1024x4", "8x256x4"} and set(row["down"]) == {"4x256x4x2", "2x128x4x8p"}
    assert row["best"]["ok"]
