"""Causal self-attention of one sequence with no cached context through cuDNN's fused attention (torch
SDPA, ``SDPBackend.CUDNN_ATTENTION``): the Hopper kernels (wgmma, TMA, warp specialisation) that the paged
Triton prefill kernel (engine/ops/paged_prefill.py) does not have. On an H200 (Llama-3-8B heads, bf16) an
8192-token prompt ran at 616 TFLOP/s here against 379 in the paged kernel (bench.kernels.prefill_attention,
docs/benchmarks/engine.md). Only a step whose one sequence starts at position 0 fits: its K/V are the
step's own (contiguous, no paged gather) and the mask is the square causal one SDPA implements. The
triton backend takes it for such steps of at least ``CUDNN_MIN_TOKENS`` tokens (``fresh_prefill_usable``);
a step with cached context, several sequences, an FP8 cache (whose dequantized values the paged kernel
attends over) or shorter prompts stays on the paged kernel. Reference: ``causal_attention_reference``.

Layout: cuDNN attends over one ``[T_padded, H + 2 Hkv, D]`` buffer (sequence-major, rows past ``T`` zero),
so that every call of a length bucket has the strides of the plan the warm-up built. The fused model
writes its QKV projection straight into such a buffer (``fresh_prefill_rows`` says how many rows; the
backend's ``fresh_qkv_rows``) and RoPE and the KV store work on its views; other callers' q, k, v are
copied into one.

Determinism: cuDNN's forward pass has no atomics, so a given shape gives the same bits run after run (a
test checks it on the GPU); the bits differ from the paged kernel's, which is why the choice depends only on
the step's shape: a prefill grid (``SchedulerConfig.prefill_grid``) computes chunk 0 of a prompt the same
way whether or not the prompt's prefix was cached.
"""

from __future__ import annotations

import functools

import torch

# fresh prompts of CUDNN_MIN_TOKENS to CUDNN_MAX_TOKENS tokens go through cuDNN, padded to a multiple of
# CUDNN_BUCKET: cuDNN builds an execution plan per sequence length at its first use (65-106 ms on an H200,
# 2026-12-04), so lengths are bucketed and ``warm_cudnn_plans`` builds every bucket's plan before a worker
# reports ready (at most 61 plans, ~4 s; 5 for the default 2048-token budget)
CUDNN_MIN_TOKENS = 1024
CUDNN_MAX_TOKENS = 16384
CUDNN_BUCKET = 256


def fresh_prefill_shape(num_seqs: int, num_decodes: int, max_query_len: int, max_seq_len: int) -> bool:
    """The step's shape fits ``cudnn_causal_attention``: one sequence, no decode rows, no cached context
    (its query is its whole length) and ``CUDNN_MIN_TOKENS`` to ``CUDNN_MAX_TOKENS`` tokens."""
    return (num_seqs == 1 and num_decodes == 0 and max_query_len == max_seq_len
            and CUDNN_MIN_TOKENS <= max_seq_len <= CUDNN_MAX_TOKENS)


def fresh_prefill_usable(q: torch.Tensor, kv_heads: int, k_cache_dtype: torch.dtype, num_seqs: int,
                         num_decodes: int, max_query_len: int, max_seq_len: int) -> bool:
    """Whether a step goes through ``cudnn_causal_attention``: ``fresh_prefill_shape``, a float16/bfloat16
    ``q [T, H, D]`` on a CUDA device of compute capability >= 9.0, a cache of ``q``'s dtype (not FP8), and
    cuDNN able to run ``H`` query heads over ``kv_heads`` (grouped or expanded) at head size ``D``
    (torch's ``can_use_cudnn_attention``, asked once per shape). Python ints only: no device read."""
    return fresh_prefill_rows(q.device, q.dtype, q.shape[1], kv_heads, q.shape[2], k_cache_dtype, num_seqs,
                              num_decodes, max_query_len, max_seq_len) is not None


