"""BlockManager: allocation, ref counts, prefix hits, LRU eviction, contiguous runs, leak checks, and
the numpy free masks behind allocate_contiguous (kept in step with the free sets; random-op property
test against the former Python scan)."""

from __future__ import annotations

import pytest

from engine.block_hash import ROOT_HASH, block_hash
from engine.block_manager import BlockManager, NoFreeBlocksError
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence

BS = 4


def _seq(tokens: list[int], rid: str = "r") -> Sequence:
    return Sequence(rid, tokens, SamplingParams(), arrival_time=0.0)


def _computed(bm: BlockManager, seq: Sequence) -> None:
    """Allocate and mark all of seq's tokens computed, then cache its full blocks (as a step would)."""
    bm.allocate(seq, seq.num_tokens - seq.num_computed_tokens)
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_full_blocks(seq)


def test_allocate_grows_block_table_and_free_returns_blocks() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    seq = _seq(list(range(10)))
    assert bm.num_blocks_needed(seq, 10) == 3
    bm.allocate(seq, 10)
    assert seq.block_table == [0, 1, 2]
    assert bm.num_free_blocks == 5
    seq.num_computed_tokens = 10
    bm.allocate(seq, 2)  # 12 tokens still fit in 3 blocks
    assert seq.block_table == [0, 1, 2]
    bm.allocate(seq, 3)  # 13..15 → a 4th block
    assert seq.block_table == [0, 1, 2, 3]
    bm.free(seq)
    assert seq.block_table == []
    assert bm.num_free_blocks == 8
    bm.check_no_leaks()


def test_allocate_too_many_raises_and_changes_nothing() -> None:
    bm = BlockManager(num_blocks=2, block_size=BS)
    seq = _seq(list(range(9)))
    assert not bm.can_allocate(seq, 9)
    with pytest.raises(NoFreeBlocksError, match="needs 3 more blocks, 2 free"):
        bm.allocate(seq, 9)
    assert seq.block_table == [] and bm.num_free_blocks == 2
    assert issubclass(NoFreeBlocksError, RuntimeError)
    bm.check_no_leaks()


def test_prefix_hit_shares_full_blocks_and_refcounts() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = _seq(list(range(10)), "a")
    _computed(bm, a)  # blocks 0,1 full (hashed); block 2 partial
    b = _seq([*range(8), 99, 98, 97], "b")
    assert bm.allocate_prefix(b) == 8
    assert b.block_table == a.block_table[:2]
    b.num_computed_tokens = 8
    bm.allocate(b, 3)
    assert b.block_table[2] not in a.block_table
    bm.free(a)
    # blocks 0,1 still referenced by b
    with pytest.raises(AssertionError, match="still referenced"):
        bm.check_no_leaks()
    bm.free(b)
    bm.check_no_leaks()


def test_prefix_hit_never_covers_last_token() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = _seq(list(range(8)), "a")
    _computed(bm, a)
    bm.free(a)
    b = _seq(list(range(8)), "b")  # identical 8-token prompt = exactly 2 full blocks
    assert bm.allocate_prefix(b) == 4  # only the first block: the last token must be computed
    bm.free(b)
    bm.check_no_leaks()


def test_prefix_hit_needs_whole_chain_not_just_block_content() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = _seq([1, 2, 3, 4, 5, 6, 7, 8, 0], "a")
    _computed(bm, a)
    bm.free(a)
    b = _seq([9, 9, 9, 9, 5, 6, 7, 8, 0], "b")  # second block equal, first differs → no hit at all
    assert bm.allocate_prefix(b) == 0
    assert b.block_table == []
    bm.check_no_leaks()


def test_cached_free_blocks_hit_after_free_then_evicted_lru() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS)
    a = _seq([1] * 5, "a")
    _computed(bm, a)  # block 0 hashed, block 1 partial
    b = _seq([2] * 5, "b")
    _computed(bm, b)  # block 2 hashed, block 3 partial
    bm.free(a)  # block 0 cached-free (older)
    bm.free(b)  # block 2 cached-free (newer)
    assert bm.num_free_blocks == 4
    c = _seq([3] * 12, "c")
    bm.allocate(c, 12)  # 3 blocks: uncached 1, 3 first, then evicts LRU cached block 0
    assert sorted(c.block_table) == [0, 1, 3]
    assert bm.allocate_prefix(_seq([1] * 5, "a2")) == 0  # a's prefix was evicted
    hit = _seq([2] * 5, "b2")
    assert bm.allocate_prefix(hit) == 4 and hit.block_table == [2]  # b's survived
    bm.free(hit)
    bm.free(c)
    bm.check_no_leaks()


