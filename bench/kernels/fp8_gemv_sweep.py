"""Tile sweep of the weight-only FP8 GEMV (``engine.ops.fp8_gemv.fp8_gemv``) against the copy ceiling, on
one GPU (not a test).

For each Llama-3-8B decoder projection (merged QKV, O, merged gate/up, and down with SiLU·mul folded in,
as batch-1 decode runs them) in each scale layout (per-channel, 128 x 128 blocks) and each tile
``(block_n, block_k, num_warps)``, the FP8 weight-read bandwidth (weight bytes plus scales per call /
seconds per call) as a share of the device copy bandwidth (read + write bytes of a 1 GiB copy, best of
20, ``bench.ceilings.copy_bandwidth``, same process). Eight copies of each weight are cycled so the L2
cache never holds the matrix being read; 64 calls are captured in one CUDA graph (programmatic dependent
launch on, as in a decode step) and replayed 8 times (``bench.timing.replay_seconds``): median and
min–max per call. The last line per (layout, shape) names the best tile and the default
(``fp8_gemv_tile``).

With ``--gemm-tokens T`` (prefill sizes) the same shapes also run the Triton block-scaled
``w8a8_block_gemm`` (``[T, K]`` FP8 activations with per-token-group scales times the 128 x 128
block-scaled weight) over a few ``(block_m, block_n, num_warps, num_stages)`` tiles, each against a
row-wise scaled ``torch._scaled_mm`` of the same shape (cuBLASLt/CUTLASS, best of 20 event-timed calls
after 3 warm-up ones, ``bench.timing.ceiling_seconds``): seconds, TFLOP/s and the ratio. ``--json``
writes every row and the winners.

    python -m bench.kernels.fp8_gemv_sweep --gemm-tokens 8192 --json fp8_gemv_sweep.json

``--candidates`` instead measures other ways to run the batch-1 FP8 projection, each timed as above
(graph of 64 calls cycling 8 weight copies, 8 replays, median and min–max) and printed as weight bytes per
second over the same-run copy ceiling, after checking its output against its reference (max error over
max |reference| <= 1e-2: the bf16 output's rounding plus summation order; a candidate that fails is
marked MISMATCH and never named best):

- ``engine default (fp8_linear)`` (on CUDA): what the model runs for the projection (the down projection:
  ``silu_mul``, then ``fp8_linear``), the baseline;
- ``bits gemv b_n x b_k, w``: ``fp8_gemv`` over ``BITS_TILES`` with the weights decoded by integer
  operations, ``convert gemv ...`` over ``CONVERT_TILES`` with the hardware conversion (``decode=0``),
  ``bits splitk b_n x b_k, w, s``: ``fp8_gemv_splitk`` over ``SPLITK_TILES`` (all weight-only, reference
  ``fp8_gemv_reference``); for the gated shape also ``silu_mul, then bits gemv ...``;
- ``mma b_n x b_k, ...``: ``fp8_gemv_mma`` over ``MMA_TILES`` (FP8 tensor cores, the input in three e4m3
  parts; same reference);
- ``scaled_mm pad16`` (per-channel weights only): the activation quantized per token to FP8
  (``quantize_fp8_groups``, SiLU·mul folded in for the down projection), written into row 0 of a
  zeroed ``[16, K]`` FP8 buffer, ``torch._scaled_mm(q [16, K] row-major, W^T [K, N] column-major,
  scale_a [16, 1], scale_b [1, N])`` (row-wise scales, bf16 out), row 0 kept: the weight is read once,
  cuBLASLt gets the 16 rows its FP8 kernels want (vLLM padded to 17 rows for ``_scaled_mm`` for the
  same reason). w8a8: reference ``scaled_fp8_linear_reference``;
- ``scaled_mm swapAB`` (per-channel only): the same product transposed, ``_scaled_mm(W [N, K]
  row-major, q^T [K, 16] column-major, scale_a [N, 1], scale_b [1, 16])`` then column 0, so N (thousands)
  is the GEMM's M and the 16 padded tokens its N: what vLLM's CUTLASS FP8 kernels do for M <= 16 on
  Hopper ("swap AB", 64 x 16 .. 64 x 64 tiles with a 128-256-wide K step).

    python -m bench.kernels.fp8_gemv_sweep --candidates --json fp8_gemv_candidates.json

``--match TEXT ...`` keeps the candidates whose name contains one of the texts (and the engine default).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.ceilings import copy_bandwidth
from bench.timing import Spread, ceiling_seconds, replay_seconds
from engine.ops.fp8_gemm import (
    block_gemm_tile,
    fp8_linear,
    quantize_fp8_groups,
    scaled_fp8_linear_reference,
    w8a8_block_gemm,
)
from engine.ops.fp8_gemv import fp8_gemv, fp8_gemv_mma, fp8_gemv_reference, fp8_gemv_splitk, fp8_gemv_tile
from engine.ops.fp8_weight import Fp8Weight
from engine.ops.silu_mul import silu_mul, silu_mul_reference

# (name, N, K, gated) of Llama-3-8B's merged projections at batch 1
SHAPES = (("qkv", 6144, 4096, False), ("o", 4096, 4096, False), ("gate_up", 28672, 4096, False),
          ("down", 4096, 14336, True))
# (block_n, block_k, num_warps): 2 KiB to 32 KiB of FP8 per program and step
TILES = ((1, 4096, 4), (2, 1024, 4), (2, 2048, 4), (2, 4096, 8), (4, 1024, 4), (4, 2048, 4), (4, 2048, 8),
         (4, 4096, 8), (8, 512, 4), (8, 1024, 4), (8, 1024, 8), (8, 2048, 8), (16, 512, 4), (16, 1024, 8))
# (block_m, block_n, num_warps, num_stages) of w8a8_block_gemm at prefill sizes (block_k: the weight's 128)
# (block_n, block_k, num_warps, split_k) of fp8_gemv_splitk: 16-byte runs per thread (block_k >= 512 over
# 32 lanes), 2-16 row blocks, K cut in 2-8 slices
SPLITK_TILES = ((8, 512, 4, 2), (8, 512, 4, 4), (32, 512, 8, 2))
# (block_n, block_k, num_warps) of fp8_gemv with the weights decoded by integer operations (decode=1) and,
# marked "convert", with the e4m3 conversion (decode=0): the leaders of a wider sweep on the H200
# (2026-12-04: 2-32 rows x 512-2048 inputs, 4-8 warps)
BITS_TILES = ((4, 1024, 4), (8, 512, 4), (8, 1024, 4), (16, 512, 4), (16, 1024, 8))
CONVERT_TILES = ((8, 512, 4), (8, 1024, 4))
# (block_n, block_k, num_warps, split_k, num_stages) of fp8_gemv_mma (FP8 tensor cores, the input in three
# e4m3 parts)
MMA_TILES = ((64, 256, 4, 1, 3), (64, 256, 4, 2, 3), (64, 256, 4, 4, 3), (64, 512, 4, 1, 3),
             (64, 512, 4, 2, 3), (128, 256, 4, 1, 3), (128, 256, 8, 1, 3), (128, 512, 8, 1, 3),
             (64, 128, 4, 2, 4), (32, 256, 4, 2, 3), (128, 256, 4, 2, 4))
CHECK_TOL = 1e-2  # max |out - ref| / max |ref|
GEMM_TILES = ((128, 128, 8, 3), (128, 128, 8, 4), (128, 128, 4, 3), (64, 128, 4, 4), (128, 64, 4, 4),
              (64, 256, 8, 3), (256, 64, 8, 3))


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


def _copy_ceiling() -> float:
    """The device's copy bandwidth (bytes/s, read + write of a 1 GiB copy, best of 20), printed as the title
    line of the tables that follow."""
    bandwidth = copy_bandwidth(torch.device("cuda")).max
    print(f"# {torch.cuda.get_device_name()}, copy bandwidth {bandwidth / 1e12:.3f} TB/s (read + write, "
          "best of 20)", flush=True)
    return bandwidth


def _row(*cells: object) -> None:
    """Print one markdown table row (flushed: a long sweep shows each row as it is measured)."""
    print("| " + " | ".join(map(str, cells)) + " |", flush=True)


def _header(*columns: str) -> None:
    """Print a markdown table's header row and its separator."""
    _row(*columns)
    print("|" + "---|" * len(columns), flush=True)


