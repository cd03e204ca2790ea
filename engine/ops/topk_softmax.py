"""Softmax top-k routing of a mixture of experts in one launch (Triton kernel + plain-torch reference).

Qwen3-MoE's and Mixtral's routers (transformers' ``Qwen3MoeTopKRouter`` / ``MixtralTopKRouter``) take the
softmax of each token's router logits in float32, keep the ``k`` largest probabilities, optionally divide
them by their sum (``norm_topk_prob``; Mixtral always does), and round the weights to an output dtype
(Qwen3-MoE: the logits' dtype; Mixtral: float32). As separate torch ops that is about six launches per
layer, and a batch-1 decode step is bound by launches, not bytes. One Triton program handles one row:
the softmax over the ``E`` experts (padded to a power of two, padding at minus infinity), then ``k``
rounds of "largest, lowest index among equals" (a selection over at most a few hundred values), then the
renormalisation and the rounding.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.ops.pdl import gdc_enter, pdl_kwargs


@triton.jit
def _topk_softmax_kernel(  # type: ignore[no-untyped-def]  # Triton kernel: arguments are typed by @triton.jit
    logits_ptr, weights_ptr, ids_ptr, num_experts, stride_l,
    TOP_K: tl.constexpr, BLOCK_K: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr,
    USE_GDC: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    experts = tl.arange(0, BLOCK_E)
    mask = experts < num_experts
    gdc_enter(USE_GDC)  # the logits come from the kernel just before
    x = tl.load(logits_ptr + row * stride_l + experts, mask=mask, other=-float("inf")).to(tl.float32)
    e = tl.exp(x - tl.max(x, axis=0))
    p = e / tl.sum(e, axis=0)
    p = tl.where(mask, p, -1.0)
    slots = tl.arange(0, BLOCK_K)  # TOP_K padded to a power of two
    vals = tl.zeros((BLOCK_K,), dtype=tl.float32)
    ids = tl.zeros((BLOCK_K,), dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(p, axis=0)
        pick = tl.min(tl.where(p == best, experts, BLOCK_E), axis=0)
        vals = tl.where(slots == j, best, vals)
        ids = tl.where(slots == j, pick, ids)
        p = tl.where(experts == pick, -1.0, p)
    if RENORMALIZE:
        vals = vals / tl.sum(vals, axis=0)
    keep = slots < TOP_K
    tl.store(weights_ptr + row * TOP_K + slots, vals.to(weights_ptr.dtype.element_ty), mask=keep)
    tl.store(ids_ptr + row * TOP_K + slots, ids.to(ids_ptr.dtype.element_ty), mask=keep)


def _check(logits: torch.Tensor, top_k: int) -> None:
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"logits must be [T, E] with a contiguous last dim, got {tuple(logits.shape)}")
    if not 1 <= top_k <= logits.shape[1]:
        raise ValueError(f"top_k must be in [1, {logits.shape[1]}], got {top_k}")


def topk_softmax(logits: torch.Tensor, top_k: int, renormalize: bool,
                 out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``top_k`` largest softmax probabilities of each row of ``logits`` and their experts (Triton).

    Args:
        logits: ``[T, E]`` router logits (any float dtype; the softmax is taken in float32).
        top_k: experts per token, ``1 <= top_k <= E``.
        renormalize: divide the kept probabilities by their sum (in float32).
        out_dtype: dtype the weights are rounded to.

    Returns:
        ``(weights [T, top_k] out_dtype, ids [T, top_k] int64)``, largest first; among equal
        probabilities the lower expert index comes first.

    Raises:
        ValueError: a shape, stride or ``top_k`` that does not fit.
    """
    _check(logits, top_k)
    t, e = logits.shape
    weights = torch.empty((t, top_k), dtype=out_dtype, device=logits.device)
    ids = torch.empty((t, top_k), dtype=torch.int64, device=logits.device)
    if t:
        _topk_softmax_kernel[(t,)](
            logits, weights, ids, e, logits.stride(0), TOP_K=top_k, BLOCK_K=triton.next_power_of_2(top_k),
            RENORMALIZE=renormalize,
            BLOCK_E=triton.next_power_of_2(e), num_warps=1 if e <= 128 else 4, **pdl_kwargs(logits),
        )
    return weights, ids


def topk_softmax_reference(logits: torch.Tensor, top_k: int, renormalize: bool,
                           out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch ``topk_softmax``, the arithmetic of transformers' Qwen3-MoE and Mixtral routers
    (``softmax`` in float32, ``topk``, the optional division by the sum, the rounding). Same arguments and
    errors; the order among exactly equal probabilities is ``torch.topk``'s."""
    _check(logits, top_k)
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(out_dtype), ids
