"""The fused softmax top-k router (engine/ops/topk_softmax.py) against its torch reference and against
transformers' Qwen3-MoE and Mixtral routers, over experts 8/60/128/256, top-k 1/2/8 and 1-65 tokens. On
CPU through Triton's interpreter over a subset (``grid``); the full grid on a GPU."""

from __future__ import annotations

import pytest
import torch

from engine.ops.topk_softmax import topk_softmax, topk_softmax_reference
from tests.engine.grid import grid

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FULL = [(e, k, t, r, d) for e in (8, 60, 128, 256) for k in (1, 2, 8) for t in (1, 7, 65)
        for r in (True, False) for d in (torch.float32, torch.bfloat16) if k <= e]
CPU = [(8, 2, 7, True, torch.float32), (60, 8, 1, False, torch.bfloat16), (128, 8, 65, True, torch.bfloat16),
       (256, 1, 7, False, torch.float32)]


@pytest.mark.parametrize("experts,top_k,tokens,renormalize,dtype", grid(FULL, CPU))
def test_topk_softmax_matches_reference(experts, top_k, tokens, renormalize, dtype):
    gen = torch.Generator().manual_seed(experts * 100 + tokens)
    # distinct logits in every row, exact in bf16 (multiples of 1/16 below 16 in magnitude): no ties
    ranks = torch.stack([torch.randperm(experts, generator=gen) for _ in range(tokens)])
    logits = ((ranks - experts / 2) / 16).to(dtype).to(DEVICE)
    weights, ids = topk_softmax(logits, top_k, renormalize, dtype)
    want_w, want_ids = topk_softmax_reference(logits, top_k, renormalize, dtype)
    assert weights.dtype == dtype and ids.dtype == torch.int64 and ids.shape == (tokens, top_k)
    assert torch.equal(ids, want_ids)
    tol = 1e-6 if dtype == torch.float32 else 8e-3
    torch.testing.assert_close(weights.float(), want_w.float(), atol=tol, rtol=tol)
    if renormalize:
        torch.testing.assert_close(weights.float().sum(-1), torch.ones(tokens, device=DEVICE),
                                   atol=tol * top_k, rtol=0)


def test_ties_pick_the_lower_expert_first():
    logits = torch.tensor([[0.0, 2.0, 1.0, 2.0, 2.0]], device=DEVICE)
    _, ids = topk_softmax(logits, 3, True, torch.float32)
    assert ids.tolist() == [[1, 3, 4]]


def test_reference_is_transformers_routers():
    from transformers import MixtralConfig, Qwen3MoeConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    gen = torch.Generator().manual_seed(5)
    x = torch.randn(9, 32, generator=gen)
    for router, renorm, out in (
            (Qwen3MoeTopKRouter(Qwen3MoeConfig(hidden_size=32, num_experts=16, num_experts_per_tok=4,
                                               norm_topk_prob=True)), True, torch.float32),
            (MixtralTopKRouter(MixtralConfig(hidden_size=32, num_local_experts=8, num_experts_per_tok=2)),
             True, torch.float32)):
        router.weight.data.copy_(torch.randn(router.weight.shape, generator=gen))
        logits, want_w, want_ids = router(x)
        got_w, got_ids = topk_softmax_reference(logits, router.top_k, renorm, out)
        assert torch.equal(got_ids, want_ids)
        torch.testing.assert_close(got_w, want_w, atol=0, rtol=0)


def test_refuses_bad_arguments():
    with pytest.raises(ValueError, match="top_k must be in"):
        topk_softmax(torch.zeros(2, 4, device=DEVICE), 5, True, torch.float32)
    with pytest.raises(ValueError, match="logits must be"):
        topk_softmax(torch.zeros(4, device=DEVICE), 1, True, torch.float32)