def sweep(layouts: list[str], shapes: list[str], tiles: list[tuple[int, int, int]],
          json_path: Path | None = None) -> dict[str, Any]:
    """Every (layout, shape, tile); prints markdown rows; returns the JSON-ready result (also written to
    ``json_path`` after each shape, so a run cut short keeps what it measured)."""
    bandwidth = _copy_ceiling()
    _header("layout", "shape", "N", "K", "tile (n x k, warps)", "µs: median (min–max)", "GB/s",
            "share of copy")
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
                _row(layout, name, n, k, f"{tile[0]} x {tile[1]}, {tile[2]}{mark}", t.scaled(1e6).fmt(".2f"),
                     f"{gbs:.0f}", f"{100 * share:.1f} %")
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
            if json_path is not None:
                json_path.write_text(json.dumps(res, indent=2))
    return res


Candidate = Callable[[torch.Tensor, Fp8Weight], torch.Tensor]


def _scaled_mm_candidate(k: int, gated: bool, swap_ab: bool, device: str = "cuda") -> Candidate:
    """``x [1, K]`` (``[1, 2 K]`` gated) times a per-channel FP8 weight through ``torch._scaled_mm`` with
    the token padded to 16 rows (module docstring); buffers allocated once, outside the graph."""
    q_pad = torch.zeros(16, k, device=device, dtype=torch.float8_e4m3fn)
    s_pad = torch.ones(16, 1, device=device, dtype=torch.float32)

    def run(x: torch.Tensor, w: Fp8Weight) -> torch.Tensor:
        q, s = quantize_fp8_groups(x, k, gated=gated)
        q_pad[:1].copy_(q)
        s_pad[:1].copy_(s)
        if swap_ab:
            out = torch._scaled_mm(w.weight, q_pad.t(), scale_a=w.scale.reshape(-1, 1),
                                   scale_b=s_pad.reshape(1, 16), out_dtype=torch.bfloat16)
            return out[:, :1].t()
        return torch._scaled_mm(q_pad, w.weight.t(), scale_a=s_pad, scale_b=w.scale.reshape(1, -1),
                                out_dtype=torch.bfloat16)[:1]
    return run


