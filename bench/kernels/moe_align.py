"""``moe_align`` (grouping a step's routed pairs by expert) as one Triton program against its torch
reference, on one GPU (not a test).

Every sparse layer of a grouped-GEMM MoE step first groups its ``tokens x top_k`` (token, slot) pairs by
expert (``engine.ops.moe_align.moe_align``). The torch reference does it with a stable argsort, counts,
cumulative sums, a scatter and a search: about twenty small kernels. Up to
``MAX_KERNEL_ALIGN_PAIRS`` pairs the engine runs one Triton program instead. For each ``--tokens`` count
(``--experts`` experts, top ``--top-k``, distinct experts per token drawn uniformly) both are captured
``--calls`` times in one CUDA graph, as in a decode step; each figure is the median over ``--replays``
replays (microseconds per call, with the min–max), and the outputs are checked equal.

    python3 -m bench.kernels.moe_align --tokens 1 4 16 32 64 128 256
"""

from __future__ import annotations

import argparse

import torch

from bench.timing import Spread, replay_seconds
from engine.ops.moe_align import MAX_KERNEL_ALIGN_PAIRS, MoEAlignment, moe_align, moe_align_reference


def align_seconds(fn: object, ids: torch.Tensor, experts: int, block_m: int, calls: int,
                  replays: int) -> Spread:
    """Seconds per ``fn(ids, experts, block_m)`` over ``replays`` replays of ``calls`` captured calls."""
    def work() -> None:
        for _ in range(calls):
            fn(ids, experts, block_m)  # type: ignore[operator]
    work()  # compile outside the capture
    torch.cuda.synchronize()
    return replay_seconds(work, replays).scaled(1 / calls)


def same(a: MoEAlignment, b: MoEAlignment) -> bool:
    """Whether two alignments are identical."""
    return torch.equal(a.sorted_ids, b.sorted_ids) and torch.equal(a.block_expert, b.block_expert)


def main(argv: list[str] | None = None) -> None:
    """Print one line per token count: the program, the reference, their ratio and equality."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 16, 32, 64, 128])
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--block-m", type=int, default=16)
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--replays", type=int, default=10)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA device (the CPU suite tests moe_align through the interpreter)")
    if args.top_k > args.experts or min(args.tokens) < 1:
        p.error("--top-k must be <= --experts and every --tokens >= 1")
    gen = torch.Generator().manual_seed(0)
    for tokens in args.tokens:
        ids = torch.stack([torch.randperm(args.experts, generator=gen)[:args.top_k]
                           for _ in range(tokens)]).cuda()
        pairs = ids.numel()
        ours = align_seconds(moe_align, ids, args.experts, args.block_m, args.calls, args.replays).scaled(1e6)
        ref = align_seconds(moe_align_reference, ids, args.experts, args.block_m, args.calls,
                            args.replays).scaled(1e6)
        path = "Triton program" if pairs <= MAX_KERNEL_ALIGN_PAIRS else "torch (past the program's size)"
        equal = same(moe_align(ids, args.experts, args.block_m),
                     moe_align_reference(ids, args.experts, args.block_m))
        print(f"pairs {pairs:5d}: moe_align ({path}) {ours.fmt('.1f', ' us')}; reference "
              f"{ref.fmt('.1f', ' us')}; reference / moe_align {ref.median / ours.median:.2f}x; "
              f"equal {equal}", flush=True)


if __name__ == "__main__":
    main()
