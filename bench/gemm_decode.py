"""Decode-shaped GEMMs (few rows × a weight matrix) against the copy ceiling, on one GPU (not a test).

A decode step of batch ``M`` reads each weight matrix once; at small ``M`` a GEMM is bound by that read,
so its ceiling is ``weight bytes / device copy bandwidth`` (read + write bytes of a 1 GiB copy measured in
the same run, as in ``bench.engine``). For each Llama-3-8B projection (merged QKV, O, merged gate/up,
down, LM head) and each ``M`` this prints the achieved weight-read bandwidth as a fraction of that
ceiling (the GEMMs of one shape replayed from a CUDA graph, as in a decode step), for torch's
default BLAS and for cuBLASLt (``torch.backends.cuda.preferred_blas_library``).
Eight copies of each weight are cycled so the 50 MB L2 cache never holds the matrix being read.

    python3 -m bench.gemm_decode --rows 1 8 32
"""

from __future__ import annotations

import argparse

import torch

from bench.engine import copy_bandwidth

# (name, out_features N, in_features K) of Llama-3-8B with merged projections
SHAPES = (("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336),
          ("lm_head", 128256, 4096))


def gemm_seconds(rows: int, n: int, k: int, copies: int = 8, iters: int = 64) -> float:
    """Mean seconds of ``F.linear(x [rows, k], w [n, k])`` in bf16, cycling ``copies`` weights. The
    ``iters`` GEMMs are captured in one CUDA graph and replayed, as in a decode step, so Python launch
    cost is not counted."""
    dev = torch.device("cuda")
    weights = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    x = torch.randn(rows, k, device=dev, dtype=torch.bfloat16)
    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):  # warm-up (cuBLAS picks and loads its kernels) off the capture
        for w in weights:
            torch.nn.functional.linear(x, w)
    torch.cuda.current_stream(dev).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(iters):
            torch.nn.functional.linear(x, weights[i % copies])
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(4):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / (4 * iters)


def main(argv: list[str] | None = None) -> None:
    """Print one markdown row per (shape, rows, BLAS library)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    args = p.parse_args(argv)
    bandwidth = copy_bandwidth(torch.device("cuda"))
    print(f"# {torch.cuda.get_device_name()}, copy bandwidth {bandwidth / 1e12:.2f} TB/s (read + write)")
    print("| shape | N | K | rows | BLAS | µs | weight GB/s | of copy bandwidth |")
    print("|---|---|---|---|---|---|---|---|")
    for lib in ("cublas", "cublaslt"):
        torch.backends.cuda.preferred_blas_library(lib)
        for name, n, k in SHAPES:
            for rows in args.rows:
                sec = gemm_seconds(rows, n, k)
                rate = n * k * 2 / sec
                print(f"| {name} | {n} | {k} | {rows} | {lib} | {sec * 1e6:.1f} | {rate / 1e9:.0f} | "
                      f"{rate / bandwidth:.1%} |", flush=True)


if __name__ == "__main__":
    main()
