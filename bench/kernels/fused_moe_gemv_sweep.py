"""Tile sweep of the matrix-vector MoE kernels and of the router GEMV at decode sizes (not a test).

For each token count (default 1, 2, 4, 8) with the experts of ``--shape`` (default Qwen3-30B-A3B's: 128
experts, top-8, hidden 2048, expert width 768), in one process:

- ``copy``: the device-to-device copy bandwidth (``bench.ceilings.copy_bandwidth``, best of >= 20), the
  ceiling every rate is divided by;
- ``up``: ``engine.ops.fused_moe.fused_moe_gemv`` at each gate/up tile of ``--up-tiles`` (``BNxBKxW``:
  block_n, block_k, num_warps) with the down kernel at its default tile and slots;
- ``down``: the same at each down tile of ``--down-tiles`` (``BNxBKxWxS``: block_n, block_k, num_warps,
  slots read at once; a trailing ``p``: the expert ids and first weight tile loaded before the wait for the
  gate/up kernel, ``fused_moe_gemv(down_prefetch=True)``) with the gate/up kernel at its default tile;
- ``best``: the best gate/up tile with the best down tile (the defaults ``gemv_moe_tile`` /
  ``gemv_moe_slots`` should take);
- ``router``: ``engine.ops.gemv.gemv`` of one token by the ``[E, H]`` router weight at each tile of
  ``--router-tiles`` and ``torch.nn.functional.linear`` (cuBLAS), batch 1 only.

Each candidate is captured in one CUDA graph as ``--calls`` back-to-back calls (a decode step's layers,
as its graph replays them), each on its own routing with experts disjoint from the other calls' where the
experts allow (so no call finds its weights in L2 from the call before), and timed per replay
(``bench.timing.replay_seconds``, ``--replays`` replays); a call's time is the replay's over ``--calls``.
The bytes a call must read are its distinct experts' weights (``3 I H`` elements each); the rate over the
copy bandwidth is printed per candidate with its maximum absolute error against
``fused_moe_reference`` (``ok`` within ``--atol``), and the best per kind. ``--json`` gets every row,
written again after each token count (a run cut short keeps what it finished).

``--fp8 channel|block``: the experts as FP8 weights (``engine.ops.fused_moe_fp8.quantize_experts``:
per-row scales, or 128 x 128 tiles; the layout ``gemv_moe_tile`` is given), the bytes a call reads
counted at one byte per element and the errors against the dequantizing ``fused_moe_reference``; a
block-scaled down tile with the prefetch (``p``) is reported as an error (``down_prefetches`` refuses
it). The router stays in ``--dtype``.

    python3 -m bench.kernels.fused_moe_gemv_sweep --tokens 1 2 4 8 --json /tmp/sweep.json
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bench.ceilings import copy_bandwidth
from bench.kernels.fused_moe import SHAPES
from bench.timing import replay_seconds
from engine.ops.fused_moe import fused_moe_reference
from engine.ops.fused_moe_fp8 import ExpertScales, quantize_experts
from engine.ops.fused_moe_gemv import (
    down_prefetches,
    fused_moe_gemv,
    gemv_moe_slots,
    gemv_moe_tile,
)
from engine.ops.gemv import gemv

UP_TILES = ["2x1024x4", "4x1024x4", "1x2048x4", "2x2048x8", "4x512x4", "8x512x4", "8x256x4", "16x256x8"]
DOWN_TILES = ["2x1024x4x1", "4x512x4x1", "1x256x4x8", "2x256x4x8", "4x256x4x8", "2x256x8x8", "4x256x8x8",
              "8x256x8x8", "2x128x4x8", "4x128x4x8", "2x256x4x4", "4x256x4x2",
              "2x256x4x8p", "4x256x4x8p", "1x256x4x8p", "2x128x4x8p", "1x1024x4x8p", "2x512x8x8p",
              "1x512x4x8p"]
ROUTER_TILES = ["4x1024x4", "2x1024x4", "1x1024x4", "1x2048x4", "2x2048x8", "8x512x4"]


@dataclass(frozen=True)
class Candidate:
    """The ``fused_moe_gemv`` arguments one sweep row runs with (None: the kernel's default)."""

    up_tile: tuple[int, int, int] | None = None
    down_tile: tuple[int, int, int] | None = None
    down_slots: int | None = None
    down_prefetch: bool | None = None


def candidate(up: str | None = None, down: str | None = None) -> Candidate:
    """The candidate of a gate/up tile text (``BNxBKxW``) and a down tile text (``BNxBKxWxS``, with an
    optional trailing ``p`` for ``down_prefetch``), either left at the defaults when None. Raises
    ValueError for malformed text."""
    up_tile = down_tile = slots = prefetch = None
    if up is not None:
        bn, bk, warps = parse_tile(up, 3)
        up_tile = (bn, bk, warps)
    if down is not None:
        prefetch = down.endswith("p")
        bn, bk, warps, slots = parse_tile(down.removesuffix("p"), 4)
        down_tile = (bn, bk, warps)
    return Candidate(up_tile, down_tile, slots, prefetch)


def parse_tile(text: str, fields: int) -> tuple[int, ...]:
    """``"AxBxC"`` (``fields`` positive integers joined by ``x``) → the tuple. Raises ValueError else."""
    parts = tuple(int(v) for v in text.split("x"))
    if len(parts) != fields or min(parts) < 1:
        raise ValueError(f"a tile here is {fields} positive integers joined by 'x', got {text!r}")
    return parts


def routings(calls: int, tokens: int, experts: int, top_k: int, device: torch.device
             ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``calls`` (weights [T, k] float32 summing to 1 per token, ids [T, k] int64) routings: the experts
    dealt from one random permutation after another, so consecutive calls share none while there are
    enough (each token's k experts distinct)."""
    gen = torch.Generator().manual_seed(tokens)
    pool: list[int] = []
    out = []
    for _ in range(calls):
        rows = []
        for _ in range(tokens):
            if len(pool) < top_k:
                pool = torch.randperm(experts, generator=gen).tolist()  # a row never straddles two
            rows.append(pool[:top_k])
            pool = pool[top_k:]
        w = torch.rand(tokens, top_k, generator=gen)
        out.append(((w / w.sum(-1, keepdim=True)).to(device), torch.tensor(rows, device=device)))
    return out


def per_call_seconds(fn: Callable[[int], object], calls: int, replays: int) -> float:
    """Median seconds of one of ``calls`` back-to-back calls ``fn(0) .. fn(calls - 1)`` in one graph."""
    for i in range(calls):  # compile and warm outside the capture
        fn(i)
    torch.cuda.synchronize()
    spread = replay_seconds(lambda: [fn(i) for i in range(calls)], replays)
    return spread.median / calls


def layout_of(scales: ExpertScales | None) -> str:
    """The ``layout`` argument of ``gemv_moe_tile`` / ``gemv_moe_slots`` for experts with ``scales``:
    ``"none"`` (bf16/fp16 experts), ``"channel"`` (FP8, per-row scales) or ``"block"`` (FP8, block scales)."""
    if scales is None:
        return "none"
    return "channel" if scales.block is None else "block"


def experts_weights(shape: str, dtype: torch.dtype, fp8: str | None, device: torch.device
                    ) -> tuple[torch.Tensor, torch.Tensor, ExpertScales | None]:
    """``(w_gate_up [E, 2I, H], w_down [E, H, I], scales)`` of ``shape``: random weights in ``dtype``
    (scaled by ``fan_in ** -0.5``), quantized to FP8 with per-row (``fp8="channel"``) or 128 x 128 block
    scales (``"block"``; None: no quantization, scales None)."""
    experts, _, hidden, inter = SHAPES[shape]
    gen = torch.Generator(device=device).manual_seed(0)
    w_gate_up = (torch.randn(experts, 2 * inter, hidden, device=device, generator=gen)
                 * hidden ** -0.5).to(dtype)
    w_down = (torch.randn(experts, hidden, inter, device=device, generator=gen) * inter ** -0.5).to(dtype)
    if fp8 is None:
        return w_gate_up, w_down, None
    block = (128, 128) if fp8 == "block" else None
    q_up, s_up = quantize_experts(w_gate_up, block)
    q_down, s_down = quantize_experts(w_down, block)
    return q_up, q_down, ExpertScales(s_up, s_down, block)


def sweep_tokens(args: argparse.Namespace, tokens: int, copy_best: float, w_gate_up: torch.Tensor,
                 w_down: torch.Tensor, device: torch.device, scales: ExpertScales | None = None,
                 dtype: torch.dtype | None = None) -> dict[str, Any]:
    """The ``up``/``down``/``best`` rows of one token count (module docstring); ``scales``: the FP8
    experts' (None: unquantized), ``dtype`` the activations' (None: the weights')."""
    experts, top_k, hidden, inter = SHAPES[args.shape]
    dtype = dtype or w_gate_up.dtype
    layout = layout_of(scales)
    gen = torch.Generator().manual_seed(100 + tokens)
    xs = [torch.randn(tokens, hidden, generator=gen).to(dtype).to(device) for _ in range(args.calls)]
    routes = routings(args.calls, tokens, experts, top_k, device)
    distinct = [int(torch.unique(ids).numel()) for _, ids in routes]
    nbytes = sum(distinct) / len(distinct) * 3 * inter * hidden * w_gate_up.element_size()
    want = fused_moe_reference(xs[0], w_gate_up, w_down, routes[0][0], routes[0][1], scales=scales).float()

    def measure(c: Candidate) -> dict[str, Any]:
        slots = c.down_slots if c.down_slots is not None else gemv_moe_slots(tokens, top_k, inter, layout)
        if c.down_prefetch and not down_prefetches(tokens, top_k, slots, inter, scales, True):
            return dict(error=f"no prefetch with {slots} slots for top-k {top_k} and {layout} scales "
                              "(every slot in one round, unscaled or per-row scaled experts only)")
        def call(i: int) -> torch.Tensor:
            return fused_moe_gemv(xs[i], w_gate_up, w_down, routes[i][0], routes[i][1], up_tile=c.up_tile,
                                  down_tile=c.down_tile, down_slots=c.down_slots,
                                  down_prefetch=c.down_prefetch, scales=scales)
        try:
            err = float((call(0).float() - want).abs().max())
            secs = per_call_seconds(call, args.calls, args.replays)
        except Exception as exc:  # a tile Triton cannot compile (shared memory, registers): reported
            return dict(error=f"{type(exc).__name__}: {exc}"[:300])
        return dict(us=secs * 1e6, over_copy=nbytes / secs / copy_best, max_abs_err=err,
                    ok=err <= args.atol)

    row: dict[str, Any] = dict(tokens=tokens, bytes_per_call=nbytes, up={}, down={})
    default_up = gemv_moe_tile(tokens, False, inter, layout)
    default_down = gemv_moe_tile(tokens, True, inter, layout)
    default_slots = gemv_moe_slots(tokens, top_k, inter, layout)
    prefetch = down_prefetches(tokens, top_k, default_slots, inter, scales, None)
    row["default"] = dict(up="x".join(map(str, default_up)),
                          down="x".join(map(str, (*default_down, default_slots))) + ("p" if prefetch else ""),
                          **measure(candidate()))
    for text in args.up_tiles:
        row["up"][text] = measure(candidate(up=text))
    for text in args.down_tiles:
        row["down"][text] = measure(candidate(down=text))

    def best(rows: dict[str, dict[str, Any]]) -> str | None:
        good = [(r["us"], name) for name, r in rows.items() if r.get("ok")]
        return min(good)[1] if good else None

    best_up, best_down = best(row["up"]), best(row["down"])
    if best_up is not None and best_down is not None:
        row["best"] = dict(up=best_up, down=best_down, **measure(candidate(best_up, best_down)))
    return row


def sweep_router(args: argparse.Namespace, dtype: torch.dtype, device: torch.device) -> dict[str, Any]:
    """Batch-1 router logits: each ``--router-tiles`` tile of ``gemv`` and cuBLAS, µs per call."""
    experts, _, hidden, _ = SHAPES[args.shape]
    gen = torch.Generator().manual_seed(7)
    ws = [(torch.randn(experts, hidden, generator=gen) * hidden ** -0.5).to(dtype).to(device)
          for _ in range(args.calls)]
    xs = [torch.randn(1, hidden, generator=gen).to(dtype).to(device) for _ in range(args.calls)]
    want = torch.nn.functional.linear(xs[0].float(), ws[0].float())
    out: dict[str, Any] = {}
    cublas = per_call_seconds(lambda i: torch.nn.functional.linear(xs[i], ws[i]), args.calls, args.replays)
    out["cublas"] = dict(us=cublas * 1e6)
    for text in args.router_tiles:
        bn, bk, warps = parse_tile(text, 3)

        def call(i: int, bn: int = bn, bk: int = bk, warps: int = warps) -> torch.Tensor:
            return gemv(xs[i], ws[i], block_n=bn, block_k=bk, num_warps=warps)
        try:
            err = float((call(0).float() - want).abs().max())
            secs = per_call_seconds(call, args.calls, args.replays)
        except Exception as exc:  # a tile Triton cannot compile: reported
            out[text] = dict(error=f"{type(exc).__name__}: {exc}"[:300])
            continue
        out[text] = dict(us=secs * 1e6, max_abs_err=err, ok=err <= args.atol)
    return out


def _fmt(name: str, r: dict[str, Any]) -> str:
    if "error" in r:
        return f"  {name:>14}: error {r['error'][:120]}"
    flag = "" if r.get("ok", True) else "  WRONG"
    share = f"  {100 * r['over_copy']:5.1f} % of copy" if "over_copy" in r else ""
    err = f"  err {r['max_abs_err']:.1e}" if "max_abs_err" in r else ""
    return f"  {name:>14}: {r['us']:7.2f} us{share}{err}{flag}"


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The whole sweep; prints the table as it goes and returns the JSON-ready result."""
    device = torch.device("cuda")
    dtype = getattr(torch, args.dtype)
    copy = copy_bandwidth(device)
    result: dict[str, Any] = dict(shape=args.shape, dtype=args.dtype, fp8=args.fp8, calls=args.calls,
                                  copy_bytes_per_s=copy.as_dict(), rows=[])
    print(f"copy bandwidth best {copy.max / 1e12:.2f} TB/s ({args.shape}, {args.dtype}, "
          f"experts {'FP8 ' + args.fp8 if args.fp8 else args.dtype}, {args.calls} calls per graph)",
          flush=True)
    w_gate_up, w_down, scales = experts_weights(args.shape, dtype, args.fp8, device)
    if args.router_tiles:
        result["router"] = sweep_router(args, dtype, device)
        print("router logits, batch 1:")
        for name, r in result["router"].items():
            print(_fmt(name, r))
        _write(args.json, result)
    for tokens in args.tokens:
        row = sweep_tokens(args, tokens, copy.max, w_gate_up, w_down, device, scales, dtype)
        result["rows"].append(row)
        print(f"tokens {tokens} ({row['bytes_per_call'] / 1e6:.1f} MB per call):")
        print(_fmt(f"default {row['default']['up']}/{row['default']['down']}", row["default"]))
        for kind in ("up", "down"):
            for name, r in row[kind].items():
                print(_fmt(f"{kind} {name}", r))
        if "best" in row:
            print(_fmt(f"best {row['best']['up']}/{row['best']['down']}", row["best"]), flush=True)
        _write(args.json, result)
    return result


def _write(path: Path | None, result: dict[str, Any]) -> None:
    if path is not None:
        path.write_text(json.dumps(result, indent=2))


def build_parser() -> argparse.ArgumentParser:
    """The command line (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-30b-a3b")
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--fp8", choices=["channel", "block"], default=None,
                   help="the experts in FP8 with per-row or 128 x 128 block scales")
    p.add_argument("--up-tiles", nargs="*", default=UP_TILES, help="gate/up tiles, BNxBKxW each")
    p.add_argument("--down-tiles", nargs="*", default=DOWN_TILES, help="down tiles, BNxBKxWxSLOTS each")
    p.add_argument("--router-tiles", nargs="*", default=ROUTER_TILES,
                   help="router GEMV tiles, BNxBKxW each (none: skip the router)")
    p.add_argument("--calls", type=int, default=16, help="calls per captured graph")
    p.add_argument("--replays", type=int, default=20)
    p.add_argument("--atol", type=float, default=3e-2, help="max abs error against the reference for ok")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    return p


def main(argv: list[str] | None = None) -> None:
    """Parse arguments and run."""
    args = build_parser().parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("the sweep times CUDA graph replays: it needs a CUDA device")
    if args.calls < 1:
        raise SystemExit(f"--calls must be >= 1, got {args.calls}")
    inter = SHAPES[args.shape][3]
    if args.fp8 == "block" and inter % 128:
        raise SystemExit(f"--fp8 block needs an expert width that is a multiple of 128; {args.shape}'s is "
                         f"{inter}")
    run(args)


if __name__ == "__main__":
    main()