def _splitk(tile: tuple[int, int, int, int], gated: bool, decode: int = 0) -> Candidate:
    def run(x: torch.Tensor, w: Fp8Weight) -> torch.Tensor:
        return fp8_gemv_splitk(x, w, None, tile=tile, gated=gated, decode=decode)
    return run


def _bits(tile: tuple[int, int, int], gated: bool) -> Candidate:
    def run(x: torch.Tensor, w: Fp8Weight) -> torch.Tensor:
        return fp8_gemv(x, w, None, tile=tile, gated=gated, decode=1)
    return run


def _convert(tile: tuple[int, int, int], gated: bool) -> Candidate:
    def run(x: torch.Tensor, w: Fp8Weight) -> torch.Tensor:
        return fp8_gemv(x, w, None, tile=tile, gated=gated, decode=0)
    return run


def _mma(tile: tuple[int, int, int, int, int], gated: bool) -> Candidate:
    def run(x: torch.Tensor, w: Fp8Weight) -> torch.Tensor:
        return fp8_gemv_mma(x, w, None, tile=tile, gated=gated)
    return run


def _silu_then_bits(tile: tuple[int, int, int]) -> Candidate:
    def run(x: torch.Tensor, w: Fp8Weight) -> torch.Tensor:
        return fp8_gemv(silu_mul(x), w, None, tile=tile, decode=1)
    return run


def _engine(gated: bool) -> Candidate:
    """What the model runs for a one-row projection: ``fp8_linear`` (the down projection: ``silu_mul``
    first, as ``FusedCausalLM``'s one-row FP8 steps do)."""
    def run(x: torch.Tensor, w: Fp8Weight) -> torch.Tensor:
        if gated:
            return fp8_linear(silu_mul(x), w, None, True)
        return fp8_linear(x, w, None, True)
    return run


