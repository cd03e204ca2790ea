"""The stable block hash (same value in another interpreter, same chain as the block manager's) and the
prefix-cache event log the block manager keeps (stored on registration, removed on eviction, net change
per drain, bounded)."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest

from engine.block_hash import ROOT_HASH, block_hash, block_hashes
from engine.block_manager import BlockManager
from engine.kv_events import KVEventLog
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence

ROOT = Path(__file__).resolve().parents[2]
BS = 4


def _seq(tokens: list[int], rid: str = "r") -> Sequence:
    return Sequence(rid, tokens, SamplingParams(), arrival_time=0.0)


def _computed(bm: BlockManager, seq: Sequence) -> None:
    bm.allocate(seq, seq.num_tokens - seq.num_computed_tokens)
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_full_blocks(seq)


def test_block_hash_is_the_same_in_another_interpreter() -> None:
    """Another process (another hash seed) computes the same chain: the built-in hash of a tuple holding
    None would not (id-based in Python 3.11)."""
    tokens = list(range(7, 7 + 3 * BS + 1))
    code = ("import sys; from engine.block_hash import block_hashes; "
            f"print(block_hashes({tokens!r}, {BS}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                         env={"PYTHONPATH": str(ROOT), "PYTHONHASHSEED": "12345"})
    assert out.returncode == 0, out.stderr
    here = block_hashes(tokens, BS)
    assert out.stdout.strip() == repr(here)
    assert len(here) == 3 and len(set(here)) == 3
    assert all(0 <= h < 2**64 for h in here)


def test_block_hashes_chain_block_hash_and_depend_on_the_whole_prefix() -> None:
    tokens = [5, 6, 7, 8, 9, 10, 11, 12, 13]
    chain = block_hashes(tokens, BS)
    first = block_hash(ROOT_HASH, tokens[:4])
    assert chain == [first, block_hash(first, tokens[4:8])]
    other = block_hashes([99, 6, 7, 8, 9, 10, 11, 12], BS)
    assert other[1] != chain[1]  # same second block, different first: different hash
    assert block_hashes(tokens[:3], BS) == []
    # a pinned value: the hash is a wire contract between worker and gateway processes
    packed = bytes(8) + b"".join(t.to_bytes(4, "little") for t in (1, 2, 3, 4))
    assert block_hash(ROOT_HASH, [1, 2, 3, 4]) == int.from_bytes(
        hashlib.blake2b(packed, digest_size=8).digest(), "little")
    with pytest.raises(ValueError, match="block_size"):
        block_hashes(tokens, 0)
    with pytest.raises(OverflowError):
        block_hash(ROOT_HASH, [2**32])


def test_block_hashes_extend_a_chain_from_a_parent() -> None:
    """``block_hashes(rest, bs, parent)`` continues the chain ``parent`` ends: split anywhere on a block
    boundary, the two parts give the whole prompt's chain, each hash the one-by-one ``block_hash``."""
    tokens = [(7919 * i) % 2**32 for i in range(11 * BS + 2)]
    whole = block_hashes(tokens, BS)
    parent, one_by_one = ROOT_HASH, []
    for i in range(11):
        parent = block_hash(parent, tokens[i * BS : (i + 1) * BS])
        one_by_one.append(parent)
    assert whole == one_by_one
    for cut in (1, 5, 10):
        rest = block_hashes(tokens[cut * BS :], BS, whole[cut - 1])
        assert block_hashes(tokens[: cut * BS], BS) + rest == whole
    with pytest.raises(OverflowError):
        block_hashes(tokens, BS, 2**64)


def test_sequence_keeps_its_chain_and_recomputes_when_its_tokens_are_replaced() -> None:
    """``Sequence.full_block_hashes`` equals a fresh ``block_hashes`` of its tokens after appends (the
    kept chain extended), after its token list is replaced (chain dropped) and for another block size."""
    seq = _seq(list(range(30, 30 + 2 * BS + 1)))
    assert seq.full_block_hashes(BS, 1) == block_hashes(seq.token_ids, BS)[:1]
    assert seq.full_block_hashes(BS, 2) == block_hashes(seq.token_ids, BS)
    for t in range(500, 500 + BS):
        seq.append_token(t)
    assert seq.full_block_hashes(BS, 3) == block_hashes(seq.token_ids, BS)
    assert seq.full_block_hashes(BS, 0) == []
    seq.token_ids = [1] * len(seq.token_ids)  # not an API use: a replaced list must not keep stale hashes
    assert seq.full_block_hashes(BS, 3) == block_hashes(seq.token_ids, BS)
    assert seq.full_block_hashes(2 * BS, 1) == block_hashes(seq.token_ids, 2 * BS)[:1]
    with pytest.raises(ValueError, match="4 full blocks of 4 tokens"):
        seq.full_block_hashes(BS, 4)
    # kept hashes (a prefix hit's) are extended, never shortened
    kept = _seq(list(range(60, 60 + 3 * BS)), rid="kept")
    chain = block_hashes(kept.token_ids, BS)
    kept.keep_block_hashes(BS, chain[:2])
    kept.keep_block_hashes(BS, chain[:1])
    assert kept.full_block_hashes(BS, 3) == chain
    with pytest.raises(ValueError, match="4 hashes of 4-token blocks given, 12 tokens"):
        kept.keep_block_hashes(BS, [*chain, 1])


