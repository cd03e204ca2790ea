"""Expert alignment for the grouped-GEMM MoE kernels: a step's routed (token, slot) pairs sorted by expert,
each expert's run padded to a multiple of ``block_m`` rows (Triton + reference).

``moe_align`` runs on the device with a fixed-size output (no host sync, so a decode step stays capturable
in a CUDA graph): ``sorted_ids`` holds flat pair indices ``t * k + j`` (padding: ``T * k``) and
``block_expert`` the expert of each ``block_m``-row block (``E`` for blocks past the end). Empty experts
own no block; an expert's last block is partly padding. ``moe_align_reference`` is the plain-torch
version. Method as the alignment step of the "fused MoE" kernels of vLLM and SGLang (MegaBlocks'
block-sparse grouping, Gale et al. 2022); ``engine.ops.fused_moe`` consumes the result.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine.ops.pdl import gdc_enter, pdl_kwargs


@dataclass(frozen=True)
class MoEAlignment:
    """The (token, slot) pairs grouped by expert, from ``moe_align``.

    Attributes:
        sorted_ids: int32 ``[num_blocks * block_m]``: flat pair indices ``t * k + j`` grouped by expert,
            each expert's run padded to a multiple of ``block_m`` with ``T * k`` (no pair).
        block_expert: int32 ``[num_blocks]``: the expert of each block; ``num_experts`` for blocks past
            the last expert's run.
        block_m: rows per block.
    """

    sorted_ids: torch.Tensor
    block_expert: torch.Tensor
    block_m: int


def max_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Blocks ``moe_align`` allocates: every pair in a block plus, for each expert that can be hit (at most
    ``min(num_pairs, num_experts)``), one partly filled block."""
    return triton.cdiv(num_pairs, block_m) + min(num_pairs, num_experts)


def moe_align_reference(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> MoEAlignment:
    """Plain-torch ``moe_align`` (a stable argsort by expert, counts, cumulative sums, a scatter and a
    search: about twenty small kernels on a GPU). Same arguments and result."""
    device = topk_ids.device
    flat = topk_ids.reshape(-1).to(torch.int64)
    n = flat.numel()
    blocks = max_blocks(n, num_experts, block_m)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    padded_start = padded_end - padded
    count_start = torch.cumsum(counts, 0) - counts
    order = torch.argsort(flat, stable=True)
    experts = flat[order]
    rank = torch.arange(n, device=device) - count_start[experts]
    sorted_ids = torch.full((blocks * block_m,), n, dtype=torch.int32, device=device)
    sorted_ids[padded_start[experts] + rank] = order.to(torch.int32)
    block_start = torch.arange(blocks, device=device, dtype=torch.int64) * block_m
    block_expert = torch.searchsorted(padded_end, block_start, right=True).to(torch.int32)
    return MoEAlignment(sorted_ids, block_expert, block_m)


MAX_KERNEL_ALIGN_PAIRS = 1024  # moe_align: one Triton program up to this many pairs, the torch path beyond


@triton.jit
def _moe_align_kernel(  # type: ignore[no-untyped-def]  # Triton kernel: arguments are typed by @triton.jit
    ids_ptr, sorted_ptr, block_expert_ptr, num_pairs, num_blocks,
    NUM_EXPERTS: tl.constexpr, E_PAD: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr,
    USE_GDC: tl.constexpr,
):
    gdc_enter(USE_GDC)  # the routing comes from the kernel just before
    experts = tl.arange(0, E_PAD)
    counts = tl.zeros([E_PAD], dtype=tl.int32)
    for start in range(0, num_pairs, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=-1).to(tl.int32)
        counts += tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_end = tl.cumsum(padded, axis=0)
    padded_start = padded_end - padded
    for start in range(0, num_blocks * BLOCK_M, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        tl.store(sorted_ptr + offs, tl.zeros([CHUNK], dtype=tl.int32) + num_pairs,
                 mask=offs < num_blocks * BLOCK_M)
    for start in range(0, num_blocks, CHUNK):
        blocks = start + tl.arange(0, CHUNK)
        below = (padded_end[None, :] <= (blocks * BLOCK_M)[:, None]).to(tl.int32)
        tl.store(block_expert_ptr + blocks, tl.minimum(tl.sum(below, axis=1), NUM_EXPERTS),
                 mask=blocks < num_blocks)
    tl.debug_barrier()  # the padding above lands before the pairs below overwrite it
    running = padded_start
    lanes = tl.arange(0, CHUNK)
    for start in range(0, num_pairs, CHUNK):
        offs = start + lanes
        valid = offs < num_pairs
        ids = tl.load(ids_ptr + offs, mask=valid, other=-1).to(tl.int32)
        onehot = (ids[:, None] == experts[None, :]).to(tl.int32)  # [CHUNK, E_PAD]
        base = tl.sum(onehot * running[None, :], axis=1)
        earlier = (ids[:, None] == ids[None, :]) & (lanes[None, :] < lanes[:, None])
        rank = tl.sum(earlier.to(tl.int32), axis=1)
        tl.store(sorted_ptr + base + rank, offs, mask=valid)
        running += tl.sum(onehot, axis=0)


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> MoEAlignment:
    """Group the routed pairs by expert, each expert's run padded to ``block_m`` rows, on ``topk_ids``'
    device with shapes that depend only on ``topk_ids.shape`` (CUDA-graph capturable).

    Up to ``MAX_KERNEL_ALIGN_PAIRS`` pairs (decode and short prefill steps) one Triton program does it
    all, a counting sort: it counts the pairs per expert (one-hot sums over chunks of pairs), takes the
    padded runs' starts by a cumulative sum, writes the padding and each block's expert, then walks the
    pairs in order, each going to its expert's next free row (its rank among the chunk's earlier pairs of
    that expert, plus the expert's running count), so the order is stable. More pairs take
    ``moe_align_reference``'s torch path, which parallelises over them.

    Args:
        topk_ids: integer ``[T, k]``, each in ``[0, num_experts)``.
        num_experts: ``E``.
        block_m: rows per block (power of two, >= 16 for ``tl.dot``).

    Returns:
        ``MoEAlignment``; within an expert, pairs keep their flat order (stable sort).
    """
    n = topk_ids.numel()
    if n > MAX_KERNEL_ALIGN_PAIRS or n == 0:
        return moe_align_reference(topk_ids, num_experts, block_m)
    flat = topk_ids.reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    blocks = max_blocks(n, num_experts, block_m)
    sorted_ids = torch.empty((blocks * block_m,), dtype=torch.int32, device=topk_ids.device)
    block_expert = torch.empty((blocks,), dtype=torch.int32, device=topk_ids.device)
    _moe_align_kernel[(1,)](
        flat, sorted_ids, block_expert, n, blocks,
        NUM_EXPERTS=num_experts, E_PAD=triton.next_power_of_2(num_experts), BLOCK_M=block_m, CHUNK=64,
        num_warps=4, **pdl_kwargs(topk_ids),
    )
    return MoEAlignment(sorted_ids, block_expert, block_m)
