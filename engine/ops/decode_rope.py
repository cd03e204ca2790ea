"""The step's RoPE and K/V store inside the paged decode kernel (engine/ops/paged_decode.py, ``rope=``).

A decode step launched ``rotary_store_kv`` (engine/ops/rotary_store.py) and then the split kernel of
decode attention for every layer. With ``RopeStore`` the split kernel does both: each program rotates its
query heads' q as it loads it (RoPE "rotate half" of transformers' Llama, Su et al. 2021, rounded as
engine/ops/rotary.py rounds it), and the program whose split holds the new position rotates its KV head's
new key and stores it and the value into the cache slot (slot ``s`` = block ``s // block_size``, offset
``s % block_size``, as vLLM's ``reshape_and_cache``), then passes a CTA barrier (``__syncthreads``: its
global stores are visible to its own threads) before its tile loop reads that position; no other
program of that sequence reads it. (A padding row of a decode graph, slot -1 and length 1, reads
position 0 of a stale block-table row, which a real row may be writing in the same launch; its output is
discarded, as before.) One launch per layer fewer. The cache is bit-identical to the two kernels'; so
is the output in fp32 (compiled and interpreted, "ieee" dots), while compiled bf16/fp16 outputs of
sequences longer than one tile may differ by one ulp, deterministically (docs/benchmarks/engine.md;
the tensor-core dots of the two compiled variants likely differ).

Evidence for the store → barrier → load order: the GPU tests (tests/engine/test_decode_rope.py, compiled,
bf16) and, on CPU, the same check with the interpreter's programs run backwards (a wrong owner then
fails). compute-sanitizer's racecheck only sees shared-memory hazards, not this global-memory one.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from engine.ops.rotary import _check as _check_rotary
from engine.ops.rotary import _cos_sin, _rotated
from engine.ops.store_kv import quantize_kv


class RopeStore(NamedTuple):
    """The step's RoPE and K/V store, done inside the decode kernel (``paged_decode_attention(rope=...)``):
    ``k``, ``v`` ``[N, Hkv, D]`` the new keys (before RoPE) and values, ``cos``, ``sin`` ``[N, D]``,
    ``slot_mapping`` int64 ``[N]`` (negative: store nothing). ``q`` is then before RoPE too."""

    k: torch.Tensor
    v: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    slot_mapping: torch.Tensor


@triton.jit
def _rope_q_store_kv(  # type: ignore[no-untyped-def]  # Triton helper
    q_row, k_row, v_row, cos_ptr, sin_ptr, slot_ptr, k_cache_ptr, v_cache_ptr, seq, kv_head, rows, row_mask,
    stride_qh, stride_ct, stride_st, stride_cb, stride_cs, stride_ch, owner, inv_k_scale, inv_v_scale,
    HALF: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
    QUERIES_PER_KV: tl.constexpr, KV_FP8: tl.constexpr,
):
    """Rotated ``q`` ``[BLOCK_G, BLOCK_D]`` of this program's query heads (RoPE "rotate half", rounded as
    engine/ops/rotary.py; BLOCK_D == 2 * HALF); the program that ``owner``s the new position also rotates
    its KV head's new key and stores it and the value in the cache slot, then a CTA barrier makes the
    stores visible to its own tile loop (the only one of the sequence that reads that position). An FP8
    cache gets the rotated key and the value quantised as ``store_kv`` does (``KV_FP8``)."""
    half = tl.arange(0, HALF)
    c1, c2, s1, s2 = _cos_sin(cos_ptr, sin_ptr, seq, stride_ct, stride_st, half, half < HALF, HALF)
    qp = q_row + (kv_head * QUERIES_PER_KV + rows)[:, None] * stride_qh + half[None, :]
    m = row_mask[:, None] & (half < HALF)[None, :]
    r1, r2 = _rotated(tl.load(qp, mask=m, other=0.0), tl.load(qp + HALF, mask=m, other=0.0), c1, c2, s1, s2)
    q = tl.reshape(tl.permute(tl.join(r1, r2), (0, 2, 1)), (BLOCK_G, BLOCK_D))
    slot = tl.load(slot_ptr + seq).to(tl.int64)
    if owner and slot >= 0:
        kp = k_row + half[None, :]
        k1, k2 = _rotated(tl.load(kp), tl.load(kp + HALF), c1, c2, s1, s2)
        dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs + kv_head * stride_ch \
            + half[None, :]
        tl.store(k_cache_ptr + dst, quantize_kv(k1, inv_k_scale, k_cache_ptr, KV_FP8))
        tl.store(k_cache_ptr + dst + HALF, quantize_kv(k2, inv_k_scale, k_cache_ptr, KV_FP8))
        tl.store(v_cache_ptr + dst,
                 quantize_kv(tl.load(v_row + half[None, :]), inv_v_scale, v_cache_ptr, KV_FP8))
        tl.store(v_cache_ptr + dst + HALF,
                 quantize_kv(tl.load(v_row + HALF + half[None, :]), inv_v_scale, v_cache_ptr, KV_FP8))
    tl.debug_barrier()
    return q


def rope_fusable(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, rope: RopeStore) -> bool:
    """Whether ``paged_decode_attention`` can take ``rope`` (see there): shapes, contiguous last dims,
    a power-of-two head dim >= 16, one stride for both caches."""
    n, _, d = q.shape
    try:
        _check_rotary(q, rope.k, rope.cos, rope.sin)
    except ValueError:
        return False
    return (d >= 16 and d == triton.next_power_of_2(d) and rope.v.shape == rope.k.shape
            and rope.k.shape[1] == k_cache.shape[2] and rope.v.stride(2) == 1
            and rope.slot_mapping.shape[0] >= n and k_cache.stride() == v_cache.stride()
            and k_cache.stride(3) == 1)


def _rope_args(rope: RopeStore) -> tuple[object, ...]:
    """The split kernel's RoPE/store arguments: new K, V, cos, sin, slots, then their strides."""
    k, v, cos, sin, slots = rope
    return (k, v, cos, sin, slots, k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0),
            sin.stride(0))
