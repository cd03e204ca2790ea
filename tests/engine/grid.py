"""Shape grids of the kernel tests: the full grid with compiled kernels on a GPU, a representative subset
through Triton's interpreter on the CPU.

Under the interpreter every program of a kernel runs as Python, one after the other, so a grid's cost
grows with its product of shapes, dtypes and split counts. The CPU subset keeps what can catch a wrong
kernel: every kernel, block-boundary lengths (the lengths are in each case, not on an axis), a GQA
ratio > 1 and an MHA case, head_dim 64 and 128, fp32 and fp16, every split count where there is a split
axis. ``FULL_GRID`` is true on a CUDA machine, and wherever ``PDSERVE_FULL_GRID=1`` is set
(``scripts/gpu_tests.sh`` sets it; on a CPU it runs the whole grid through the interpreter).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TypeVar

import torch

FULL_GRID = torch.cuda.is_available() or os.environ.get("PDSERVE_FULL_GRID") == "1"
T = TypeVar("T")


def grid(full: Sequence[T], cpu: Sequence[T]) -> list[T]:
    """``full`` when ``FULL_GRID``, else ``cpu`` (a subset of ``full``, in its order). Raises ValueError
    when ``cpu`` names a case that ``full`` lacks (the subset must not test what the GPU run does not)."""
    missing = [c for c in cpu if c not in full]
    if missing:
        raise ValueError(f"CPU cases not in the full grid: {missing}")
    return list(full) if FULL_GRID else [c for c in full if c in cpu]
