"""BlockManager's free masks (numpy) and ``first_run``: masks always equal the free sets, contiguous
allocation equals the old Python first-fit scan, the uncached heap stays bounded."""

from __future__ import annotations

import heapq
import random

import numpy as np
import pytest

from engine.block_manager import BlockManager, first_run
from engine.sequence import Sequence
from tests.engine.test_block_manager import BS, _computed, _seq, _with_table


def _brute_first_run(mask: list[bool], n: int) -> int | None:
    return next((i for i in range(len(mask) - n + 1) if all(mask[i : i + n])), None)


def test_first_run_matches_brute_force_and_rejects_bad_lengths() -> None:
    rng = random.Random(7)
    for _ in range(300):
        size = rng.randint(1, 40)
        mask = [rng.random() < rng.choice((0.3, 0.7, 0.95)) for _ in range(size)]
        arr = np.array(mask, dtype=np.bool_)
        before = arr.copy()
        scratch = (np.empty(size, np.bool_), np.empty(size, np.bool_))
        for n in range(1, size + 1):
            assert first_run(arr, n, scratch) == _brute_first_run(mask, n), (mask, n)
        assert (arr == before).all()  # the mask itself is never written
    ones = np.ones(5, np.bool_)
    with pytest.raises(ValueError, match=r"run length must be in \[1, 5\], got 6"):
        first_run(ones, 6, (np.empty(5, np.bool_), np.empty(5, np.bool_)))
    with pytest.raises(ValueError, match="got 0"):
        first_run(ones, 0, (np.empty(5, np.bool_), np.empty(5, np.bool_)))


def _reference_contiguous(bm: BlockManager, n: int) -> int | None:
    """A Python scan from the sets: first fit over the uncached blocks, then over the uncached blocks and
    the k least recently freed cached ones for k = 1, 2, ... (the LRU order of ``_free_cached``)."""
    lru = list(bm._free_cached)
    for k in range(len(lru) + 1):
        allowed = bm._free_uncached | set(lru[:k])
        run = 0
        for block_id in range(bm.num_blocks):
            run = run + 1 if block_id in allowed else 0
            if run == n:
                return block_id - n + 1
    return None


def _check_masks(bm: BlockManager) -> None:
    """Masks == sets == ref counts; every free uncached id has exactly one heap entry."""
    free = {b.block_id for b in bm._blocks if b.ref_count == 0}
    assert set(np.flatnonzero(bm._free_mask).tolist()) == free
    assert set(np.flatnonzero(bm._uncached_mask).tolist()) == bm._free_uncached
    assert bm._free_uncached | set(bm._free_cached) == free
    assert not bm._free_uncached & set(bm._free_cached)
    assert all(bm._blocks[b].block_hash is not None for b in bm._free_cached)
    assert sorted(bm._uncached_heap) == sorted(set(bm._uncached_heap))  # no duplicates
    assert set(np.flatnonzero(bm._in_heap).tolist()) == set(bm._uncached_heap) >= bm._free_uncached


def _random_op(bm: BlockManager, rng: random.Random, live: list[Sequence], prompts: list[list[int]]) -> None:
    op = rng.choice(("allocate", "contiguous", "contiguous", "free", "free", "decode"))
    if op == "allocate":  # a prompt sharing a prefix with earlier ones (prefix hits), then a step
        seq = _seq([*rng.choice(prompts)[: rng.randint(1, 12)], *rng.choices(range(3), k=rng.randint(0, 6))])
        seq.num_computed_tokens = bm.allocate_prefix(seq)
        if not bm.can_allocate(seq, seq.num_tokens - seq.num_computed_tokens):
            bm.free(seq)
            return
        _computed(bm, seq)
        live.append(seq)
    elif op == "contiguous":
        n = rng.randint(1, 6)
        expected = _reference_contiguous(bm, n)
        run = bm.allocate_contiguous(n)
        assert run == (None if expected is None else list(range(expected, expected + n)))
        if run is not None:  # its KV "lands": full blocks get hashed, as on a decode worker
            seq = _seq(rng.choice(prompts)[: n * BS])
            seq.block_table = run
            seq.num_computed_tokens = min(seq.num_tokens, n * BS)
            bm.cache_full_blocks(seq)
            live.append(seq)
    elif op == "free" and live:
        bm.free(live.pop(rng.randrange(len(live))))
    elif op == "decode" and live:
        seq = rng.choice(live)
        seq.append_token(rng.randrange(3))
        if bm.can_allocate(seq, seq.num_tokens - seq.num_computed_tokens):
            _computed(bm, seq)


@pytest.mark.parametrize(("seed", "caching"), [(0, True), (1, True), (2, True), (3, False)])
def test_masks_track_sets_and_contiguous_matches_python_scan(seed: int, caching: bool) -> None:
    rng = random.Random(seed)
    bm = BlockManager(num_blocks=24, block_size=BS, enable_prefix_caching=caching)
    prompts = [[rng.randrange(3) for _ in range(6 * BS)] for _ in range(3)]
    live: list[Sequence] = []
    for _ in range(400):
        _random_op(bm, rng, live, prompts)
        _check_masks(bm)
    for seq in live:
        bm.free(seq)
    _check_masks(bm)
    assert bm._free_mask.all()
    bm.check_no_leaks()


def test_uncached_heap_stays_bounded_under_contiguous_churn() -> None:
    """Bug: every free of a block taken by allocate_contiguous pushed another heap entry (the old one was
    never popped), so the heap grew without bound (128 256 entries for 256 blocks after 2000 requests)."""
    bm = BlockManager(num_blocks=32, block_size=BS)
    for _ in range(200):
        run = bm.allocate_contiguous(8)
        assert run == list(range(8))
        seq = _with_table(0)
        seq.block_table = run
        bm.free(seq)
    assert len(bm._uncached_heap) <= bm.num_blocks
    s = _seq(list(range(3 * BS)))
    bm.allocate(s, 3 * BS)
    assert s.block_table == [0, 1, 2]  # still lowest id first
    bm.free(s)
    assert len(bm._uncached_heap) <= bm.num_blocks
    assert heapq.nsmallest(1, bm._uncached_heap) == [0]
    bm.check_no_leaks()
