"""The host-memory KV tier (engine/kv_host_tier.py) behind the BlockManager, on a CPU pool: an evicted
cached block's KV is saved and comes back bit for bit on a prefix hit; the tier drops its least recently
used block when full; ref counts and KV events stay right; every test ends with a leak check."""

from __future__ import annotations

import pytest
import torch

from engine.block_manager import BlockManager
from engine.config import CacheConfig
from engine.kv_cache import KVCachePool
from engine.kv_host_tier import KVHostTier, host_tier_blocks
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence

BS = 4
LAYERS, HEADS, DIM = 2, 2, 3


def _seq(tokens: list[int], rid: str = "r") -> Sequence:
    return Sequence(rid, tokens, SamplingParams(), arrival_time=0.0)


def _system(num_blocks: int, host_blocks: int, grid: int = 1,
            device: str = "cpu") -> tuple[BlockManager, KVCachePool, KVHostTier]:
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    pool = KVCachePool(LAYERS, num_blocks, BS, HEADS, DIM, dtype, device)
    bm = BlockManager(num_blocks, BS, prefix_grid_blocks=grid)
    tier = KVHostTier(pool, host_blocks)
    bm.host_tier = tier
    return bm, pool, tier


def _compute(bm: BlockManager, pool: KVCachePool, seq: Sequence, seed: int) -> None:
    """Allocate ``seq``'s blocks, write random KV into the ones not cached (as a forward would: after the
    tier's ``before_forward``) and register its full blocks."""
    cached = bm.allocate_prefix(seq)
    seq.num_computed_tokens = cached
    bm.allocate(seq, seq.num_tokens - cached)
    assert bm.host_tier is not None
    bm.host_tier.before_forward()
    gen = torch.Generator().manual_seed(seed)
    for block_id in seq.block_table[cached // BS:]:
        shape = pool.kv_buffer[:, :, block_id].shape
        pool.kv_buffer[:, :, block_id] = torch.randn(shape, generator=gen).to(pool.device, pool.dtype)
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_full_blocks(seq)


def _kv(pool: KVCachePool, block_ids: list[int]) -> torch.Tensor:
    """The blocks' KV as the next forward would read it (after the tier's copies), on the CPU."""
    if pool.device.type == "cuda":
        torch.cuda.current_stream(pool.device).synchronize()
    return pool.kv_buffer[:, :, block_ids].cpu()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])])
def test_evicted_blocks_come_back_from_the_host_bit_for_bit(device: str) -> None:
    """On CUDA the copies run on the tier's side stream into pinned memory; the filler's KV is written
    over the evicted blocks on the compute stream right after the eviction (ordered by
    ``before_forward`` only), and the reloaded blocks are read the same way."""
    bm, pool, tier = _system(num_blocks=4, host_blocks=8, device=device)
    assert tier.host_buffer.is_pinned() == (device == "cuda")
    a = _seq(list(range(13)), "a")  # 3 full blocks + 1 token
    _compute(bm, pool, a, seed=1)
    kv_a = _kv(pool, a.block_table[:3])
    hashes_a = [bm._blocks[i].block_hash for i in a.block_table[:3]]
    bm.free(a)
    b = _seq(list(range(100, 116)), "b")  # 4 blocks: evicts every block of a
    _compute(bm, pool, b, seed=2)
    assert len(tier) == 3 and tier.stats.saved_blocks == 3
    assert sorted(tier.hashes()) == sorted(hashes_a)
    assert not set(hashes_a) & set(bm._hash_to_block)  # only in the tier now
    bm.free(b)
    again = _seq(list(range(13)), "a2")
    hit = bm.allocate_prefix(again)
    tier.before_forward()
    assert hit == 12
    assert tier.stats.hits == 3 and tier.stats.loaded_blocks == 3
    assert torch.equal(_kv(pool, again.block_table), kv_a)
    assert [bm._blocks[i].ref_count for i in again.block_table] == [1, 1, 1]
    bm.free(again)
    bm.check_no_leaks()


