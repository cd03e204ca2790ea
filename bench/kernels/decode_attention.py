"""Paged decode attention at small batch on one GPU: tile size, splits and warps (not a test).

At batch 1 a decode step's attention reads 4 MiB of KV per layer at a 1k-token context (Llama-3-8B: 8 KV
heads × 128 × bf16 K and V), a microsecond at the copy bandwidth, so the split (Flash-Decoding) and merge
launches are bound by latency, not bytes. For each (context, tile of KV tokens, split count, warps) this
times ``engine.ops.paged_decode.paged_decode_attention`` as a decode step runs it: 32 calls, one per
layer cache (so the L2 cache never holds the KV being read), captured in one CUDA graph with programmatic
dependent launch between them (engine/ops/pdl.py), and prints µs per call (median and min–max of 10
graph replays) against the KV-read floor (bytes / device copy bandwidth, the best of 20 copies in the
same process) and the output's largest difference from the plain-torch reference.

    python3 -m bench.kernels.decode_attention --contexts 1024 4096 --block-n 16 32 64 --warps 2 4
"""

from __future__ import annotations

import argparse

import torch

from bench.ceilings import copy_bandwidth
from bench.timing import Spread, replay_seconds
from engine.ops.paged_decode import (
    choose_num_splits,
    paged_decode_attention,
    paged_decode_attention_reference,
)

LAYERS, HEADS, KV_HEADS, DIM, BLOCK_SIZE = 32, 32, 8, 128, 16


def _caches(context: int, batch: int) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
    """One (K, V) cache per layer for ``batch`` sequences of ``context`` tokens, and their block tables."""
    blocks = -(-context // BLOCK_SIZE)
    shape = (batch * blocks, BLOCK_SIZE, KV_HEADS, DIM)
    ks = [torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(LAYERS)]
    vs = [torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(LAYERS)]
    perm = torch.randperm(batch * blocks, device="cuda").to(torch.int32)  # scattered blocks
    return ks, vs, perm.view(batch, blocks)


def seconds(context: int, batch: int, block_n: int, splits: int, warps: int) -> tuple[Spread, float]:
    """(seconds per call over 10 graph replays, largest |out - reference|) for one configuration."""
    ks, vs, tables = _caches(context, batch)
    q = torch.randn(batch, HEADS, DIM, device="cuda", dtype=torch.bfloat16)
    lens = torch.full((batch,), context, device="cuda", dtype=torch.int32)
    outs = [torch.empty_like(q) for _ in range(LAYERS)]

    def step() -> None:
        for i in range(LAYERS):
            paged_decode_attention(q, ks[i], vs[i], tables, lens, context, DIM ** -0.5, out=outs[i],
                                   num_splits=splits, block_n=block_n, num_warps=warps)
    step()  # compile
    ref = paged_decode_attention_reference(q, ks[0], vs[0], tables, lens, context, DIM ** -0.5)
    err = (outs[0].float() - ref.float()).abs().max().item()
    return replay_seconds(step, 10).scaled(1 / LAYERS), err


def main(argv: list[str] | None = None) -> None:
    """Print one markdown row per configuration."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--block-n", type=int, nargs="+", default=[16, 32, 64])
    p.add_argument("--warps", type=int, nargs="+", default=[2, 4])
    p.add_argument("--graph-len", type=int, default=8192,
                   help="max_model_len the decode graphs pin (the engine's split heuristic uses it)")
    args = p.parse_args(argv)
    bandwidth = copy_bandwidth(torch.device("cuda")).max
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"# {torch.cuda.get_device_name()}, copy bandwidth {bandwidth / 1e12:.2f} TB/s, batch {args.batch}")
    print("| context | tile | splits | warps | µs per layer | KV floor µs | of floor | max err |")
    print("|---|---|---|---|---|---|---|---|")
    for context in args.contexts:
        floor = args.batch * context * KV_HEADS * DIM * 2 * 2 / bandwidth  # KV bytes / copy bandwidth
        engine_bn = 32 if args.batch == 1 else 64  # paged_decode_attention's default tile
        engine_splits = choose_num_splits(args.batch, KV_HEADS, args.graph_len, engine_bn, sms)
        configs = [(engine_bn, engine_splits, 4, "engine default")]
        for bn in args.block_n:
            tiles = -(-context // bn)
            for splits in sorted({min(tiles, 64), min(-(-tiles // 2), 64), min(-(-tiles // 4), 64)}):
                configs += [(bn, splits, w, "") for w in args.warps]
        for bn, splits, warps, note in configs:
            sec, err = seconds(context, args.batch, bn, splits, warps)
            print(f"| {context} | {bn} | {splits} | {warps} | {sec.scaled(1e6).fmt('.2f')} | "
                  f"{floor * 1e6:.2f} | {floor / sec.median:.1%} | {err:.2g} {note} |", flush=True)


if __name__ == "__main__":
    main()