def test_prefix_caching_disabled_never_hits() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS, enable_prefix_caching=False)
    a = _seq([1] * 9, "a")
    _computed(bm, a)
    bm.free(a)
    assert bm.allocate_prefix(_seq([1] * 9, "b")) == 0
    bm.check_no_leaks()


def test_duplicate_content_keeps_one_canonical_block() -> None:
    bm = BlockManager(num_blocks=6, block_size=BS)
    a, b = _seq([7] * 5, "a"), _seq([7] * 5, "b")
    _computed(bm, a)
    _computed(bm, b)  # same full block computed twice concurrently
    first_a, first_b = a.block_table[0], b.block_table[0]
    assert first_a != first_b
    bm.free(b)  # b's copy is not the canonical one: it goes back uncached
    bm.free(a)
    c = _seq([7] * 5, "c")
    assert bm.allocate_prefix(c) == 4 and c.block_table == [first_a]
    bm.free(c)
    bm.check_no_leaks()


def test_allocate_contiguous_finds_runs_and_prefers_uncached() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    holes = [_seq([i] * 4, f"h{i}") for i in range(8)]
    for s in holes:
        bm.allocate(s, 4)
    for i in (1, 2, 4, 5, 6):
        bm.free(holes[i])
    assert bm.allocate_contiguous(4) is None  # free: 1,2 and 4,5,6 — no run of 4
    run = bm.allocate_contiguous(3)
    assert run == [4, 5, 6]
    assert bm.allocate_contiguous(2) == [1, 2]
    for i in (0, 3, 7):
        bm.free(holes[i])
    for block_id in [*run, 1, 2]:
        bm.free(_with_table(block_id))
    bm.check_no_leaks()


def test_allocate_contiguous_evicts_cached_blocks_when_needed() -> None:
    bm = BlockManager(num_blocks=3, block_size=BS)
    a = _seq([5] * 9, "a")
    _computed(bm, a)
    bm.free(a)  # blocks 0,1 cached-free, 2 uncached
    run = bm.allocate_contiguous(3)
    assert run == [0, 1, 2]
    assert bm.allocate_prefix(_seq([5] * 9, "b")) == 0  # the hashes were evicted
    for block_id in run:
        bm.free(_with_table(block_id))
    bm.check_no_leaks()


def test_allocate_contiguous_evicts_the_least_recently_freed_run() -> None:
    """A decode worker's cache full of cached prefixes: the new request's run evicts an old session's
    blocks, not the live session's freed a moment ago. Bug: the run was the lowest-starting one of free
    blocks, whatever their age, so the live session (lower block ids) lost its prefix and its next turn's
    whole prompt KV was sent again (an H200 agent run: 6.8x the new tokens' KV at one turn)."""
    bm = BlockManager(num_blocks=8, block_size=BS)
    live = _seq([1] * 16, "live")
    old = _seq([2] * 16, "old")
    bm.allocate(live, 16)  # blocks 0-3
    bm.allocate(old, 16)  # blocks 4-7
    for seq in (live, old):
        seq.num_computed_tokens = 16
        bm.cache_full_blocks(seq)
    bm.free(old)  # the old session's turn ended first ...
    bm.free(live)  # ... the live one's just now
    run = bm.allocate_contiguous(3)
    # the old session's blocks, freed tail first (7 oldest): 5-7 (the live one's 0-2 before the fix)
    assert run == [5, 6, 7]
    next_turn = _seq([1] * 17, "next turn")
    assert bm.allocate_prefix(next_turn) == 16  # the live prefix still hits, whole
    bm.free(next_turn)
    for block_id in run:
        bm.free(_with_table(block_id))
    bm.check_no_leaks()


