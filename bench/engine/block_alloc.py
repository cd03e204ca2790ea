"""Cost of ``BlockManager.allocate_contiguous`` (the decode worker pays it once per arriving request).

Builds a block manager of ``--num-blocks`` blocks (default 34 000: an H200 decode worker's upper end) in
several fill levels / fragmentations of its blocks (in use, free-cached by the prefix cache,
free-uncached), then times ``allocate_contiguous(n)`` for each ``n`` of ``--sizes`` (blocks per request)
and prints µs per call (median, min–max over ``--reps`` calls after 3 untimed ones). After each call
the state is restored (the run freed, evicted blocks re-cached), so every call sees the same state. Runs
against whichever ``engine`` is importable, so before/after figures come from running it in two
checkouts' roots (always as a module: run by path, ``bench/engine/`` would shadow the ``engine`` package).

    .venv/bin/python -m bench.engine.block_alloc [--num-blocks 34000] [--sizes 4,64] [--reps 30]

Scenarios (``U`` in use, ``C`` free-cached, ``F`` free-uncached; ``n`` the run asked for):

- ``empty``: all ``F``: a run at block 0.
- ``half-used``: the lower half ``U``, the upper half ``F``: a run at the middle.
- ``frag90-tail``: 90 % ``U`` with single ``F`` holes, the last ``2n`` blocks ``F``: a run at the end.
- ``evict``: ``U`` and ``C`` blocks with single ``F`` holes (no uncached run of ``n``), a run of ``n``
  free blocks only in the last quarter: the cached blocks there are evicted.
- ``none``: 90 % ``U``, holes of ``C``/``F`` shorter than ``n``: no run, returns None.
"""

from __future__ import annotations

import argparse
import gc
import time
from collections.abc import Callable

from bench.timing import Spread
from engine.block_manager import BlockManager
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence

BLOCK_SIZE = 16
WARMUP = 3  # untimed calls per scenario
Kind = str  # "U" in use, "C" free-cached, "F" free-uncached
Pattern = Callable[[int, int, int], Kind]  # (block id, num_blocks, n) -> kind


def _empty(i: int, num_blocks: int, n: int) -> Kind:
    return "F"


def _half_used(i: int, num_blocks: int, n: int) -> Kind:
    return "U" if i < num_blocks // 2 else "F"


def _frag90_tail(i: int, num_blocks: int, n: int) -> Kind:
    if i >= num_blocks - 2 * n:
        return "F"
    return "F" if i % 10 == 9 else "U"


def _evict(i: int, num_blocks: int, n: int) -> Kind:
    if i % 4 == 3:
        return "F"
    if i >= num_blocks * 3 // 4:
        return "C"  # runs of C C C F ...: free runs of any length, uncached runs of 1
    return "C" if i % 4 == 1 else "U"


def _none(i: int, num_blocks: int, n: int) -> Kind:
    hole = max(1, min(n - 1, 3))  # free holes shorter than n (n >= 2)
    pos = i % 10
    if pos >= hole:
        return "U"
    return "C" if pos % 2 else "F"


SCENARIOS: dict[str, Pattern] = {
    "empty": _empty, "half-used": _half_used, "frag90-tail": _frag90_tail, "evict": _evict, "none": _none,
}


def _seq(block_id: int) -> Sequence:
    """A one-block sequence whose tokens (``block_size`` copies of its block id) are unique per block."""
    return Sequence(f"b{block_id}", [block_id] * BLOCK_SIZE, SamplingParams(), arrival_time=0.0)


def _cache_and_free(bm: BlockManager, seq: Sequence) -> None:
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_full_blocks(seq)
    bm.free(seq)


def build(num_blocks: int, n: int, pattern: Pattern) -> tuple[BlockManager, list[Kind]]:
    """A block manager with block ``i`` in state ``pattern(i, num_blocks, n)`` and the list of kinds."""
    bm = BlockManager(num_blocks, BLOCK_SIZE)
    kinds = [pattern(i, num_blocks, n) for i in range(num_blocks)]
    seqs = [_seq(i) for i in range(num_blocks)]
    for i, seq in enumerate(seqs):
        bm.allocate(seq, BLOCK_SIZE)
        assert seq.block_table == [i], "a fresh block manager hands out the lowest id first"
    for seq, kind in zip(seqs, kinds, strict=True):
        if kind == "C":
            _cache_and_free(bm, seq)
        elif kind == "F":
            bm.free(seq)
    assert bm.num_free_blocks == sum(k != "U" for k in kinds)
    return bm, kinds


def _restore(bm: BlockManager, run: list[int], kinds: list[Kind]) -> None:
    for block_id in run:
        seq = _seq(block_id)
        seq.block_table = [block_id]
        if kinds[block_id] == "C":
            _cache_and_free(bm, seq)
        else:
            bm.free(seq)


def time_calls(num_blocks: int, n: int, pattern: Pattern, reps: int) -> tuple[Spread, int | None]:
    """µs per ``allocate_contiguous(n)`` call on the pattern's state over ``reps`` calls (the first
    ``WARMUP`` calls not counted; garbage collection off while timing), and the run's start block (None:
    no run)."""
    bm, kinds = build(num_blocks, n, pattern)
    times: list[int] = []
    start: int | None = None
    gc.collect()
    gc.disable()  # a collection of build()'s garbage inside a timed call would swamp it
    try:
        for _ in range(WARMUP + reps):
            t0 = time.perf_counter_ns()
            run = bm.allocate_contiguous(n)
            times.append(time.perf_counter_ns() - t0)
            if run is not None:
                start = run[0]
                _restore(bm, run, kinds)
    finally:
        gc.enable()
    assert bm.num_free_blocks == sum(k != "U" for k in kinds), "restore lost blocks"
    return Spread.of(times[WARMUP:]).scaled(1e-3), start


def main() -> None:
    """Print a markdown table: scenario, n, run start (or None), median µs per call."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-blocks", type=int, default=34_000)
    p.add_argument("--sizes", default="4,64", help="comma-separated run lengths (blocks), each >= 2")
    p.add_argument("--reps", type=int, default=30)
    args = p.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    if args.num_blocks < 8 * max(sizes) or min(sizes) < 2 or args.reps < 1:
        raise SystemExit("need sizes >= 2, num_blocks >= 8 * max(sizes), reps >= 1")
    print(f"# allocate_contiguous, {args.num_blocks} blocks, {args.reps} calls each")
    print("| scenario | n | run start | µs/call: median (min–max) |\n|---|---|---|---|")
    for name, pattern in SCENARIOS.items():
        for n in sizes:
            us, start = time_calls(args.num_blocks, n, pattern, args.reps)
            print(f"| {name} | {n} | {start} | {us.fmt('.1f')} |")


if __name__ == "__main__":
    main()
