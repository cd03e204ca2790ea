"""KV block allocator with ref counts, prefix caching and LRU eviction (no torch).

Modelled on nano-vllm's ``block_manager.py`` and vLLM's automatic prefix caching: the hash of full block
``i`` is ``block_hash(hash of block i-1, token ids of block i)`` (engine/block_hash.py: stable across
processes, so the gateway names blocks by the same numbers) so a hit on block ``i`` implies the whole
prefix matches. Free blocks are either *uncached* (no hash; handed out lowest id first) or *cached*
(hash kept, reusable by a prefix hit until evicted least-recently-freed first).

Besides the free sets, two numpy boolean masks over block ids (``_free_mask``: ref_count 0;
``_uncached_mask``: free and uncached) are kept in step with every state change, so
:meth:`BlockManager.allocate_contiguous` finds a run with vectorised ops (:func:`first_run`) instead of
a Python loop over every block id.

With ``events`` set (:meth:`BlockManager.record_events`), every hash entering or leaving the prefix cache
(the keys of the hash → block map) is logged (engine/kv_events.py) for the worker to publish.

With ``host_tier`` set (engine/kv_host_tier.py), an evicted cached block is saved to host memory and a
prefix lookup continues its chain there (:meth:`BlockManager.allocate_prefix`); a hash then stays
"stored" in the events while the device pool or the tier holds it (a hit costs a copy, not a recompute)
and is "removed" once neither does.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from engine.block_hash import ROOT_HASH, block_hash
from engine.kv_events import KVEventLog
from engine.sequence import Sequence

if TYPE_CHECKING:  # the block manager itself imports no torch
    from engine.kv_host_tier import KVHostTier

BoolArray = npt.NDArray[np.bool_]


class NoFreeBlocksError(RuntimeError):
    """Raised when more KV blocks are requested than are free (or than exist at all)."""


def first_run(mask: BoolArray, n: int, scratch: tuple[BoolArray, BoolArray]) -> int | None:
    """Lowest ``i`` with ``mask[i : i + n]`` all True (first fit), or None if no such run exists.

    ``mask``: bool ``[num_blocks]``, not modified; ``scratch``: two bool ``[num_blocks]`` work buffers
    (overwritten). Erosion by doubling: after a pass ``r[i]`` is True iff ``mask[i : i + k]`` is all
    True; ``r_{k+s}[i] = r_k[i] & r_k[i + s]`` for ``s <= k``: binary-morphology erosion of the mask by a
    length-``n`` segment, decomposed into ``ceil(log2 n)`` vectorised shift-and passes of O(num_blocks).

    Raises:
        ValueError: ``n < 1`` or ``n > len(mask)``.
    """
    if not 1 <= n <= len(mask):
        raise ValueError(f"run length must be in [1, {len(mask)}], got {n}")
    cur, k, turn = mask, 1, 0
    while k < n:
        step = min(k, n - k)
        buf, turn = scratch[turn], 1 - turn
        np.logical_and(cur[:-step], cur[step:], out=buf[:-step])
        buf[-step:] = False
        cur, k = buf, k + step
    i = int(cur.argmax())  # the first True (argmax stops there)
    return i if cur[i] else None


class _Block:
    __slots__ = ("block_hash", "block_id", "parent_hash", "ref_count", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: int | None = None
        self.parent_hash = ROOT_HASH  # the hash block_hash chains on (kept while block_hash is set)
        self.token_ids: tuple[int, ...] = ()


class BlockManager:
    """Hands out KV cache blocks (ids ``0..num_blocks-1``) of ``block_size`` tokens to sequences.

    ``before_free``: called (no arguments) at the start of every :meth:`free` while set; the engine sets it
    while a launched step may still write the KV cache (asynchronous scheduling, engine/async_step.py), to
    wait for that step, so no block is handed out again while it can still be written.

    ``events``: None (the default: nothing recorded) or the log of prefix-cache changes
    (:meth:`record_events`).
    ``host_tier``: None (the default) or the host-memory tier evicted cached blocks are saved to and
    prefix lookups continue in. Blocks handed out may then still be the target or source of the tier's
    copies: a forward waits for them (``KVHostTier.before_forward``), any other writer of the blocks
    first calls :meth:`wait_host_copies`.
    ``prefix_grid_blocks``: a prefix hit is rounded down to a multiple of this many blocks (the prefill
    grid, ``SchedulerConfig.prefill_grid``, in blocks; 1: no rounding).

    Raises:
        ValueError: non-positive ``num_blocks``, ``block_size`` or ``prefix_grid_blocks``.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 prefix_grid_blocks: int = 1) -> None:
        if num_blocks < 1 or block_size < 1 or prefix_grid_blocks < 1:
            raise ValueError(f"num_blocks, block_size and prefix_grid_blocks must be >= 1, got {num_blocks}, "
                             f"{block_size}, {prefix_grid_blocks}")
        self.prefix_grid_blocks = prefix_grid_blocks
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.before_free: Callable[[], None] | None = None
        self.events: KVEventLog | None = None
        self.host_tier: KVHostTier | None = None
        self._host_saves: list[tuple[int, tuple[int, ...], int]] = []  # evicted, not yet handed to the tier
        self._blocks = [_Block(i) for i in range(num_blocks)]
        self._hash_to_block: dict[int, int] = {}
        # (parent hash, token ids) → block_hash(parent, token ids) of every key of _hash_to_block: a prefix
        # lookup finds a cached block's hash with the built-in tuple hash instead of BLAKE2b
        self._known_hash: dict[tuple[int, tuple[int, ...]], int] = {}
        self._free_uncached: set[int] = set(range(num_blocks))
        self._uncached_heap: list[int] = list(range(num_blocks))  # lazy: may hold ids no longer free
        self._in_heap = np.ones(num_blocks, dtype=np.bool_)  # id has an entry in _uncached_heap
        self._free_cached: OrderedDict[int, None] = OrderedDict()  # LRU order, oldest first
        self._free_mask = np.ones(num_blocks, dtype=np.bool_)  # ref_count == 0
        self._uncached_mask = np.ones(num_blocks, dtype=np.bool_)  # in _free_uncached
        self._scratch = (np.empty(num_blocks, dtype=np.bool_), np.empty(num_blocks, dtype=np.bool_))
        # when each block last entered _free_cached (a counter: the LRU order as numbers), for the runs of
        # allocate_contiguous; meaningful for free cached blocks only
        self._freed_at = np.zeros(num_blocks, dtype=np.int64)
        self._free_clock = 0
        self._run_mask = np.empty(num_blocks, dtype=np.bool_)

    def record_events(self, max_pending: int | None = None) -> KVEventLog:
        """Start logging prefix-cache changes (idempotent); returns the log. ``max_pending`` bounds the
        hashes it keeps between drains (default ``2 * num_blocks``: more than one phase can change)."""
        if self.events is None:
            self.events = KVEventLog(max_pending or 2 * self.num_blocks)
        return self.events

    def cached_hashes(self) -> list[int]:
        """Every block hash the prefix cache holds now (in use or free-cached, or in the host tier;
        unordered)."""
        if self.host_tier is None:
            return list(self._hash_to_block)
        return list(self._hash_to_block.keys() | set(self.host_tier.hashes()))

    def wait_host_copies(self) -> None:
        """Wait until the host tier's copies asked for so far are done (before something other than a
        forward, e.g. a KV transfer, writes blocks just handed out). No-op without a tier."""
        if self.host_tier is not None:
            self.host_tier.synchronize()

    @property
    def num_free_blocks(self) -> int:
        """Blocks with ref_count 0, cached-but-free ones included."""
        return len(self._free_uncached) + len(self._free_cached)

    def num_blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks to add so ``seq.block_table`` covers ``num_computed_tokens + num_new_tokens`` tokens."""
        total = -(-(seq.num_computed_tokens + num_new_tokens) // self.block_size)
        return max(0, total - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """True if :meth:`allocate` for ``num_new_tokens`` tokens would succeed now."""
        return self.num_blocks_needed(seq, num_new_tokens) <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Grow ``seq.block_table`` to cover ``num_computed_tokens + num_new_tokens`` tokens.

        Raises:
            NoFreeBlocksError: not enough free blocks (nothing is allocated then).
        """
        need = self.num_blocks_needed(seq, num_new_tokens)
        if need == 0:
            return
        if need > self.num_free_blocks:
            raise NoFreeBlocksError(
                f"request {seq.request_id!r} needs {need} more blocks, {self.num_free_blocks} free "
                f"of {self.num_blocks}"
            )
        seq.block_table.extend(self._take_free_block() for _ in range(need))
        if self._host_saves:
            self._host_transfer([])

    def allocate_prefix(self, seq: Sequence) -> int:
        """Fill an empty ``seq.block_table`` with cached full blocks matching its tokens (ref + 1 each).

        Never covers the last token, so at least one token is computed and logits exist. The hit is
        rounded down to a multiple of ``prefix_grid_blocks`` blocks. With a host tier the chain continues
        there after the last device hit (:meth:`_host_prefix`).
        Returns the number of cached tokens (a multiple of ``block_size``; 0 without prefix caching).

        Raises:
            ValueError: ``seq`` already has blocks or computed tokens.
        """
        if seq.block_table or seq.num_computed_tokens:
            raise ValueError(f"allocate_prefix needs a fresh sequence, {seq.request_id!r} has state")
        if not self.enable_prefix_caching:
            return 0
        grid, bs = self.prefix_grid_blocks, self.block_size
        num_blocks = (seq.num_tokens - 1) // bs
        limit = num_blocks - num_blocks % grid
        token_ids, blocks, cached, known = seq.token_ids, self._blocks, self._hash_to_block, self._known_hash
        hits: list[int] = []
        parent = ROOT_HASH
        for i in range(limit):
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            h = known.get((parent, tokens))
            if h is None:  # not a cached block's key: hash it (a hash registered since can still hit)
                h = block_hash(parent, tokens)
            block_id = cached.get(h)
            if block_id is None or blocks[block_id].token_ids != tokens:
                break
            seq.block_table.append(block_id)
            hits.append(h)
            parent = h
        seq.keep_block_hashes(bs, hits)
        if self.host_tier is not None:
            self._host_prefix(seq, seq.full_block_hashes(bs, limit))
            return len(seq.block_table) * self.block_size
        del seq.block_table[len(seq.block_table) - len(seq.block_table) % grid :]
        for block_id in seq.block_table:
            self._ref(block_id)
        return len(seq.block_table) * self.block_size

    def _host_prefix(self, seq: Sequence, hashes: list[int]) -> None:
        """``allocate_prefix`` with a host tier: ``seq.block_table`` holds the (unreferenced) device hits,
        ``hashes`` the chain of the blocks a hit may cover. Continue the chain in the tier, as far as
        the free device blocks allow once the device hits are referenced; round the whole hit down to the
        grid; reference the device hits, take a device block for each tier hit, register its hash and
        copy its KV back (after the KV of any block this evicts was saved)."""
        tier = self.host_tier
        assert tier is not None
        bs, grid = self.block_size, self.prefix_grid_blocks
        found: list[tuple[int, tuple[int, ...]]] = []  # tier hits after the device ones
        for i in range(len(seq.block_table), len(hashes)):
            tokens, h = tuple(seq.token_ids[i * bs : (i + 1) * bs]), hashes[i]
            if h in self._hash_to_block or not tier.holds(h, tokens):
                break
            found.append((h, tokens))
        num_device = len(seq.block_table)
        free_after = self.num_free_blocks - sum(self._blocks[b].ref_count == 0 for b in seq.block_table)
        total = num_device + min(len(found), free_after)
        total -= total % grid
        del seq.block_table[min(total, num_device):]
        del found[max(total - num_device, 0):]
        for block_id in seq.block_table:
            self._ref(block_id)
        if not found:
            return
        tier.touch(h for h, _ in found)  # not dropped by the saves of the blocks taken below
        loads: list[tuple[int, int]] = []
        for h, tokens in found:
            block_id = self._take_free_block()
            block = self._blocks[block_id]
            parent = hashes[len(seq.block_table) - 1] if seq.block_table else ROOT_HASH
            block.block_hash, block.token_ids, block.parent_hash = h, tokens, parent
            self._hash_to_block[h] = block_id
            self._known_hash[(parent, tokens)] = h
            seq.block_table.append(block_id)
            loads.append((h, block_id))
        self._host_transfer(loads)

    def _host_transfer(self, loads: list[tuple[int, int]]) -> None:
        """Hand the evicted blocks collected since the last call and ``loads`` to the tier (saves first);
        then log "removed" for each hash neither the device pool nor the tier holds any more."""
        tier = self.host_tier
        assert tier is not None
        saves, self._host_saves = self._host_saves, []
        dropped = tier.transfer(saves, loads)
        if self.events is not None:
            for h in [h for h, _, _ in saves] + dropped:
                if h not in self._hash_to_block and h not in tier:
                    self.events.removed(h)

    def allocate_contiguous(self, num_blocks: int) -> list[int] | None:
        """Take a run of ``num_blocks`` consecutive free block ids (ref_count 1 each), or None.

        First fit: the lowest-starting run of free *uncached* blocks; failing that, a run that evicts
        only the least recently freed cached blocks it can (``_least_recent_run``): the cached blocks it
        evicts (hashes dropped) were all freed before any cached block outside it that a run could have
        used instead, so a live prefix (a session's, freed a turn ago) is evicted only when no run exists
        without it; the lowest-starting such run. The decode worker uses this so each request-layer
        arrives as one transfer. Cost: ``ceil(log2 num_blocks)`` vectorised passes over the block masks
        (:func:`first_run`; ~10-30 µs at 34k blocks) plus Python work per block taken; when cached blocks
        must be evicted, a sort of the free cached blocks' free times and a binary search over them
        (``log2`` of their count more ``first_run`` calls).

        Raises:
            NoFreeBlocksError: ``num_blocks`` exceeds the number of blocks that exist.
            ValueError: ``num_blocks < 1``.
        """
        if num_blocks < 1:
            raise ValueError(f"allocate_contiguous needs num_blocks >= 1, got {num_blocks}")
        if num_blocks > self.num_blocks:
            raise NoFreeBlocksError(f"{num_blocks} contiguous blocks asked, only {self.num_blocks} exist")
        start = None
        if len(self._free_uncached) >= num_blocks:
            start = first_run(self._uncached_mask, num_blocks, self._scratch)
        if start is None and self.num_free_blocks >= num_blocks:
            start = self._least_recent_run(num_blocks)
        if start is None:
            return None
        run = self._take_run(start, num_blocks)
        if self._host_saves:
            self._host_transfer([])
        return run

    def _least_recent_run(self, n: int) -> int | None:
        """The lowest start of a run of ``n`` free blocks whose newest cached block was freed as early as
        possible (the smallest free time ``t`` such that the free uncached blocks and the cached ones freed
        at or before ``t`` hold a run: a binary search over the sorted free times, as the blocks allowed
        only grow with ``t``; first among the ``4 n`` oldest, which usually hold one, then among all), or
        None when the free blocks hold no run of ``n``."""
        if first_run(self._free_mask, n, self._scratch) is None:
            return None
        times = self._freed_at[self._free_mask & ~self._uncached_mask]
        if len(times) > 4 * n:
            oldest = np.partition(times, 4 * n - 1)[: 4 * n]
            oldest.sort()
            if self._run_from(int(oldest[-1]), n) is not None:
                return self._oldest_fit(oldest, n)
        return self._oldest_fit(np.sort(times), n)

    def _oldest_fit(self, times: npt.NDArray[np.int64], n: int) -> int | None:
        """``_run_from`` at the smallest of the sorted free ``times`` that gives a run (the last one must)."""
        lo, hi = 0, len(times) - 1
        while lo < hi:
            mid = (lo + hi) // 2
            if self._run_from(int(times[mid]), n) is None:
                lo = mid + 1
            else:
                hi = mid
        return self._run_from(int(times[lo]), n)

    def _run_from(self, t: int, n: int) -> int | None:
        """First fit of ``n`` over the free uncached blocks and the cached ones freed at or before ``t``."""
        np.less_equal(self._freed_at, t, out=self._run_mask)
        self._run_mask &= self._free_mask
        self._run_mask |= self._uncached_mask
        return first_run(self._run_mask, n, self._scratch)

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register hashes of the blocks of ``seq`` whose tokens are all computed (call after a step).

        Incremental: ``seq.hashed_blocks`` remembers how many leading blocks were registered and the hash
        of the last one, so a decode step costs O(1) unless a block just filled; the hashes come from
        ``seq.full_block_hashes`` (each block's tokens hashed once per sequence, ``allocate_prefix``'s
        included). A remembered state that no longer matches ``seq.block_table`` (a table rebuilt
        without ``free``) restarts from block 0 when the next block fills. Only the leading
        ``seq.cacheable_tokens`` tokens are registered when that is set.
        """
        if not self.enable_prefix_caching:
            return
        computed = seq.num_computed_tokens if seq.cacheable_tokens is None else min(
            seq.num_computed_tokens, seq.cacheable_tokens)
        num_full = min(computed // self.block_size, len(seq.block_table))
        start, parent = seq.hashed_blocks
        if start == num_full:  # no block filled since the last call (most decode steps)
            return
        if start > num_full or (start and self._blocks[seq.block_table[start - 1]].block_hash != parent):
            start, parent = 0, ROOT_HASH
        bs, cached, events = self.block_size, self._hash_to_block, self.events
        hashes = seq.full_block_hashes(bs, num_full)
        for i in range(start, num_full):
            block = self._blocks[seq.block_table[i]]
            h = block.block_hash
            if h is None:
                h = block.block_hash = hashes[i]
                block.token_ids = tuple(seq.token_ids[i * bs : (i + 1) * bs])
                block.parent_hash = hashes[i - 1] if i else ROOT_HASH
                if h not in cached:
                    cached[h] = block.block_id
                    self._known_hash[(block.parent_hash, block.token_ids)] = h
                    if events is not None:
                        events.stored(h)
            parent = h
        seq.hashed_blocks = (num_full, parent)

    def free(self, seq: Sequence) -> None:
        """Drop ``seq``'s reference to each of its blocks and empty its ``block_table``.

        Blocks reaching ref_count 0 keep their hash (reusable by prefix hits); the tail blocks of the
        sequence are queued for eviction first. Calls ``before_free`` first when set.
        """
        if self.before_free is not None and seq.block_table:
            self.before_free()
        for block_id in reversed(seq.block_table):
            block = self._blocks[block_id]
            if block.ref_count <= 0:
                raise AssertionError(f"double free of block {block_id} by {seq.request_id!r}")
            block.ref_count -= 1
            if block.ref_count == 0:
                self._release(block)
        seq.block_table = []
        seq.hashed_blocks = (0, ROOT_HASH)
        if self.host_tier is not None and self.host_tier.presave_blocks:
            self._host_presave()

    def _host_presave(self) -> None:
        """Save the tier's ``presave_blocks`` next blocks to evict (the oldest free cached ones) that it
        does not hold yet, while they stay cached here: their copies overlap the steps before the eviction,
        which then costs none (``KVHostTier.transfer`` with ``evicted=False``)."""
        tier = self.host_tier
        assert tier is not None
        picks = []
        for block_id in itertools.islice(self._free_cached, tier.presave_blocks):
            block = self._blocks[block_id]
            if block.block_hash is not None and block.block_hash not in tier:
                picks.append((block.block_hash, block.token_ids, block_id))
        if picks:
            dropped = tier.transfer(picks, [], evicted=False)
            if self.events is not None:
                for h in dropped:
                    if h not in self._hash_to_block and h not in tier:
                        self.events.removed(h)

    def check_no_leaks(self) -> None:
        """Raise ``AssertionError`` listing blocks still referenced (or lost from the free lists)."""
        held = [b.block_id for b in self._blocks if b.ref_count != 0]
        if held:
            raise AssertionError(f"KV blocks still referenced: {held[:32]} ({len(held)} in all)")
        if self.num_free_blocks != self.num_blocks:
            raise AssertionError(f"free lists hold {self.num_free_blocks} of {self.num_blocks} blocks")
        if self._host_saves:
            raise AssertionError(f"{len(self._host_saves)} evicted blocks never handed to the host tier")
        if sorted(self._known_hash.values()) != sorted(self._hash_to_block):
            raise AssertionError(f"{len(self._known_hash)} prefix lookup keys for {len(self._hash_to_block)} "
                                 "cached hashes")
        if self.host_tier is not None:
            self.host_tier.check()

    def _ref(self, block_id: int) -> None:
        block = self._blocks[block_id]
        if block.ref_count == 0:
            self._free_cached.pop(block_id, None)
            self._free_uncached.discard(block_id)
            self._free_mask[block_id] = self._uncached_mask[block_id] = False
        block.ref_count += 1

    def _take_free_block(self) -> int:
        while self._uncached_heap:
            block_id = heapq.heappop(self._uncached_heap)
            self._in_heap[block_id] = False
            if block_id in self._free_uncached:
                self._take_specific(block_id)
                return block_id
        block_id, _ = self._free_cached.popitem(last=False)  # evict the least recently freed
        self._take_specific(block_id)
        return block_id

    def _take_specific(self, block_id: int) -> None:
        block = self._blocks[block_id]
        assert block.ref_count == 0, f"block {block_id} is in use"
        self._free_uncached.discard(block_id)
        self._free_cached.pop(block_id, None)
        self._free_mask[block_id] = self._uncached_mask[block_id] = False
        if block.block_hash is not None:
            self._evict(block)
        block.ref_count = 1

    def _take_run(self, start: int, n: int) -> list[int]:
        """``_take_specific`` on blocks ``start..start+n-1`` (all free), the masks and sets in bulk."""
        run = list(range(start, start + n))
        self._free_mask[start : start + n] = False
        self._uncached_mask[start : start + n] = False
        self._free_uncached.difference_update(run)
        for block_id in run:
            block = self._blocks[block_id]
            assert block.ref_count == 0, f"block {block_id} is in use"
            if block.block_hash is not None:  # a free block with a hash is a cached one
                del self._free_cached[block_id]
                self._evict(block)
            block.ref_count = 1
        return run

    def _evict(self, block: _Block) -> None:
        """Drop a block's hash: its old content is about to be overwritten. With a host tier the block is
        queued to be saved there (by the caller's ``_host_transfer``, before anything writes it)."""
        if block.block_hash is not None and self._hash_to_block.get(block.block_hash) == block.block_id:
            del self._hash_to_block[block.block_hash]
            del self._known_hash[(block.parent_hash, block.token_ids)]
            if self.host_tier is not None:
                self._host_saves.append((block.block_hash, block.token_ids, block.block_id))
            elif self.events is not None:
                self.events.removed(block.block_hash)
        block.block_hash = None
        block.token_ids = ()

    def _release(self, block: _Block) -> None:
        self._free_mask[block.block_id] = True
        if block.block_hash is not None and self._hash_to_block.get(block.block_hash) == block.block_id:
            self._free_cached[block.block_id] = None
            self._free_cached.move_to_end(block.block_id)
            self._freed_at[block.block_id] = self._free_clock
            self._free_clock += 1
        else:
            block.block_hash = None
            block.token_ids = ()
            self._free_uncached.add(block.block_id)
            self._uncached_mask[block.block_id] = True
            if not self._in_heap[block.block_id]:  # one entry per id keeps the heap <= num_blocks
                self._in_heap[block.block_id] = True
                heapq.heappush(self._uncached_heap, block.block_id)
