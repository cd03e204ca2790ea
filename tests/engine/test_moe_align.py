"""The expert alignment (engine/ops/moe_align.py): the Triton program against its torch reference over
expert counts 8/60/128, top-k 1/2/8, 1-128 tokens, uneven loads and block_m 16/64, the grouping's
invariants, and the torch path past the program's size. On CPU through Triton's interpreter over a subset
(``grid``); the full grid on a GPU (scripts/gpu_tests.sh)."""

from __future__ import annotations

import pytest
import torch

from engine.ops.moe_align import MAX_KERNEL_ALIGN_PAIRS, max_blocks, moe_align, moe_align_reference
from tests.engine.grid import grid
from tests.engine.test_fused_moe import DEVICE, routing


@pytest.mark.parametrize("block_m", [16, 64])
def test_moe_align_groups_pairs_by_expert(block_m):
    gen = torch.Generator().manual_seed(3)
    ids = routing(8, 2, 40, "skewed", gen).to(DEVICE)
    align = moe_align(ids, 8, block_m)
    n = ids.numel()
    flat = ids.flatten()
    sorted_ids = align.sorted_ids.view(-1, block_m)
    assert sorted_ids.shape[0] == align.block_expert.numel() == max_blocks(n, 8, block_m)
    seen: list[int] = []
    for block, expert in zip(sorted_ids.tolist(), align.block_expert.tolist(), strict=True):
        real = [i for i in block if i < n]
        if expert == 8:  # past the end: only padding
            assert not real
            continue
        assert real and all(int(flat[i]) == expert for i in real)  # no empty block for an expert
        assert block[: len(real)] == real  # padding only at a run's end
        seen += real
    assert sorted(seen) == list(range(n))  # every pair exactly once
    assert align.block_expert.tolist() == sorted(align.block_expert.tolist())


# (experts, top_k, tokens, routing, block_m): non-power-of-two expert counts, one pair, a chunk boundary
# (64 pairs), several chunks, the kernel's largest size and the torch path just past it
ALIGN_FULL = [(e, k, t, r, bm) for e in (8, 60, 128) for k in (1, 2, 8) for t in (1, 8, 33, 128)
              for r in ("uniform", "skewed", "one") for bm in (16, 64)]
ALIGN_CPU = [(8, 1, 1, "uniform", 16), (60, 8, 8, "skewed", 16), (128, 8, 33, "uniform", 64),
             (128, 8, 128, "one", 16), (8, 2, 128, "skewed", 64)]


@pytest.mark.parametrize("experts,top_k,tokens,kind,block_m", grid(ALIGN_FULL, ALIGN_CPU))
def test_moe_align_kernel_equals_the_torch_reference(experts, top_k, tokens, kind, block_m):
    ids = routing(experts, top_k, tokens, kind, torch.Generator().manual_seed(tokens)).to(DEVICE)
    assert ids.numel() <= MAX_KERNEL_ALIGN_PAIRS  # the Triton program, not the torch path
    got, want = moe_align(ids, experts, block_m), moe_align_reference(ids, experts, block_m)
    assert got.sorted_ids.dtype == want.sorted_ids.dtype == torch.int32
    assert got.block_expert.dtype == want.block_expert.dtype == torch.int32
    assert got.sorted_ids.tolist() == want.sorted_ids.tolist()
    assert got.block_expert.tolist() == want.block_expert.tolist()


def test_moe_align_beyond_the_kernel_size_takes_the_torch_path():
    ids = routing(8, 2, MAX_KERNEL_ALIGN_PAIRS // 2 + 1, "skewed", torch.Generator().manual_seed(5))
    got, want = moe_align(ids, 8, 16), moe_align_reference(ids, 8, 16)
    assert got.sorted_ids.tolist() == want.sorted_ids.tolist()
    assert got.block_expert.tolist() == want.block_expert.tolist()
