"""Rotary position embedding applied in place to a step's queries and keys (Triton kernel + reference).

RoPE (Su et al., "RoFormer", 2021) in the "rotate half" layout of transformers' Llama:
``x' = x * cos + rotate_half(x) * sin`` with ``rotate_half([x1, x2]) = [-x2, x1]``; ``cos``/``sin`` come
from the model's own ``rotary_emb`` module (so every RoPE scaling type transformers implements is kept).
``interleaved=True``: the layout of transformers' GLM-4 (and GPT-J), which rotates the adjacent pairs
``(x[2i], x[2i+1])`` by angle ``i``: the same products, with ``x1 = x[0::2]``, ``x2 = x[1::2]`` and the
first half of ``cos``/``sin`` for both.
Each product is rounded to the tensor's dtype before the sum, as torch's elementwise ops do, so bf16
results match transformers' ``apply_rotary_pos_emb``. One Triton program rotates every head of one token.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.ops.pdl import gdc_enter, pdl_kwargs


@triton.jit
def _cos_sin(cos_ptr, sin_ptr, t, stride_ct, stride_st, d, dmask,  # type: ignore[no-untyped-def]
             HALF: tl.constexpr):
    """Token ``t``'s cos and sin halves (float32 ``[BLOCK_HALF]`` each): c1, c2, s1, s2."""
    c1 = tl.load(cos_ptr + t * stride_ct + d, mask=dmask, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + t * stride_ct + HALF + d, mask=dmask, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + t * stride_st + d, mask=dmask, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + t * stride_st + HALF + d, mask=dmask, other=0.0).to(tl.float32)
    return c1, c2, s1, s2


@triton.jit
def _rotated(x1, x2, c1, c2, s1, s2):  # type: ignore[no-untyped-def]
    """The two rotated halves of ``[x1 | x2]`` in ``x1``'s dtype, each product rounded to it first."""
    dt = x1.dtype
    a1 = (x1.to(tl.float32) * c1[None, :]).to(dt).to(tl.float32)
    b1 = (-x2.to(tl.float32) * s1[None, :]).to(dt).to(tl.float32)
    a2 = (x2.to(tl.float32) * c2[None, :]).to(dt).to(tl.float32)
    b2 = (x1.to(tl.float32) * s2[None, :]).to(dt).to(tl.float32)
    return (a1 + b1).to(dt), (a2 + b2).to(dt)


@triton.jit
def _rotate_heads(ptr, stride_h, c1, c2, s1, s2, d, dmask,  # type: ignore[no-untyped-def]
                  NUM_HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
                  INTERLEAVED: tl.constexpr = False):
    """Rotate every head's ``[x1 | x2]`` halves in place; ``INTERLEAVED``: the pairs ``x[2d], x[2d + 1]``
    (then ``c2``/``s2`` must be ``c1``/``s1``)."""
    heads = tl.arange(0, BLOCK_H)
    mask = (heads[:, None] < NUM_HEADS) & dmask[None, :]
    if INTERLEAVED:
        p1 = ptr + heads[:, None] * stride_h + 2 * d[None, :]
        p2 = p1 + 1
    else:
        p1 = ptr + heads[:, None] * stride_h + d[None, :]
        p2 = p1 + HALF
    r1, r2 = _rotated(tl.load(p1, mask=mask, other=0.0), tl.load(p2, mask=mask, other=0.0),
                      c1, c2, s1, s2)
    tl.store(p1, r1, mask=mask)
    tl.store(p2, r2, mask=mask)


@triton.jit
def _rotary_kernel(  # type: ignore[no-untyped-def]  # Triton kernel: arguments are typed by @triton.jit
    q_ptr, k_ptr, cos_ptr, sin_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_ct, stride_st,
    NUM_Q_HEADS: tl.constexpr, NUM_K_HEADS: tl.constexpr, HALF: tl.constexpr,
    BLOCK_QH: tl.constexpr, BLOCK_KH: tl.constexpr, BLOCK_HALF: tl.constexpr,
    INTERLEAVED: tl.constexpr, USE_GDC: tl.constexpr,
):
    gdc_enter(USE_GDC)
    t = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK_HALF)
    dmask = d < HALF
    c1, c2, s1, s2 = _cos_sin(cos_ptr, sin_ptr, t, stride_ct, stride_st, d, dmask, HALF)
    if INTERLEAVED:  # pair i turns by angle i: the first half of cos and sin for both of its elements
        c2, s2 = c1, s1
    _rotate_heads(q_ptr + t * stride_qt, stride_qh, c1, c2, s1, s2, d, dmask, NUM_Q_HEADS, HALF, BLOCK_QH,
                  INTERLEAVED)
    _rotate_heads(k_ptr + t * stride_kt, stride_kh, c1, c2, s1, s2, d, dmask, NUM_K_HEADS, HALF, BLOCK_KH,
                  INTERLEAVED)


def _check(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(f"q must be [T, H, D] and k [T, Hkv, D]; got {tuple(q.shape)} and {tuple(k.shape)}")
    t, _, d = q.shape
    if d % 2 or cos.shape != (t, d) or sin.shape != (t, d):
        raise ValueError(f"cos and sin must be [{t}, {d}] with D even; "
                         f"got {tuple(cos.shape)}, {tuple(sin.shape)}")
    if q.stride(2) != 1 or k.stride(2) != 1 or cos.stride(1) != 1 or sin.stride(1) != 1:
        raise ValueError("q, k, cos and sin need a contiguous last dim")


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 interleaved: bool = False) -> None:
    """Rotate ``q`` and ``k`` in place (Triton).

    Args:
        q: ``[T, H, D]`` queries (any float dtype), last dim contiguous; other strides free (a view of
            the fused QKV projection's output works).
        k: ``[T, Hkv, D]`` keys, same dtype and rules.
        cos, sin: ``[T, D]`` from the model's ``rotary_emb`` (attention scaling already applied).
        interleaved: rotate adjacent pairs (GLM-4's layout) instead of halves.

    Raises:
        ValueError: shapes or strides that do not fit.
    """
    _check(q, k, cos, sin)
    t, num_heads, d = q.shape
    if t == 0:
        return
    _rotary_kernel[(t,)](
        q, k, cos, sin, q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0), sin.stride(0),
        NUM_Q_HEADS=num_heads, NUM_K_HEADS=k.shape[1], HALF=d // 2,
        BLOCK_QH=triton.next_power_of_2(num_heads), BLOCK_KH=triton.next_power_of_2(k.shape[1]),
        BLOCK_HALF=triton.next_power_of_2(d // 2), INTERLEAVED=interleaved,
        **pdl_kwargs(q),
    )


def apply_rotary_reference(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                           interleaved: bool = False) -> None:
    """Plain-torch ``apply_rotary`` (transformers' ``apply_rotary_pos_emb`` arithmetic, Llama's or, with
    ``interleaved``, GLM-4's), in place.

    Raises:
        ValueError: shapes or strides that do not fit.
    """
    _check(q, k, cos, sin)
    c, s = cos[:, None, :], sin[:, None, :]
    if interleaved:
        half = c.shape[-1] // 2
        c, s = c[..., :half].repeat_interleave(2, dim=-1), s[..., :half].repeat_interleave(2, dim=-1)
    for x in (q, k):
        if interleaved:
            rotated = torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)
        else:
            x1, x2 = x.chunk(2, dim=-1)
            rotated = torch.cat((-x2, x1), dim=-1)
        x.copy_(x * c + rotated * s)