def _candidates(layout: str, n: int, k: int, gated: bool, device: str = "cuda"
                ) -> list[tuple[str, Candidate, bool]]:
    """``(name, fn(x, w) -> [1, N], weight_only)`` of every candidate for this layout and shape."""
    out: list[tuple[str, Candidate, bool]] = []
    if device == "cuda":  # fp8_linear runs the weight-only GEMVs for one row on CUDA only (w8a8 elsewhere)
        out.append(("engine default (fp8_linear)", _engine(gated), True))
    for tile in BITS_TILES:
        out.append((f"bits gemv {tile[0]} x {tile[1]}, {tile[2]}", _bits(tile, gated), True))
    for st in SPLITK_TILES:
        out.append((f"bits splitk {st[0]} x {st[1]}, {st[2]}, {st[3]}", _splitk(st, gated, 1), True))
    for tile in CONVERT_TILES:
        out.append((f"convert gemv {tile[0]} x {tile[1]}, {tile[2]}", _convert(tile, gated), True))
    for mt in MMA_TILES:
        out.append((f"mma {mt[0]} x {mt[1]}, {mt[2]} warps, {mt[3]} splits, {mt[4]} stages", _mma(mt, gated),
                    True))
    if gated:
        for tile in BITS_TILES[1:3]:
            out.append((f"silu_mul, then bits gemv {tile[0]} x {tile[1]}, {tile[2]}", _silu_then_bits(tile),
                        True))
    if layout == "channel":
        out.append(("scaled_mm pad16", _scaled_mm_candidate(k, gated, False, device), False))
        out.append(("scaled_mm swapAB", _scaled_mm_candidate(k, gated, True, device), False))
    return out


def _check(fn: Candidate, x: torch.Tensor, w: Fp8Weight, weight_only: bool, gated: bool) -> float:
    """Max |fn(x, w) - reference| / max |reference| (reference: weight-only or w8a8, float32)."""
    got = fn(x, w).float()
    if weight_only:
        ref = fp8_gemv_reference(x.float(), w, None, gated=gated).float()
    else:
        ref = scaled_fp8_linear_reference(silu_mul_reference(x) if gated else x, w, None).float()
    return float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def _seconds(fn: Candidate, weights: list[Fp8Weight], x: torch.Tensor, iters: int = 64) -> Spread:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and load the kernels off the capture
        fn(x, weights[0])
    torch.cuda.current_stream().wait_stream(side)

    def chain() -> None:
        for i in range(iters):
            fn(x, weights[i % len(weights)])
    return replay_seconds(chain, 8).scaled(1 / iters)


def candidate_sweep(layouts: list[str], shapes: list[str], json_path: Path | None = None,
                    match: list[str] | None = None) -> dict[str, Any]:
    """Every candidate per (layout, shape): checked, timed, printed as markdown rows with its share of the
    same-run copy ceiling; returns the JSON-ready result (written to ``json_path`` after each shape)."""
    bandwidth = _copy_ceiling()
    _header("layout", "shape", "N", "K", "candidate", "µs: median (min–max)", "GB/s", "share of copy",
            "max err / max ref")
    res: dict[str, Any] = {"copy_bandwidth": bandwidth, "rows": [], "best": {}}
    for layout in layouts:
        for name, n, k, gated in SHAPES:
            if name not in shapes:
                continue
            weights = _weights(n, k, layout, 8)
            nbytes = weights[0].nbytes()
            x = torch.randn(1, 2 * k if gated else k, device="cuda", dtype=torch.bfloat16)
            best: tuple[float, str] | None = None
            baseline = 0.0
            for cand, fn, weight_only in _candidates(layout, n, k, gated):
                if match and not cand.startswith("engine default") and not any(m in cand for m in match):
                    continue
                try:
                    err = _check(fn, x, weights[0], weight_only, gated)
                    t = _seconds(fn, weights, x)
                except Exception as exc:  # a candidate that cannot run this shape: named, skipped
                    _row(layout, name, n, k, cand, f"failed: {type(exc).__name__}: {str(exc)[:80]}",
                         "", "", "")
                    continue
                share = nbytes / t.median / bandwidth
                ok = err <= CHECK_TOL
                res["rows"].append(dict(layout=layout, shape=name, n=n, k=k, candidate=cand,
                                        seconds=t.as_dict(), gb_s=nbytes / t.median / 1e9, share=share,
                                        rel_err=err, ok=ok))
                _row(layout, name, n, k, cand, t.scaled(1e6).fmt(".2f"), f"{nbytes / t.median / 1e9:.0f}",
                     f"{100 * share:.1f} %", f"{err:.1e}{'' if ok else ' MISMATCH'}")
                if cand.startswith("engine default"):
                    baseline = share
                if ok and (best is None or share > best[0]):
                    best = (share, cand)
            if best is not None:
                res["best"][f"{layout}/{name}"] = dict(candidate=best[1], share=best[0],
                                                       engine_default_share=baseline)
                print(f"best {layout} {name}: {best[1]} {100 * best[0]:.1f} % of copy (engine default "
                      f"{100 * baseline:.1f} %)", flush=True)
            del weights
            torch.cuda.empty_cache()
            if json_path is not None:
                json_path.write_text(json.dumps(res, indent=2))
    return res