def test_a_hit_continues_after_the_device_hits_and_leaves_room() -> None:
    """The device holds the head of the prefix (evicted tail first), the tier the tail: one chain."""
    bm, pool, tier = _system(num_blocks=6, host_blocks=8)
    a = _seq(list(range(21)), "a")  # 5 full blocks + 1 token: 6 blocks
    _compute(bm, pool, a, seed=1)
    kv_a = _kv(pool, a.block_table[:5])
    bm.free(a)  # tail blocks first in the eviction order
    b = _seq(list(range(100, 109)), "b")  # 3 blocks: 1 uncached, then 2 cached evicted (a's tail)
    _compute(bm, pool, b, seed=2)
    assert len(tier) == 2
    bm.free(b)
    again = _seq(list(range(21)), "a2")
    assert bm.allocate_prefix(again) == 20
    assert tier.stats.hits == 2
    assert torch.equal(_kv(pool, again.block_table), kv_a)
    assert tier.stats.saved_blocks == 3  # a's two tail blocks, then one of b's to make room
    bm.free(again)
    bm.check_no_leaks()


def test_tier_hits_stop_at_the_free_device_blocks_and_round_to_the_grid() -> None:
    bm, pool, tier = _system(num_blocks=6, host_blocks=8, grid=2)
    a = _seq(list(range(21)), "a")
    _compute(bm, pool, a, seed=1)
    bm.free(a)
    hold = _seq(list(range(200, 224)), "hold")  # all 6 blocks: a's 5 cached blocks go to the tier
    _compute(bm, pool, hold, seed=3)
    assert len(tier) == 5
    bm.free(hold)
    pin = _seq(list(range(300, 309)), "pin")  # 3 blocks held while the lookup runs: 3 free
    _compute(bm, pool, pin, seed=4)
    again = _seq(list(range(21)), "a2")
    assert bm.allocate_prefix(again) == 2 * BS  # 3 free blocks → 3 tier hits → rounded to the grid: 2
    assert tier.stats.hits == 2
    bm.free(again)
    bm.free(pin)
    bm.check_no_leaks()


def test_a_full_tier_drops_its_least_recently_used_block() -> None:
    bm, pool, tier = _system(num_blocks=2, host_blocks=2)
    log = bm.record_events()
    hashes = []
    for i in range(3):  # three one-block prompts, each evicting the one before
        s = _seq([10 * i + t for t in range(BS + 1)], f"s{i}")
        _compute(bm, pool, s, seed=i)
        hashes.append(bm._blocks[s.block_table[0]].block_hash)
        bm.free(s)
    stored = log.drain().stored
    assert stored == hashes
    filler = _seq(list(range(500, 508)), "filler")  # evicts s1's and s2's blocks; the tier drops s0's
    _compute(bm, pool, filler, seed=9)
    changes = log.drain()
    assert tier.stats.evictions == 1 and len(tier) == 2
    assert hashes[0] in changes.removed
    assert hashes[1] not in changes.removed and hashes[2] not in changes.removed  # still cached (host)
    assert set(hashes[1:]) <= set(bm.cached_hashes())
    assert hashes[0] not in bm.cached_hashes()
    bm.free(filler)
    bm.check_no_leaks()


def test_a_tier_smaller_than_one_eviction_batch_keeps_the_most_recent_block() -> None:
    """Three blocks evicted at once into a one-slot tier: the slot is copied once, with the last one."""
    bm, pool, tier = _system(num_blocks=4, host_blocks=1)
    log = bm.record_events()
    a = _seq(list(range(13)), "a")  # 3 full blocks, freed tail first: evicted in the order 2, 1, 0
    _compute(bm, pool, a, seed=1)
    kv_first = _kv(pool, a.block_table[:1])
    hashes = [bm._blocks[i].block_hash for i in a.block_table[:3]]
    bm.free(a)
    log.drain()
    filler = _seq(list(range(100, 116)), "f")  # 4 blocks: 1 uncached, then a's 3 cached ones
    bm.allocate(filler, 16)
    assert (tier.stats.saved_blocks, tier.stats.evictions, tier.hashes()) == (1, 2, [hashes[0]])
    assert set(log.drain().removed) == set(hashes[1:])
    assert torch.equal(tier.host_buffer[0].unsqueeze(2), kv_first)
    bm.free(filler)
    bm.check_no_leaks()


