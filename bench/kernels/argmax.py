"""The greedy token's argmax (``engine.ops.argmax.argmax_rows_kernel``, two Triton passes) against
``torch.argmax(logits, dim=-1)``, on one GPU (not a test).

Every greedy decode step ends with the argmax of its ``[B, V]`` logits. For each ``--batches`` size and
``--vocab`` width (bf16 logits drawn from a normal distribution) both are captured ``--calls`` times in
one CUDA graph, as the step's sampling follows its forward; each figure is the median over
``--replays`` replays (microseconds per call, with the min–max), the outputs are checked equal, and the
line gives torch / kernel. The read bandwidth (``B x V x 2`` bytes per call) is printed beside it.
Programmatic dependent launch is off while timing (``engine.ops.pdl.set_pdl(False)``): back to back, a
one-row call would launch early behind the one before, which the engine's argmax, after a graph replay,
does not.

    python3 -m bench.kernels.argmax --batches 1 8 32 256 --vocab 128256 151936
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

from bench.timing import Spread, replay_seconds
from engine.ops.argmax import argmax_rows_kernel
from engine.ops.pdl import set_pdl


def call_seconds(fn: Callable[[torch.Tensor], torch.Tensor], logits: torch.Tensor, calls: int,
                 replays: int) -> Spread:
    """Seconds per ``fn(logits)`` over ``replays`` replays of ``calls`` captured calls."""
    def work() -> None:
        for _ in range(calls):
            fn(logits)
    work()  # compile outside the capture
    torch.cuda.synchronize()
    return replay_seconds(work, replays).scaled(1 / calls)


def main(argv: list[str] | None = None) -> None:
    """One line per (batch, vocab): both timings, their ratio, the kernel's read bandwidth, equality."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 256])
    p.add_argument("--vocab", type=int, nargs="+", default=[128256, 151936])
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--replays", type=int, default=10)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA device (the CPU suite tests the kernels through the interpreter)")
    if min(args.batches) < 1 or min(args.vocab) < 1:
        p.error("--batches and --vocab must be >= 1")
    print(f"# {torch.cuda.get_device_name()}; bf16 logits; medians of {args.replays} replays of "
          f"{args.calls} captured calls", flush=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    set_pdl(False)
    for vocab in args.vocab:
        for batch in args.batches:
            logits = torch.randn(batch, vocab, device="cuda", generator=gen).to(torch.bfloat16)
            ours = call_seconds(argmax_rows_kernel, logits, args.calls, args.replays).scaled(1e6)
            ref = call_seconds(lambda x: x.argmax(dim=-1), logits, args.calls, args.replays).scaled(1e6)
            equal = torch.equal(argmax_rows_kernel(logits), logits.argmax(dim=-1))
            gbs = batch * vocab * 2 / (ours.median * 1e-6) / 1e9
            print(f"B {batch:4d} V {vocab:6d}: kernel {ours.fmt('.2f', ' us')} ({gbs:.0f} GB/s read); "
                  f"torch.argmax {ref.fmt('.2f', ' us')}; torch / kernel {ref.median / ours.median:.2f}x; "
                  f"equal {equal}", flush=True)


if __name__ == "__main__":
    main()