def _gemm_shape(name: str, n: int, k: int, tokens: int, res: dict[str, Any]) -> None:
    dev = torch.device("cuda")
    x = torch.randn(tokens, k, device=dev, dtype=torch.bfloat16)
    q, s = quantize_fp8_groups(x, 128)
    w = _weights(n, k, "block", 1)[0]
    sa = torch.rand(tokens, 1, device=dev) + 0.5
    sb = torch.rand(1, n, device=dev) + 0.5

    def peer_gemm() -> torch.Tensor:
        return torch._scaled_mm(q, w.weight.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
    peer = ceiling_seconds(peer_gemm, dev, 20).min
    flops = 2 * tokens * n * k
    default = block_gemm_tile(tokens)
    best: tuple[float, tuple[int, int, int, int]] | None = None
    for tile in dict.fromkeys([default, *GEMM_TILES]):
        def gemm(tile: tuple[int, int, int, int] = tile) -> torch.Tensor:
            return w8a8_block_gemm(q, s, w, torch.bfloat16, tile=tile)
        try:
            t = ceiling_seconds(gemm, dev, 20).min
        except Exception as exc:  # a tile that does not fit (shared memory, registers): named, skipped
            _row(name, tokens, n, k, tile, f"failed: {type(exc).__name__}", "", "", "")
            continue
        res["rows"].append(dict(shape=name, m=tokens, n=n, k=k, tile=list(tile), seconds=t,
                                scaled_mm_seconds=peer))
        mark = " (default)" if tile == default else ""
        _row(name, tokens, n, k, f"{tile[0]} x {tile[1]}, {tile[2]}, {tile[3]}{mark}", f"{t * 1e3:.3f}",
             f"{flops / t / 1e12:.0f}", f"{peer * 1e3:.3f}", f"{100 * peer / t:.1f} %")
        if best is None or t < best[0]:
            best = (t, tile)
    if best is not None:
        res["best"][name] = dict(tile=list(best[1]), share=peer / best[0], default=list(default))
        print(f"best block GEMM {name}: {best[1]} {100 * peer / best[0]:.1f} % of _scaled_mm", flush=True)


def gemm_sweep(tokens: int, shapes: list[str]) -> dict[str, Any]:
    """``w8a8_block_gemm`` over ``GEMM_TILES`` per shape at ``tokens`` rows against ``torch._scaled_mm``
    (row-wise scales, bf16 out) of the same shape; prints markdown rows; returns the JSON-ready result."""
    _header("shape", "M", "N", "K", "block GEMM tile (m x n, warps, stages)", "ms", "TFLOP/s",
            "_scaled_mm ms", "share of _scaled_mm")
    res: dict[str, Any] = {"rows": [], "best": {}}
    for name, n, k, _ in SHAPES:
        if name in shapes:
            _gemm_shape(name, n, k, tokens, res)
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
    p.add_argument("--gemm-tokens", type=int, default=0,
                   help="also sweep w8a8_block_gemm tiles at this many rows (0: GEMV only)")
    p.add_argument("--candidates", action="store_true",
                   help="measure the GEMV candidates (split-K, _scaled_mm padded / swap-AB) instead of the "
                        "fp8_gemv tile sweep")
    p.add_argument("--match", nargs="+", default=None, metavar="TEXT",
                   help="with --candidates: only the candidates whose name contains one of these (and the "
                        "engine default)")
    p.add_argument("--json", type=Path, default=None, help="write the rows and winners here")
    args = p.parse_args(argv)
    if args.match and not args.candidates:
        p.error("--match belongs to --candidates")
    if not torch.cuda.is_available():
        p.error("needs a CUDA device")
    if args.candidates and args.tiles:
        p.error("--tiles belongs to the tile sweep, not --candidates")
    if args.candidates:
        result = candidate_sweep(args.layouts, args.shapes, args.json, args.match)
    else:
        tiles = [_tile(t) for t in args.tiles] if args.tiles else list(TILES)
        result = sweep(args.layouts, args.shapes, tiles, args.json)
    if args.gemm_tokens:
        result["gemm"] = gemm_sweep(args.gemm_tokens, args.shapes)
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