def test_allocate_contiguous_evicts_newer_blocks_only_when_no_older_run_exists() -> None:
    """The old blocks are scattered (no run of 3 among them): the run takes the fewest-recent blocks it
    must, the lowest-starting run whose newest block is oldest."""
    bm = BlockManager(num_blocks=6, block_size=BS)
    seqs = [_seq([i] * 4, f"s{i}") for i in range(6)]
    for seq in seqs:
        bm.allocate(seq, 4)
        seq.num_computed_tokens = 4
        bm.cache_full_blocks(seq)
    for i in (0, 3, 1, 4, 5, 2):  # free order: oldest first
        bm.free(seqs[i])
    # runs of 3, newest freed: [0,1,2] block 2 (6th); [1,2,3], [2,3,4] block 2; [3,4,5] block 5 (5th)
    assert bm.allocate_contiguous(3) == [3, 4, 5]
    assert bm.allocate_contiguous(3) == [0, 1, 2]
    for block_id in range(6):
        bm.free(_with_table(block_id))
    bm.check_no_leaks()


def test_allocate_contiguous_bad_sizes() -> None:
    bm = BlockManager(num_blocks=3, block_size=BS)
    with pytest.raises(NoFreeBlocksError, match="only 3 exist"):
        bm.allocate_contiguous(4)
    with pytest.raises(ValueError, match="num_blocks >= 1"):
        bm.allocate_contiguous(0)
    bm.check_no_leaks()


def test_double_free_detected() -> None:
    bm = BlockManager(num_blocks=2, block_size=BS)
    s = _seq([1, 2], "s")
    bm.allocate(s, 2)
    table = list(s.block_table)
    bm.free(s)
    s.block_table = table
    with pytest.raises(AssertionError, match="double free"):
        bm.free(s)
    bm.check_no_leaks()


def test_allocate_prefix_rejects_used_sequence_and_bad_config() -> None:
    bm = BlockManager(num_blocks=2, block_size=BS)
    s = _seq([1, 2, 3, 4, 5], "s")
    bm.allocate(s, 5)
    with pytest.raises(ValueError, match="fresh sequence"):
        bm.allocate_prefix(s)
    bm.free(s)
    with pytest.raises(ValueError, match="must be >= 1"):
        BlockManager(num_blocks=0, block_size=BS)
    bm.check_no_leaks()


def _with_table(block_id: int) -> Sequence:
    s = _seq([0], f"b{block_id}")
    s.block_table = [block_id]
    return s


def _chain(tokens: list[int], num_blocks: int) -> int:
    parent = ROOT_HASH
    for i in range(num_blocks):
        parent = block_hash(parent, tokens[i * BS : (i + 1) * BS])
    return parent


def test_incremental_block_hashing_matches_full_chain_and_restarts_after_free() -> None:
    """cache_full_blocks hashes each block once (``Sequence.hashed_blocks``) and gives the same chain as
    hashing from block 0; a freed or replaced table restarts from block 0."""
    bm = BlockManager(num_blocks=16, block_size=BS)
    seq = _seq(list(range(5)))
    _computed(bm, seq)
    assert seq.hashed_blocks == (1, _chain(seq.token_ids, 1))
    for t in range(100, 109):  # decode steps, one token each
        seq.append_token(t)
        bm.allocate(seq, 1)
        seq.num_computed_tokens += 1
        bm.cache_full_blocks(seq)
    assert seq.num_computed_tokens == 14
    assert seq.hashed_blocks == (3, _chain(seq.token_ids, 3))
    tokens = list(seq.token_ids)
    bm.free(seq)
    assert seq.hashed_blocks == (0, ROOT_HASH)
    again = _seq([*tokens, 7], rid="again")
    assert bm.allocate_prefix(again) == 12  # the whole chain of 3 full blocks hits
    bm.free(again)
    # a state left from a table since replaced (not matching it) restarts at block 0 when a block fills
    other = _seq([50 + i for i in range(9)], rid="other")
    bm.allocate(other, 9)
    other.num_computed_tokens = 9
    other.hashed_blocks = (1, 12345)
    bm.cache_full_blocks(other)
    assert other.hashed_blocks == (2, _chain(other.token_ids, 2))
    bm.free(other)
    probe = _seq([50 + i for i in range(9)], rid="probe")
    assert bm.allocate_prefix(probe) == 8
    bm.free(probe)
    bm.check_no_leaks()
