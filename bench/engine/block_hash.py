"""Cost of the prefix-cache block hash (engine/block_hash.py) against Python's built-in ``hash`` of the
same block, the hash the block manager used before (its value differs between processes, so no gateway
could share it).

Times hashing ``--blocks`` consecutive blocks of ``--block-size`` token ids one by one (each chained on
the previous), with ``block_hash`` and with ``hash((parent, tuple(tokens)))``, the two interleaved
(``bench.timing.interleaved``) after warm-up, and also ``block_hashes`` over the whole prompt at once (the
path of the gateway and of the workers' ``Sequence.full_block_hashes``). Prints µs per block (median,
min–max over ``--repeats``) and each one's ratio to the built-in hash.

    .venv/bin/python -m bench.engine.block_hash [--block-size 16] [--blocks 256] [--repeats 30]
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable

from bench.timing import Spread, interleaved, paired_ratio
from engine.block_hash import ROOT_HASH, block_hash, block_hashes


def _timed(fn: Callable[[], object]) -> Callable[[], float]:
    def run() -> float:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start
    return run


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--blocks", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args(argv)
    bs, n = args.block_size, args.blocks
    rng = random.Random(0)
    tokens = [rng.randrange(128_000) for _ in range(bs * n)]
    blocks = [tokens[i * bs : (i + 1) * bs] for i in range(n)]

    def stable() -> None:
        parent = ROOT_HASH
        for block in blocks:
            parent = block_hash(parent, tuple(block))

    def builtin() -> None:
        parent: int | None = None
        for block in blocks:
            parent = hash((parent, tuple(block)))

    def whole() -> None:
        block_hashes(tokens, bs)

    new, old = interleaved(_timed(stable), _timed(builtin), warmup=3, repeats=args.repeats)
    at_once, old2 = interleaved(_timed(whole), _timed(builtin), warmup=3, repeats=args.repeats)
    per_block = 1e6 / n
    print(f"{n} blocks of {bs} tokens, µs per block (median (min–max, n)):")
    print(f"  built-in hash((parent, tuple))  {Spread.of(old).scaled(per_block).fmt('.3f')}")
    print(f"  block_hash, block by block      {Spread.of(new).scaled(per_block).fmt('.3f')}"
          f"   ratio to built-in {paired_ratio(new, old).fmt('.2f')}")
    print(f"  block_hashes, whole prompt      {Spread.of(at_once).scaled(per_block).fmt('.3f')}"
          f"   ratio to built-in {paired_ratio(at_once, old2).fmt('.2f')}")


if __name__ == "__main__":
    main()
