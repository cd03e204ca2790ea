"""The fused MoE kernels against a per-expert torch loop and a same-run grouped-GEMM ceiling (not a test).

For each token count (prefill sizes by default) with uniform random top-k routing over the experts of
``--shape`` (default Qwen3-30B-A3B's: 128 experts, top-8, hidden 2048, expert width 768), three ways to
compute the same layer are timed in one process, ``--repeats`` calls each after warm-up:

- ``fused``: ``engine.ops.fused_moe.fused_moe`` (alignment, gate/up GEMM with SwiGLU, down GEMM with the
  routing weights, the per-token sum);
- ``loop``: ``fused_moe_reference``, one pair of cuBLAS GEMMs per expert hit (transformers' eager
  experts);
- ``ceiling``: the two GEMMs alone as batched cuBLAS GEMMs (``torch.bmm``) with every expert given the
  same number of rows ``T k / E`` (no gather, no activation, no sum, no imbalance): the best of at least
  20 calls (``bench.timing.ceiling_seconds``).

Printed per token count: TFLOP/s of each (``2 T k (2 I H + I H)`` FLOPs, the useful work), fused / ceiling
and fused speed-up over the loop.

    python3 -m bench.kernels.fused_moe --tokens 512 2048 8192

``--decode`` (decode sizes: a step reads weights, it does little arithmetic): both paths of
``fused_moe`` (``grouped``: aligned grouped GEMMs; ``gemv``: one matrix-vector product per pair), each
captured in a CUDA graph as a decode step runs it and timed per replay; printed per token count as the
bandwidth of the bytes a step must read (the distinct experts' weights, ``3 I H`` elements each)
against the same-run copy bandwidth (``bench.ceilings.copy_bandwidth``, best of >= 20), and which path
``moe_path`` picks:

    python3 -m bench.kernels.fused_moe --decode --tokens 1 2 4 8 16 32

``--fp8 channel|block``: the experts as FP8 weights (``engine.ops.fused_moe_fp8``; per-row scales, or
128 x 128 tiles), dequantized in the kernels; the bytes counted are the FP8 weights' (one per element).
With FP8 the matrix-vector path is also timed with the weights decoded by integer operations
(``fused_moe_gemv(decode_bits=True)``, as the dense one-row FP8 GEMVs do).
"""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path
from typing import Any

import torch

from bench.ceilings import copy_bandwidth
from bench.timing import Spread, ceiling_seconds, replay_seconds, time_calls
from engine.ops.fused_moe import fused_moe, fused_moe_reference, moe_path
from engine.ops.fused_moe_fp8 import ExpertScales, quantize_experts
from engine.ops.fused_moe_gemv import fused_moe_gemv

# (experts, top_k, hidden, expert width) of the published configs
SHAPES = {"qwen3-30b-a3b": (128, 8, 2048, 768), "mixtral-8x7b": (8, 2, 4096, 14336),
          "glm-4.5-air": (128, 8, 4096, 1408), "tiny": (8, 2, 64, 32)}  # tiny: a CPU smoke run


