"""bench/engine/moe_decode.py: the bytes its roofline counts (dense weights, one expert per sparse layer,
every expert) and the distinct experts its probe measures, on a tiny random Qwen3-MoE on the CPU."""

from __future__ import annotations

import pytest
import torch

from bench.engine import moe_decode
from tests.engine.test_loader import save_tiny_model


def test_moe_roofline_bytes_and_probed_experts(tmp_path):
    path = save_tiny_model("Qwen3MoeForCausalLM", tmp_path / "m", seed=2)  # layers 0, 2 sparse; 1 dense
    args = moe_decode.build_parser().parse_args(
        ["--model", str(path), "--device", "cpu", "--dtype", "float32", "--batches", "3",
         "--num-blocks", "64", "--attention-backend", "torch"])
    core = moe_decode.build_engine(args)
    model = core.runner.model
    weights = moe_decode.moe_weights(model)
    cfg = model.config
    hidden, inter = cfg.hidden_size, cfg.moe_intermediate_size
    assert weights.expert_bytes == (3 * hidden * inter * 4,) * 2 and weights.num_experts == 8
    assert weights.top_k == 2
    total = sum(p.numel() * 4 for p in model.parameters())
    embed = model.model.embed_tokens.weight.numel() * 4
    assert weights.all_bytes == total - embed
    assert weights.dense_bytes == total - embed - 2 * 8 * weights.expert_bytes[0]
    distinct = moe_decode.probe_distinct(core, batch=3, context=5, steps=2)
    assert len(distinct) == 2 and all(2 <= d <= 6 for d in distinct)  # top-2 of 8 for 3 rows
    assert core.runner.decode_graphs is None and not core.has_unfinished()
    assert moe_decode.uniform_distinct(8, 2, 1) == pytest.approx(2.0)
    assert moe_decode.uniform_distinct(128, 8, 32) == pytest.approx(128 * (1 - (120 / 128) ** 32))
    no_moe = torch.nn.Module()
    no_moe.model = type("Inner", (), {"layers": []})()  # a dense model's shape: no layer with experts
    with pytest.raises(ValueError, match="no sparse MoE layer"):
        moe_decode.moe_weights(no_moe)
