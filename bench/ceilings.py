"""Hardware ceilings the benchmarks divide by, measured in the benchmark's own process.

- ``copy_bandwidth``: a device-to-device copy of ``nbytes``, read + write bytes counted (the HBM
  roofline of a decode step: it reads every weight once);
- ``gemm_tflops``: a square bf16 (or the model's dtype) ``n x n @ n x n`` product, ``2 n^3`` FLOPs (the
  compute ceiling of a prefill).

Each is the best of at least ``bench.timing.MIN_CEILING_REPEATS`` event-timed calls after warm-up
(``bench.timing.ceiling_seconds``), returned as a ``Spread`` of the rate so the report can show how far
one call may fall below the best. A GPU's clock moves under these calls: an H200 that has idled runs
its first few dozen 8192^3 GEMMs at its boost clock (~790–810 TFLOP/s), then at ~680–725 once its
power limit holds it down (docs/benchmarks/engine.md), so a benchmark whose own work heats the GPU takes
the ceiling before that work as well as after it.
"""

from __future__ import annotations

import torch

from bench.timing import MIN_CEILING_REPEATS, Spread, ceiling_seconds


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30, repeats: int = MIN_CEILING_REPEATS
                   ) -> Spread:
    """Bytes/s of copying ``nbytes`` between two uint8 buffers on ``device``, read + write counted,
    over ``repeats`` (>= 20) timed copies; the ceiling is ``.max``. Raises ValueError for fewer repeats."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return ceiling_seconds(lambda: dst.copy_(src), device, repeats).per(2.0 * nbytes)


def gemm_tflops(n: int, dtype: torch.dtype, device: torch.device, repeats: int = MIN_CEILING_REPEATS
                ) -> Spread:
    """TFLOP/s of an ``n x n @ n x n`` matmul in ``dtype`` (``2 n^3`` FLOPs) over ``repeats`` (>= 20)
    timed products; the ceiling is ``.max``. Raises ValueError for fewer repeats."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    return ceiling_seconds(lambda: a @ b, device, repeats).per(2.0 * n**3 / 1e12)