def layer(experts: int, top_k: int, hidden: int, inter: int, tokens: int, dtype: torch.dtype,
          device: torch.device, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """``(x, w_gate_up, w_down, topk_weights, topk_ids)`` with uniform random routing (distinct experts
    per token, weights summing to 1)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(tokens, hidden, device=device, generator=gen).to(dtype)
    w_gate_up = torch.randn(experts, 2 * inter, hidden, device=device, generator=gen) * hidden ** -0.5
    w_gate_up = w_gate_up.to(dtype)
    w_down = (torch.randn(experts, hidden, inter, device=device, generator=gen) * inter ** -0.5).to(dtype)
    scores = torch.rand(tokens, experts, device=device, generator=gen)
    weights, ids = scores.topk(top_k, dim=-1)
    return x, w_gate_up, w_down, weights / weights.sum(-1, keepdim=True), ids


def _two_bmm(a: torch.Tensor, w1: torch.Tensor, b: torch.Tensor, w2: torch.Tensor) -> None:
    """The ceiling's work: ``a @ w1`` and ``b @ w2`` as batched GEMMs over the experts."""
    torch.bmm(a, w1)
    torch.bmm(b, w2)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Time the three ways per token count (module docstring); returns the JSON-ready rows."""
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    experts, top_k, hidden, inter = SHAPES[args.shape]
    rows = []
    for tokens in args.tokens:
        x, w_gate_up, w_down, weights, ids = layer(experts, top_k, hidden, inter, tokens, dtype, device)
        flops = 2.0 * tokens * top_k * 3 * inter * hidden
        per = max(1, tokens * top_k // experts)
        a = torch.randn(experts, per, hidden, device=device).to(dtype)
        act = torch.randn(experts, per, inter, device=device).to(dtype)
        ceiling = functools.partial(_two_bmm, a, w_gate_up.transpose(1, 2), act, w_down.transpose(1, 2))
        ceil = ceiling_seconds(ceiling, device).per(2.0 * experts * per * 3 * inter * hidden / 1e12)
        case = (x, w_gate_up, w_down, weights, ids)
        fused = Spread.of(time_calls(functools.partial(fused_moe, *case), device, args.warmup,
                                     args.repeats)).per(flops / 1e12)
        loop = Spread.of(time_calls(functools.partial(fused_moe_reference, *case), device, args.warmup,
                                    args.repeats)).per(flops / 1e12)
        row = dict(tokens=tokens, fused_tflops=fused.as_dict(), loop_tflops=loop.as_dict(),
                   ceiling_tflops=ceil.as_dict(), fused_over_ceiling=fused.median / ceil.max,
                   fused_over_loop=fused.median / loop.median)
        rows.append(row)
        print(f"{args.shape} tokens {tokens:6d}: fused {fused.fmt('.1f', ' TFLOP/s')}, loop "
              f"{loop.fmt('.1f', ' TFLOP/s')}, grouped-GEMM ceiling best {ceil.max:.1f} TFLOP/s; "
              f"fused / ceiling {100 * row['fused_over_ceiling']:.1f} %, fused / loop "
              f"{row['fused_over_loop']:.2f}x", flush=True)
    return {"shape": args.shape, "dtype": args.dtype, "device": str(device), "rows": rows}


def run_decode(args: argparse.Namespace) -> dict[str, Any]:
    """Both paths per decode token count, replayed from CUDA graphs (module docstring)."""
    device = torch.device(args.device)
    if device.type != "cuda":
        raise SystemExit("--decode times CUDA graph replays: it needs --device cuda")
    dtype = getattr(torch, args.dtype)
    experts, top_k, hidden, inter = SHAPES[args.shape]
    copy = copy_bandwidth(device)
    rows = []
    for tokens in args.tokens:
        x, w_gate_up, w_down, weights, ids = layer(experts, top_k, hidden, inter, tokens, dtype, device)
        scales = None
        if args.fp8 is not None:
            block = (128, 128) if args.fp8 == "block" else None
            w_gate_up, s_up = quantize_experts(w_gate_up, block)
            w_down, s_down = quantize_experts(w_down, block)
            scales = ExpertScales(s_up, s_down, block)
        distinct = int(torch.unique(ids).numel())
        nbytes = distinct * 3 * inter * hidden * w_gate_up.element_size()
        row: dict[str, Any] = dict(tokens=tokens, distinct_experts=distinct, bytes=nbytes,
                                   picked=moe_path(tokens, top_k, experts))
        want = fused_moe_reference(x, w_gate_up, w_down, weights, ids, scales=scales).float()
        line = []
        for path in ("grouped", "gemv"):
            work = functools.partial(fused_moe, x, w_gate_up, w_down, weights, ids, path=path, scales=scales)
            got = work().float()
            err = float((got - want).abs().max())
            torch.cuda.synchronize()
            secs = replay_seconds(work, args.repeats)
            rate = secs.per(nbytes)  # bytes/s
            row[path] = dict(us=secs.scaled(1e6).as_dict(), over_copy=rate.median / copy.max, max_abs_err=err)
            line.append(f"{path} {secs.median * 1e6:.1f} us ({100 * rate.median / copy.max:.1f} % of copy, "
                        f"best {100 * rate.max / copy.max:.1f} %, err {err:.1e})")
        for tile in args.tiles:
            up, down = _tile_pair(tile)
            work = functools.partial(fused_moe_gemv, x, w_gate_up, w_down, weights, ids, up_tile=up,
                                     down_tile=down, scales=scales)
            err = float((work().float() - want).abs().max())
            torch.cuda.synchronize()
            rate = replay_seconds(work, args.repeats).per(nbytes)
            row.setdefault("tiles", {})[tile] = dict(over_copy=rate.median / copy.max, max_abs_err=err)
            line.append(f"gemv {tile} {100 * rate.median / copy.max:.1f} %")
        if scales is not None:  # the matrix-vector path with the e4m3 weights decoded by integer operations
            work = functools.partial(fused_moe_gemv, x, w_gate_up, w_down, weights, ids, scales=scales,
                                     decode_bits=True)
            err = float((work().float() - want).abs().max())
            torch.cuda.synchronize()
            rate = replay_seconds(work, args.repeats).per(nbytes)
            row["gemv_decode_bits"] = dict(over_copy=rate.median / copy.max, max_abs_err=err)
            line.append(f"gemv, weights decoded by integer operations {100 * rate.median / copy.max:.1f} % "
                        f"(err {err:.1e})")
        rows.append(row)
        print(f"{args.shape} decode tokens {tokens:3d} ({distinct} experts, {nbytes / 1e6:.1f} MB): "
              f"{'; '.join(line)}; moe_path picks {row['picked']}", flush=True)
    return {"shape": args.shape, "dtype": args.dtype, "fp8": args.fp8, "device": str(device),
            "copy_bytes_per_s": copy.as_dict(), "rows": rows}


def _tile_pair(text: str) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """``"BNxBKxW/BNxBKxW"`` (gate/up tile / down tile) → the two ``(block_n, block_k, num_warps)``."""
    up, down = text.split("/")
    a = tuple(int(v) for v in up.split("x"))
    b = tuple(int(v) for v in down.split("x"))
    if len(a) != 3 or len(b) != 3:
        raise ValueError(f"a tile is BNxBKxW/BNxBKxW, got {text!r}")
    return (a[0], a[1], a[2]), (b[0], b[1], b[2])


def build_parser() -> argparse.ArgumentParser:
    """The command line (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-30b-a3b")
    p.add_argument("--tokens", type=int, nargs="+", default=[512, 2048, 8192])
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--decode", action="store_true",
                   help="decode sizes: both paths from CUDA graphs against the copy bandwidth")
    p.add_argument("--tiles", nargs="*", default=[],
                   help="with --decode: also time the gemv path at these tiles, BNxBKxW/BNxBKxW each")
    p.add_argument("--fp8", choices=["channel", "block"], default=None,
                   help="--decode: FP8 experts with per-row or 128 x 128 block scales")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    return p


def main(argv: list[str] | None = None) -> None:
    """Parse arguments and run."""
    args = build_parser().parse_args(argv)
    if args.fp8 is not None and not args.decode:
        raise SystemExit("--fp8 times the decode sizes only: add --decode")
    result = run_decode(args) if args.decode else run(args)
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