def test_the_next_blocks_to_evict_are_saved_ahead_and_their_eviction_copies_nothing() -> None:
    """With ``presave_blocks`` 2, each free saves the two oldest free cached blocks the tier lacks while
    they stay cached on the device; evicting them later copies nothing, and they come back intact."""
    pool = KVCachePool(LAYERS, 6, BS, HEADS, DIM, torch.float32)
    bm = BlockManager(6, BS)
    tier = bm.host_tier = KVHostTier(pool, 8, presave_blocks=2)
    log = bm.record_events()
    a = _seq(list(range(21)), "a")  # 5 full blocks + 1 token; freed tail first: block 4 is the oldest
    _compute(bm, pool, a, seed=1)
    kv_a = _kv(pool, a.block_table[:5])
    hashes = [bm._blocks[i].block_hash for i in a.block_table[:5]]
    bm.free(a)
    assert tier.stats.saved_blocks == 2 and sorted(tier.hashes()) == sorted(hashes[3:])
    assert set(hashes) <= set(bm._hash_to_block)  # still cached on the device too
    filler = _seq(list(range(100, 109)), "f")  # 3 blocks: the free uncached one, then blocks 4 and 3
    _compute(bm, pool, filler, seed=2)
    assert tier.stats.saved_blocks == 2  # evicted, already held: no copy
    assert not set(log.drain().removed) & set(hashes)
    bm.free(filler)  # saves the next two to evict: a's blocks 2 and 1
    assert tier.stats.saved_blocks == 4 and set(hashes[1:]) <= set(tier.hashes())
    again = _seq(list(range(21)), "a2")
    assert bm.allocate_prefix(again) == 20
    tier.before_forward()
    assert tier.stats.hits == 2 and torch.equal(_kv(pool, again.block_table), kv_a)
    bm.free(again)
    bm.check_no_leaks()


def test_a_block_already_in_the_tier_is_not_copied_again() -> None:
    bm, pool, tier = _system(num_blocks=2, host_blocks=4)
    a = _seq(list(range(BS + 1)), "a")  # one full block + a partial one
    _compute(bm, pool, a, seed=1)
    bm.free(a)
    filler = _seq(list(range(100, 105)), "f1")  # takes the partial block, evicts a's: saved
    _compute(bm, pool, filler, seed=2)
    bm.free(filler)
    assert tier.stats.saved_blocks == 1
    again = _seq(list(range(BS + 1)), "a2")  # loads a's block into f1's partial (uncached) block
    assert bm.allocate_prefix(again) == BS
    bm.free(again)
    assert (tier.stats.hits, tier.stats.saved_blocks) == (1, 1)
    other = _seq(list(range(200, 205)), "f2")  # evicts f1's full block (saved), then a's: held, no copy
    _compute(bm, pool, other, seed=3)
    assert (tier.stats.saved_blocks, len(tier)) == (2, 2)
    bm.free(other)
    bm.check_no_leaks()


def test_contiguous_runs_save_what_they_evict() -> None:
    bm, pool, tier = _system(num_blocks=4, host_blocks=4)
    a = _seq(list(range(9)), "a")
    _compute(bm, pool, a, seed=1)
    kv = _kv(pool, a.block_table[:2])
    bm.free(a)
    run = bm.allocate_contiguous(4)
    assert run is not None and tier.stats.saved_blocks == 2
    bm.wait_host_copies()
    pool.kv_buffer.zero_()
    bm.free(_seq_with(run))
    again = _seq(list(range(9)), "a2")
    assert bm.allocate_prefix(again) == 8
    assert torch.equal(_kv(pool, again.block_table), kv)
    bm.free(again)
    bm.check_no_leaks()


def _seq_with(block_table: list[int]) -> Sequence:
    s = _seq([0], "run")
    s.block_table = list(block_table)
    return s


def test_loads_refuse_unknown_hashes_and_sizes_are_checked() -> None:
    pool = KVCachePool(LAYERS, 2, BS, HEADS, DIM, torch.float32)
    tier = KVHostTier(pool, 1)
    with pytest.raises(KeyError, match="holds no block"):
        tier.transfer([], [(123, 0)])
    assert host_tier_blocks(0, pool.bytes_per_block) == 0
    assert host_tier_blocks(5 * pool.bytes_per_block + 1, pool.bytes_per_block) == 5
    with pytest.raises(ValueError, match="holds no block"):
        host_tier_blocks(pool.bytes_per_block - 1, pool.bytes_per_block)
    with pytest.raises(ValueError, match="at least one block"):
        KVHostTier(pool, 0)
    with pytest.raises(ValueError, match="presave_blocks must be >= 0"):
        KVHostTier(pool, 1, presave_blocks=-1)
    with pytest.raises(ValueError, match="host_kv_bytes must be >= 0"):
        CacheConfig(host_kv_bytes=-1)
    with pytest.raises(ValueError, match="needs enable_prefix_caching"):
        CacheConfig(host_kv_bytes=1 << 20, enable_prefix_caching=False)
    tier.check()