def fresh_prefill_rows(device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int,
                       k_cache_dtype: torch.dtype, num_seqs: int, num_decodes: int, max_query_len: int,
                       max_seq_len: int) -> int | None:
    """``fresh_prefill_usable`` for a step's shape before its ``q`` exists: the rows of the packed
    ``[rows, H + 2 Hkv, D]`` buffer ``cudnn_causal_attention`` attends over (the step's tokens rounded up
    to ``CUDNN_BUCKET``), or None where the step stays on the paged kernel."""
    if not (device.type == "cuda" and dtype in (torch.float16, torch.bfloat16) and k_cache_dtype == dtype
            and fresh_prefill_shape(num_seqs, num_decodes, max_query_len, max_seq_len)):
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    if not _cudnn_runs(index, heads, kv_heads, head_dim, dtype):
        return None
    return -(-max_seq_len // CUDNN_BUCKET) * CUDNN_BUCKET


@functools.cache
def _cudnn_runs(device_index: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> bool:
    """cuDNN's fused attention is built in, the GPU is Hopper or newer, and torch says cuDNN can run causal
    attention of ``heads`` query heads over ``kv_heads`` (grouped, or expanded to ``heads``)."""
    if not torch.backends.cudnn.is_available() or torch.cuda.get_device_capability(device_index) < (9, 0):
        return False
    dev = torch.device("cuda", device_index)

    def runs(kv: int) -> bool:  # views of a packed buffer, the layout cudnn_causal_attention passes
        buf = torch.empty((CUDNN_BUCKET, heads + 2 * kv, head_dim), dtype=dtype, device=dev)
        views = buf.transpose(0, 1).unsqueeze(0)
        q, k, v = views[:, :heads], views[:, heads:heads + kv], views[:, heads + kv:]
        params = torch.backends.cuda.SDPAParams(q, k, v, None, 0.0, True, kv != heads)
        return bool(torch.backends.cuda.can_use_cudnn_attention(params, debug=False))
    return runs(kv_heads) or runs(heads)


def cudnn_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                           packed: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of one sequence over its own K/V through cuDNN (GQA: query head ``h`` uses KV head
    ``h // (H // Hkv)``; K/V expanded to ``H`` heads where cuDNN does not take them grouped). ``T`` is
    padded with zero rows to a multiple of ``CUDNN_BUCKET`` (the causal mask keeps the padding out of the
    real rows, whose outputs are returned).

    Args:
        q: ``[T, H, D]``; k, v: ``[T, Hkv, D]``; float16 or bfloat16 on a CUDA device, last dims contiguous.
        scale: softmax scale.
        packed: None, or the contiguous ``[T_padded, H + 2 Hkv, D]`` buffer (``T_padded`` = ``T`` rounded up
            to ``CUDNN_BUCKET``, rows from ``T`` on zero) whose first ``T`` rows ``q``, ``k`` and ``v`` are
            the head slices of, in that order (a QKV projection written into it: ``fresh_prefill_rows``):
            attended in place. Without it the three are copied into such a buffer first.

    Returns:
        ``[T, H, D]`` contiguous, ``q``'s dtype.

    Raises:
        ValueError: ``packed`` is not laid out as above, or ``q``/``k``/``v`` are not its views.
        RuntimeError: cuDNN cannot run these inputs (torch's SDPA names why).
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel

    heads, kv_heads = q.shape[1], k.shape[1]
    t = q.shape[0]
    rows = -(-t // CUDNN_BUCKET) * CUDNN_BUCKET
    if packed is None:
        packed = _packed(q, k, v, rows)
    else:
        _check_packed(packed, q, k, v, rows)
    views = packed.transpose(0, 1).unsqueeze(0)  # [1, H + 2 Hkv, rows, D]
    qt, kt, vt = views[:, :heads], views[:, heads:heads + kv_heads], views[:, heads + kv_heads:]
    params = torch.backends.cuda.SDPAParams(qt, kt, vt, None, 0.0, True, heads != kv_heads)
    if heads != kv_heads and not torch.backends.cuda.can_use_cudnn_attention(params, debug=False):
        group = heads // kv_heads
        kt, vt = kt.repeat_interleave(group, dim=1), vt.repeat_interleave(group, dim=1)
        gqa = False
    else:
        gqa = heads != kv_heads
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        out = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale,
                                                               enable_gqa=gqa)
    return out[0, :, :t].transpose(0, 1).contiguous()


def _packed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: int) -> torch.Tensor:
    """``q``, ``k``, ``v`` (``[T, heads, D]``) copied row by row into one ``[rows, H + 2 Hkv, D]`` buffer,
    rows from ``T`` on zero: cuDNN's sequence-major layout, in which its output comes back
    ``[T, H, D]``-contiguous, and the same strides on every call of a bucket, which cuDNN's plan cache
    keys on (views of differently strided inputs would miss the plans ``warm_cudnn_plans`` built: 50 ms
    on a first prompt on an H200)."""
    t, heads, dim = q.shape
    kv_heads = k.shape[1]
    buf = q.new_empty((rows, heads + 2 * kv_heads, dim))
    buf[:t, :heads] = q
    buf[:t, heads:heads + kv_heads] = k
    buf[:t, heads + kv_heads:] = v
    buf[t:].zero_()
    return buf


def _check_packed(packed: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: int) -> None:
    """Shape, contiguity and that ``q``/``k``/``v`` are ``packed``'s head slices (pointers and strides).
    That rows from ``T`` on are zero is the caller's contract, not checked (it would read the device):
    a real row near ``T`` weighs a padded V row by 0, and 0 x NaN would be NaN."""
    heads, kv_heads, dim = q.shape[1], k.shape[1], q.shape[2]
    if packed.shape != (rows, heads + 2 * kv_heads, dim) or not packed.is_contiguous():
        raise ValueError(f"packed must be a contiguous [{rows}, {heads + 2 * kv_heads}, {dim}] buffer for "
                         f"{q.shape[0]} tokens, got {tuple(packed.shape)}")
    for name, x, head in (("q", q, 0), ("k", k, heads), ("v", v, heads + kv_heads)):
        if x.data_ptr() != packed[0, head].data_ptr() or x.stride() != packed.stride():
            raise ValueError(f"{name} is not the view of packed's heads from {head} on")


def warm_cudnn_plans(heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                     max_tokens: int) -> int:
    """Build cuDNN's plan for every bucket a fresh prompt of up to ``max_tokens`` tokens can take (zeros
    through ``cudnn_causal_attention``), so no request pays the 65-106 ms of a first use. Returns the
    number of buckets warmed (0 where ``fresh_prefill_usable`` would never take the path)."""
    probe = torch.empty((1, heads, head_dim), dtype=dtype, device=device)
    if not fresh_prefill_usable(probe, kv_heads, dtype, 1, 0, CUDNN_MIN_TOKENS, CUDNN_MIN_TOKENS):
        return 0
    top = min(max_tokens, CUDNN_MAX_TOKENS)
    if top < CUDNN_MIN_TOKENS:
        return 0
    count = 0
    for t in range(CUDNN_MIN_TOKENS, -(-top // CUDNN_BUCKET) * CUDNN_BUCKET + 1, CUDNN_BUCKET):
        q = torch.zeros((t, heads, head_dim), dtype=dtype, device=device)
        kv = torch.zeros((t, kv_heads, head_dim), dtype=dtype, device=device)
        cudnn_causal_attention(q, kv, kv, head_dim ** -0.5)
        count += 1
    return count


def causal_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               scale: float) -> torch.Tensor:
    """Plain-torch ``cudnn_causal_attention`` (float32 softmax): same arguments, ``[T, H, D]`` in ``q``'s
    dtype; any device."""
    group = q.shape[1] // k.shape[1]
    qf = q.float().transpose(0, 1)  # [H, T, D]
    kf = k.float().repeat_interleave(group, dim=1).transpose(0, 1)
    vf = v.float().repeat_interleave(group, dim=1).transpose(0, 1)
    s = (qf @ kf.transpose(1, 2)) * scale
    t = q.shape[0]
    mask = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    p = torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1)
    return (p @ vf).transpose(0, 1).to(q.dtype).contiguous()
