"""Row-wise argmax of logits, the greedy token of each row (Triton kernels + plain-torch reference).

``torch.argmax(logits, dim=-1)`` reduces a one-row batch on one thread block: for Llama 3's 128k-token
vocabulary that took 26 µs on an H100 (9 µs for Qwen's 152k, where torch splits the row), in every greedy
decode step (bench/kernels/argmax.py). Here each row is cut into chunks of ``CHUNK`` entries: the first
kernel runs one program per (chunk, row) and writes the chunk's largest value and its index, the second
one program per row picks among its chunks (the standard two-pass split reduction).

Same answer as ``torch.argmax``: values compared in float32 (exact for the bf16, fp16 and fp32 inputs it
takes), the lowest index among equal maxima, and a NaN larger than any number (a row holding NaN gives its
first NaN's index, as torch's argmax does). ``argmax_rows`` takes the kernels where ``takes_kernel`` says
so (a CUDA tensor it can run) and ``torch.argmax`` (``argmax_rows_reference``) elsewhere; the CPU suite
checks the kernels through the Triton interpreter.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from engine.ops.pdl import gdc_enter, pdl_kwargs

CHUNK = 2048  # entries per program of the first kernel: a 128k vocabulary is 63 programs per row
_NO_INDEX = 2 ** 31 - 1  # larger than any vocabulary index (int32)
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # compared exactly in float32
_MAX_ROWS = 65535  # rows are the launch grid's second axis (CUDA's limit there)


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
    chunk = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
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
    if logits.shape[0] > _MAX_ROWS:
        raise ValueError(f"logits need at most {_MAX_ROWS} rows, got {logits.shape[0]}")
    if logits.dtype not in _DTYPES:
        raise ValueError(f"logits must be float32, bfloat16 or float16, got {logits.dtype}")


def argmax_rows_kernel(logits: torch.Tensor) -> torch.Tensor:
    """The index of each row's largest entry, by the two Triton kernels (module docstring).

    Args:
        logits: ``[B, V]`` float32, bfloat16 or float16, last dim contiguous, ``B <= 65535``, any device
            Triton runs on.

    Returns:
        int64 ``[B]`` on ``logits``' device, equal to ``torch.argmax(logits, dim=-1)``.

    Raises:
        ValueError: not ``[B, V]`` with a contiguous last dim, ``V`` < 1 or >= 2**31, more than 65535
            rows, or another dtype.
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
    _argmax_chunks_kernel[(chunks, b)](logits, values, index, v, logits.stride(0), chunks, BLOCK=CHUNK,
                                       NO_INDEX=_NO_INDEX, num_warps=4, **pdl)
    _argmax_rows_kernel[(b,)](values, index, out, chunks, BLOCK_C=triton.next_power_of_2(chunks),
                              NO_INDEX=_NO_INDEX, num_warps=1, **pdl)
    return out


def argmax_rows_reference(logits: torch.Tensor) -> torch.Tensor:
    """``torch.argmax(logits, dim=-1)``: int64 ``[B]``. Same errors as ``argmax_rows_kernel``."""
    _check(logits)
    return logits.argmax(dim=-1)


def takes_kernel(logits: torch.Tensor) -> bool:
    """Whether ``argmax_rows`` runs the kernels on ``logits``: a CUDA tensor ``[B, V]`` with a contiguous
    last dim, ``1 <= V < 2**31``, ``B <= 65535``, float32 / bfloat16 / float16, outside the Triton
    interpreter (whose CPU tensors take torch)."""
    return (logits.is_cuda and logits.dim() == 2 and logits.stride(1) == 1 and logits.dtype in _DTYPES
            and 1 <= logits.shape[1] < _NO_INDEX and logits.shape[0] <= _MAX_ROWS
            and os.environ.get("TRITON_INTERPRET") != "1")


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """The greedy token of each row of ``logits [B, V]``: ``argmax_rows_kernel`` where ``takes_kernel``,
    else ``torch.argmax``; int64 ``[B]``, the same values either way."""
    if takes_kernel(logits):
        return argmax_rows_kernel(logits)
    return logits.argmax(dim=-1)