def test_a_worker_hashes_each_block_of_a_sequence_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A prefix lookup finds the hashes of hit blocks without hashing (by parent hash and tokens) and
    hashes only the block that misses; the prompt's step and decode steps then hash each other block
    once, chained on the hits' hashes. The registered hashes are the whole token chain's."""
    import engine.block_manager
    import engine.sequence
    hashed: list[int] = []

    def counting_chain(tokens: list[int], block_size: int, parent: int = ROOT_HASH) -> list[int]:
        hashed.append(len(tokens) // block_size)
        return block_hashes(tokens, block_size, parent)

    def counting_one(parent: int, tokens: tuple[int, ...]) -> int:
        hashed.append(1)
        return block_hash(parent, tokens)

    monkeypatch.setattr(engine.sequence, "block_hashes", counting_chain)
    monkeypatch.setattr(engine.block_manager, "block_hash", counting_one)
    bm = BlockManager(num_blocks=32, block_size=BS)
    first = _seq(list(range(200, 200 + 5 * BS + 1)), rid="first")
    assert bm.allocate_prefix(first) == 0
    assert sum(hashed) == 1  # block 0 missed
    _computed(bm, first)
    assert sum(hashed) == 1 + 5
    bm.free(first)
    hashed.clear()
    second = _seq([*first.token_ids[: 5 * BS], *range(700, 700 + 2 * BS + 1)], rid="second")
    assert bm.allocate_prefix(second) == 5 * BS
    assert sum(hashed) == 1  # five hits found by their keys, block 5 missed
    _computed(bm, second)
    assert sum(hashed) == 1 + 2
    for t in range(BS):
        second.append_token(900 + t)
        bm.allocate(second, 1)
        second.num_computed_tokens += 1
        bm.cache_full_blocks(second)
    assert sum(hashed) == 1 + 2 + 1  # the eighth block filled during decode
    assert set(block_hashes(second.token_ids, BS)) <= set(bm.cached_hashes())
    assert second.full_block_hashes(BS, 8) == block_hashes(second.token_ids, BS)
    bm.free(second)
    bm.check_no_leaks()


def test_block_manager_registers_the_shared_chain() -> None:
    """The block manager's hashes are ``block_hashes`` of the tokens: what the gateway computes."""
    bm = BlockManager(num_blocks=8, block_size=BS)
    seq = _seq(list(range(100, 110)))
    _computed(bm, seq)
    assert sorted(bm.cached_hashes()) == sorted(block_hashes(seq.token_ids, BS))
    bm.free(seq)
    bm.check_no_leaks()


def test_events_report_stored_then_removed_on_eviction() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS)
    log = bm.record_events()
    assert bm.record_events() is log  # idempotent
    a = _seq(list(range(9)), "a")
    _computed(bm, a)  # 2 full blocks registered, a third partial
    first = log.drain()
    assert first.stored == block_hashes(a.token_ids, BS) and first.removed == [] and not first.lost
    assert not log.drain()  # nothing since
    bm.free(a)
    assert not log.drain()  # freed blocks stay cached: no event
    b = _seq([50 + i for i in range(16)], "b")
    bm.allocate(b, 16)  # needs all 4 blocks: both cached ones are evicted
    evicted = log.drain()
    assert sorted(evicted.removed) == sorted(first.stored) and evicted.stored == []
    b.num_computed_tokens = 16
    bm.cache_full_blocks(b)
    assert log.drain().stored == block_hashes(b.token_ids, BS)
    bm.free(b)
    bm.check_no_leaks()
    assert sorted(bm.cached_hashes()) == sorted(block_hashes(b.token_ids, BS))


def test_a_prefix_hit_and_a_duplicate_block_store_nothing_new() -> None:
    """A second sequence with the same prefix (hit, or computed again beside the first) adds no event:
    the set of cached hashes did not change."""
    bm = BlockManager(num_blocks=8, block_size=BS)
    log = bm.record_events()
    a, twin = _seq(list(range(9)), "a"), _seq(list(range(9)), "twin")
    _computed(bm, a)
    _computed(bm, twin)  # same tokens in other blocks (no allocate_prefix): the hash is already cached
    assert len(log.drain().stored) == 2
    bm.free(a)
    bm.free(twin)
    hit = _seq(list(range(9)), "hit")
    assert bm.allocate_prefix(hit) == 8
    _computed(bm, hit)
    assert not log.drain()
    bm.free(hit)
    bm.check_no_leaks()


def test_contiguous_run_evictions_are_reported() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS)
    log = bm.record_events()
    a = _seq(list(range(8)), "a")
    _computed(bm, a)
    bm.free(a)
    stored = log.drain().stored
    run = bm.allocate_contiguous(4)
    assert run == [0, 1, 2, 3]
    assert sorted(log.drain().removed) == sorted(stored)
    assert bm.cached_hashes() == []
    held = _seq([0], "held")
    held.block_table = run
    bm.free(held)
    bm.check_no_leaks()


def test_event_log_keeps_the_net_change_and_is_bounded() -> None:
    log = KVEventLog(max_pending=3)
    log.stored(1)
    log.removed(1)  # stored and removed since the last drain: removed (harmless for a reader without it)
    log.removed(2)
    log.stored(2)
    changes = log.drain()
    assert changes.removed == [1] and changes.stored == [2]
    for h in range(4):
        log.stored(h)
    lost = log.drain()
    assert lost.lost and lost.stored == [] and lost.removed == [] and bool(lost)
    assert not log.drain()
    with pytest.raises(ValueError, match="max_pending"):
        KVEventLog(0)


def test_no_events_without_a_log() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS)
    assert bm.events is None
    a = _seq(list(range(9)), "a")
    _computed(bm, a)
    assert len(bm.cached_hashes()) == 2
    bm.free(a)
    bm.check_no_leaks()
