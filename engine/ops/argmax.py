"""Row-wise argmax of logits, the greedy token of each row (Triton kernels + plain-torch reference).

``torch.argmax(logits, dim=-1)`` reduces a row on one thread block: for one row of a 128k-token vocabulary
(Llama 3; 152k for Qwen) that is ~38 µs on an H100, about the time of a Llama-3-8B layer's FP8 gate/up
projection at batch 1, in every greedy decode step. Here each row is cut into chunks of ``BLOCK``
entries: the first kernel runs one program per (row, chunk) and writes the chunk's largest value and its
index, the second one program per row picks among its chunks (the standard two-pass split reduction).

Same answer as ``torch.argmax`` bit for bit: values compared in float32 (exact for bf16 and fp16 inputs),
the lowest index among equal maxima, and a NaN larger than any number (a row holding NaN gives its first
NaN's index, as torch's argmax does). ``argmax_rows`` takes the kernels for CUDA tensors and
``torch.argmax`` (``argmax_rows_reference``) elsewhere; the CPU suite checks the kernels through the
Triton interpreter.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from engine.ops.pdl import gdc_enter, pdl_kwargs

CHUNK = 2048  # entries per program of the first kernel: a 128k vocabulary is 63 programs per row
_NO_INDEX = 2 ** 31 - 1  # larger than any vocabulary index (int32)


@triton.jit
def _pick(values, index, valid, NO_INDEX: tl.constexpr):  # type: ignore[no-untyped-def]  # Triton function
    """``(value, index)`` of the entry torch.argmax would pick among ``values`` (float32) at ``index``
    (int32) where ``valid``: the first NaN if any (value NaN), else the largest value's lowest index."""
    nan = (values != values) & valid
    nan_index = tl.min(tl.where(nan, index, NO_INDEX), axis=0)
    numbers = tl.where(valid & (values == values), values, -float("inf"))
    best = tl.max(numbers, axis=0)
    best_index = tl.min(tl.where(valid & (numbers == best), index, NO_INDEX), axis=0)
    has_nan = nan_index < NO_INDEX
    return tl.where(has_nan, float("nan"), best), tl.where(has_nan, nan_index, best_index)


@triton.jit
def _argmax_chunks_kernel(  # type: ignore[no-untyped-def]  # Triton kernel: arguments are typed by @triton.jit
    x_ptr, value_ptr, index_ptr, vocab, stride_x, num_chunks,
    BLOCK: tl.constexpr, NO_INDEX: tl.constexpr, USE_GDC: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    valid = cols < vocab
    gdc_enter(USE_GDC)  # the logits come from the kernel just before
    x = tl.load(x_ptr + row * stride_x + cols, mask=valid, other=-float("inf")).to(tl.float32)
    value, index = _pick(x, cols, valid, NO_INDEX)
    tl.store(value_ptr + row * num_chunks + chunk, value)
    tl.store(index_ptr + row * num_chunks + chunk, index)


@triton.jit
def _argmax_rows_kernel(  # type: ignore[no-untyped-def]  # Triton kernel: arguments are typed by @triton.jit
    value_ptr, index_ptr, out_ptr, num_chunks,
    BLOCK_C: tl.constexpr, NO_INDEX: tl.constexpr, USE_GDC: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    chunks = tl.arange(0, BLOCK_C)
    valid = chunks < num_chunks
    gdc_enter(USE_GDC)
    values = tl.load(value_ptr + row * num_chunks + chunks, mask=valid, other=-float("inf"))
    index = tl.load(index_ptr + row * num_chunks + chunks, mask=valid, other=NO_INDEX)
    _, best = _pick(values, index, valid, NO_INDEX)  # chunks in index order: the lowest index wins ties
    tl.store(out_ptr + row, best.to(tl.int64))


def _check(logits: torch.Tensor) -> None:
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"logits must be [B, V] with a contiguous last dim, got {tuple(logits.shape)} "
                         f"strides {tuple(logits.stride())}")
    if logits.shape[1] < 1 or logits.shape[1] >= _NO_INDEX:
        raise ValueError(f"logits need 1 <= V < 2**31 entries per row, got V={logits.shape[1]}")
    if not logits.is_floating_point():
        raise ValueError(f"logits must be a float tensor, got {logits.dtype}")


def argmax_rows_kernel(logits: torch.Tensor) -> torch.Tensor:
    """The index of each row's largest entry, by the two Triton kernels (module docstring).

    Args:
        logits: ``[B, V]`` float (bf16, fp16 or fp32), last dim contiguous, any device Triton runs on.

    Returns:
        int64 ``[B]`` on ``logits``' device, equal to ``torch.argmax(logits, dim=-1)``.

    Raises:
        ValueError: not ``[B, V]`` with a contiguous last dim, ``V`` < 1 or >= 2**31, or not float.
    """
    _check(logits)
    b, v = logits.shape
    out = torch.empty(b, dtype=torch.int64, device=logits.device)
    if b == 0:
        return out
    chunks = triton.cdiv(v, CHUNK)
    values = torch.empty((b, chunks), dtype=torch.float32, device=logits.device)
    index = torch.empty((b, chunks), dtype=torch.int32, device=logits.device)
    pdl = pdl_kwargs(logits)
    _argmax_chunks_kernel[(b, chunks)](logits, values, index, v, logits.stride(0), chunks, BLOCK=CHUNK,
                                       NO_INDEX=_NO_INDEX, num_warps=4, **pdl)
    _argmax_rows_kernel[(b,)](values, index, out, chunks, BLOCK_C=triton.next_power_of_2(chunks),
                              NO_INDEX=_NO_INDEX, num_warps=1, **pdl)
    return out


def argmax_rows_reference(logits: torch.Tensor) -> torch.Tensor:
    """``torch.argmax(logits, dim=-1)``: int64 ``[B]``. Same errors as ``argmax_rows_kernel``."""
    _check(logits)
    return logits.argmax(dim=-1)


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """The greedy token of each row of ``logits [B, V]``: ``argmax_rows_kernel`` for a CUDA tensor whose
    last dim is contiguous (outside the Triton interpreter), else ``torch.argmax``; int64 ``[B]``, the
    same values either way."""
    if (logits.is_cuda and logits.dim() == 2 and logits.stride(1) == 1 and logits.is_floating_point()
            and os.environ.get("TRITON_INTERPRET") != "1"):
        return argmax_rows_kernel(logits)
    return logits.argmax(dim=-1)
