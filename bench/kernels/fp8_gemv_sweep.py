"""Tile sweep of the weight-only FP8 GEMV (``engine.ops.fp8_gemm.fp8_gemv``) against the copy ceiling, on
one GPU (not a test).

For each Llama-3-8B decoder projection (merged QKV, O, merged gate/up, and down with SiLU·mul folded in,
as batch-1 decode runs them) in each scale layout (per-channel, 128 x 128 blocks) and each tile
``(block_n, block_k, num_warps)``, the FP8 weight-read bandwidth (weight bytes plus scales per call /
seconds per call) as a share of the device copy bandwidth (read + write bytes of a 1 GiB copy, best of
20, ``bench.ceilings.copy_bandwidth``, same process). Eight copies of each weight are cycled so the L2
cache never holds the matrix being read; 64 calls are captured in one CUDA graph (programmatic dependent
launch on, as in a decode step) and replayed 8 times (``bench.timing.replay_seconds``): median and
min–max per call. The last line per (layout, shape) names the best tile and the default
(``fp8_gemv_tile``); ``--json`` writes every row and the winners.

    python -m bench.kernels.fp8_gemv_sweep --json fp8_gemv_sweep.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from bench.ceilings import copy_bandwidth
from bench.timing import Spread, replay_seconds
from engine.ops.fp8_gemm import Fp8Weight, fp8_gemv, fp8_gemv_tile

# (name, N, K, gated) of Llama-3-8B's merged projections at batch 1
SHAPES = (("qkv", 6144, 4096, False), ("o", 4096, 4096, False), ("gate_up", 28672, 4096, False),
          ("down", 4096, 14336, True))
# (block_n, block_k, num_warps): 2 KiB to 32 KiB of FP8 per program and step
TILES = ((1, 4096, 4), (2, 1024, 4), (2, 2048, 4), (2, 4096, 8), (4, 1024, 4), (4, 2048, 4), (4, 2048, 8),
         (4, 4096, 8), (8, 512, 4), (8, 1024, 4), (8, 1024, 8), (8, 2048, 8), (16, 512, 4), (16, 1024, 8))


def _weights(n: int, k: int, layout: str, copies: int) -> list[Fp8Weight]:
    dev = torch.device("cuda")
    out = []
    for _ in range(copies):
        q = (torch.randn(n, k, device=dev) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
        if layout == "block":
            s = torch.rand(-(-n // 128), -(-k // 128), device=dev) * 1e-3 + 1e-4
            out.append(Fp8Weight(q, s, "block", (128, 128)))
        else:
            out.append(Fp8Weight(q, torch.rand(n, device=dev) * 1e-3 + 1e-4, "channel"))
    return out


def gemv_seconds(weights: list[Fp8Weight], gated: bool, tile: tuple[int, int, int],
                 iters: int = 64) -> Spread:
    """Seconds per ``fp8_gemv`` call with ``tile``, cycling ``weights``, over 8 graph replays of ``iters``
    calls."""
    k = weights[0].weight.shape[1]
    x = torch.randn(1, 2 * k if gated else k, device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and load the kernel off the capture
        fp8_gemv(x, weights[0], None, tile=tile, gated=gated)
    torch.cuda.current_stream().wait_stream(side)

    def chain() -> None:
        for i in range(iters):
            fp8_gemv(x, weights[i % len(weights)], None, tile=tile, gated=gated)
    return replay_seconds(chain, 8).scaled(1 / iters)


def sweep(layouts: list[str], shapes: list[str], tiles: list[tuple[int, int, int]]) -> dict[str, Any]:
    """Every (layout, shape, tile); prints markdown rows; returns the JSON-ready result."""
    bandwidth = copy_bandwidth(torch.device("cuda")).max
    print(f"# {torch.cuda.get_device_name()}, copy bandwidth {bandwidth / 1e12:.3f} TB/s (read + write, "
          "best of 20)", flush=True)
    print("| layout | shape | N | K | tile (n x k, warps) | µs: median (min–max) | GB/s | share of copy |")
    print("|---|---|---|---|---|---|---|---|", flush=True)
    res: dict[str, Any] = {"copy_bandwidth": bandwidth, "rows": [], "best": {}}
    for layout in layouts:
        for name, n, k, gated in SHAPES:
            if name not in shapes:
                continue
            weights = _weights(n, k, layout, 8)
            nbytes = weights[0].nbytes()
            default = fp8_gemv_tile(n, gated)
            best: tuple[float, tuple[int, int, int]] | None = None
            for tile in dict.fromkeys([default, *tiles]):
                t = gemv_seconds(weights, gated, tile)
                gbs = nbytes / t.median / 1e9
                share = gbs * 1e9 / bandwidth
                res["rows"].append(dict(layout=layout, shape=name, n=n, k=k, tile=list(tile),
                                        seconds=t.as_dict(), gb_s=gbs, share=share))
                mark = " (default)" if tile == default else ""
                print(f"| {layout} | {name} | {n} | {k} | {tile[0]} x {tile[1]}, {tile[2]}{mark} | "
                      f"{t.scaled(1e6).fmt('.2f')} | {gbs:.0f} | {100 * share:.1f} % |", flush=True)
                if best is None or gbs > best[0]:
                    best = (gbs, tile)
            assert best is not None
            default_gbs = next(r["gb_s"] for r in res["rows"] if r["layout"] == layout and r["shape"] == name
                               and r["tile"] == list(default))
            res["best"][f"{layout}/{name}"] = dict(
                tile=list(best[1]), share=best[0] * 1e9 / bandwidth, default=list(default),
                default_share=default_gbs * 1e9 / bandwidth)
            print(f"best {layout} {name}: {best[1]} {100 * best[0] * 1e9 / bandwidth:.1f} % "
                  f"(default {default}: {100 * default_gbs * 1e9 / bandwidth:.1f} %)", flush=True)
            del weights
            torch.cuda.empty_cache()
    return res


def _tile(text: str) -> tuple[int, int, int]:
    nk, w = text.split("w")
    n, k = nk.split("x")
    return int(n), int(k), int(w)


def main(argv: list[str] | None = None) -> None:
    """Parse arguments and sweep (CUDA only)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layouts", nargs="+", default=["channel", "block"], choices=["channel", "block"])
    p.add_argument("--shapes", nargs="+", default=[s[0] for s in SHAPES], choices=[s[0] for s in SHAPES])
    p.add_argument("--tiles", nargs="+", default=None, metavar="NxKwW",
                   help="tiles to sweep, e.g. 8x1024w4 (default: a fixed list of 2-32 KiB tiles)")
    p.add_argument("--json", type=Path, default=None, help="write the rows and winners here")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA device")
    tiles = [_tile(t) for t in args.tiles] if args.tiles else list(TILES)
    result = sweep(args.layouts, args.shapes, tiles)
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
