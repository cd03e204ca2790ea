"""Decode-shaped GEMMs (few rows × a weight matrix) against the copy ceiling, on one GPU (not a test).

A decode step of batch ``M`` reads each weight matrix once; at small ``M`` a GEMM is bound by that read,
so its ceiling is ``weight bytes / device copy bandwidth`` (read + write bytes of a 1 GiB copy, the
best of 20 in the same process, ``bench.ceilings.copy_bandwidth``). For each Llama-3-8B projection
(merged QKV, O, merged gate/up, down, LM head) and each ``M`` this prints the achieved weight-read
bandwidth as a fraction of that ceiling (the GEMMs of one shape replayed from a CUDA graph, as in a
decode step), for torch's default BLAS and for cuBLASLt (``torch.backends.cuda.preferred_blas_library``),
and at one row for pdserve's Triton GEMV (``engine.ops.gemv``) over a few tile shapes, and the down
projection with ``silu_mul`` as its own kernel against the gated GEMV that folds it in.
Eight copies of each weight are cycled so the 50 MB L2 cache never holds the matrix being read. Each
row is the median over 8 graph replays of 64 GEMMs, with the min–max of those replays.

    python3 -m bench.kernels.gemm_decode --rows 1 8 32
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable

import torch

from bench.ceilings import copy_bandwidth
from bench.timing import Spread, replay_seconds

# (name, out_features N, in_features K) of Llama-3-8B with merged projections, then Qwen3-30B-A3B's dense
# attention projections (its feed-forward is the mixture of experts: bench.kernels.fused_moe_gemv_sweep)
SHAPES = (("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336),
          ("lm_head", 128256, 4096), ("qwen3_moe_qkv", 5120, 2048), ("qwen3_moe_o", 2048, 4096))


GEMV_TILES = ((8, 512, 4), (4, 512, 4), (16, 256, 4), (8, 1024, 8), (2, 1024, 4), (4, 256, 2), (16, 512, 8))


def gemm_seconds(rows: int, n: int, k: int, copies: int = 8, iters: int = 64,
                 fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
                 x_cols: int | None = None) -> Spread:
    """Seconds per ``F.linear(x [rows, k], w [n, k])`` in bf16, cycling ``copies`` weights, over 8 graph
    replays. The ``iters`` GEMMs are captured in one CUDA graph and replayed, as in a decode step, so
    Python launch cost is not counted. ``fn(x, w)`` replaces ``F.linear`` (e.g. ``engine.ops.gemv``);
    ``x_cols``: the width of ``x`` when it is not ``k`` (a gated GEMV's ``[gate | up]`` input)."""
    op = fn or (lambda x, w: torch.nn.functional.linear(x, w))
    dev = torch.device("cuda")
    weights = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    x = torch.randn(rows, x_cols or k, device=dev, dtype=torch.bfloat16)
    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):  # warm-up (cuBLAS picks and loads its kernels) off the capture
        for w in weights:
            op(x, w)
    torch.cuda.current_stream(dev).wait_stream(side)
    def chain() -> None:
        for i in range(iters):
            op(x, weights[i % copies])
    return replay_seconds(chain, 8).scaled(1 / iters)


def main(argv: list[str] | None = None) -> None:
    """Print one markdown row per (shape, rows, BLAS library)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--shapes", nargs="+", default=[s[0] for s in SHAPES], choices=[s[0] for s in SHAPES])
    p.add_argument("--tiles", nargs="+", default=None, metavar="NxKwW",
                   help="GEMV tiles to sweep at one row, e.g. 8x1024w8 (default: a fixed list); with "
                   "--tiles the down shape is also swept gated (SiLU·mul folded in)")
    p.add_argument("--gemv-only", action="store_true", help="skip the cuBLAS / cuBLASLt rows")
    args = p.parse_args(argv)
    shapes = [s for s in SHAPES if s[0] in args.shapes]
    tiles = [_tile(t) for t in args.tiles] if args.tiles else list(GEMV_TILES)
    bandwidth = copy_bandwidth(torch.device("cuda")).max
    print(f"# {torch.cuda.get_device_name()}, copy bandwidth {bandwidth / 1e12:.2f} TB/s "
          "(read + write, best of 20)")
    print("| shape | N | K | rows | BLAS | µs: median (min–max) | weight GB/s "
          "| weight GB/s / copy bandwidth |")
    print("|---|---|---|---|---|---|---|---|")
    for lib in () if args.gemv_only else ("cublas", "cublaslt"):
        torch.backends.cuda.preferred_blas_library(lib)
        for name, n, k in shapes:
            for rows in args.rows:
                sec = gemm_seconds(rows, n, k)
                print(_row(name, n, k, rows, lib, sec, bandwidth), flush=True)
    if 1 in args.rows:
        _gemv_rows(bandwidth, shapes, tiles, gated=args.tiles is not None)
        if args.tiles is None:
            _silu_down_rows(bandwidth)


def _row(name: str, n: int, k: int, rows: int, how: str, sec: Spread, bandwidth: float) -> str:
    """One markdown row: µs (median, min–max), weight-read GB/s and its share of the copy bandwidth at the
    median time."""
    rate = n * k * 2 / sec.median
    return (f"| {name} | {n} | {k} | {rows} | {how} | {sec.scaled(1e6).fmt('.1f')} | {rate / 1e9:.0f} | "
            f"{rate / bandwidth:.1%} |")


def _tile(text: str) -> tuple[int, int, int]:
    """``"8x1024w8"`` → ``(8, 1024, 8)``: rows per program, inputs per step, warps."""
    rows, rest = text.split("x")
    cols, warps = rest.split("w")
    return int(rows), int(cols), int(warps)


def _gemv_rows(bandwidth: float, shapes: list[tuple[str, int, int]], tiles: list[tuple[int, int, int]],
               gated: bool) -> None:
    """One row per (shape, tile) of ``engine.ops.gemv`` at one row, checked against ``F.linear``; with
    ``gated`` the down shape also as the gated GEMV (input ``[gate | up]``)."""
    from engine.ops.gemv import gemv, gemv_reference

    for name, n, k in shapes:
        for is_gated in (False, True) if gated and name == "down" else (False,):
            for bn, bk, warps in tiles:
                fn = functools.partial(gemv, gated=is_gated, block_n=bn, block_k=bk, num_warps=warps)
                x = torch.randn(1, 2 * k if is_gated else k, device="cuda", dtype=torch.bfloat16)
                w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
                err = (fn(x, w).float() - gemv_reference(x, w, gated=is_gated).float()).abs().max().item()
                sec = gemm_seconds(1, n, k, fn=fn, x_cols=2 * k if is_gated else None)
                label = f"triton gemv{' gated' if is_gated else ''} {bn}x{bk} w{warps} (err {err:.2g})"
                print(_row(name, n, k, 1, label, sec, bandwidth), flush=True)


def _silu_down_rows(bandwidth: float) -> None:
    """The down projection at one row as a decode step runs it: ``silu_mul`` then the GEMV (two launches)
    against the gated GEMV that applies SiLU·mul while loading (``gemv(gated=True)``, one launch)."""
    from engine.ops.gemv import gemv
    from engine.ops.silu_mul import silu_mul

    _, n, k = SHAPES[3]
    for label, fn in (("silu_mul + triton gemv", lambda x, w: gemv(silu_mul(x), w)),
                      ("triton gemv gated", functools.partial(gemv, gated=True))):
        sec = gemm_seconds(1, n, k, fn=fn, x_cols=2 * k)
        print(_row("down (from gate/up)", n, k, 1, label, sec, bandwidth), flush=True)


if __name__ == "__main__":
    main()
