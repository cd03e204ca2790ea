"""The host-memory KV tier: a second, larger pool of KV blocks in CPU memory behind the device pool.

A full, hashed block that the device pool evicts (``BlockManager``: a free cached block handed out again)
is copied here, keyed by its block hash, and a later prefix lookup that misses on the device continues its
chain here: the block manager takes device blocks for those hashes and the tier copies their KV back, so
the prefix costs a copy instead of a recompute (the idea of vLLM's CPU offloading and of LMCache's local
CPU backend; the code is pdserve's own).

Layout: ``host_buffer [num_host_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]`` in the KV
dtype: one slot holds one block of every layer, K and V (``KVCachePool.bytes_per_block`` bytes), so a
slot is one contiguous range and a run of consecutive slots is one copy. Slots are kept least recently
used first; saving into a full tier drops the least recently used slot (an *eviction* of the tier).
The tier is inclusive: a block copied back to the device stays here too, so evicting it from the device
again costs no copy.

Copies. On a CUDA device the buffer is pinned (page-locked in place) and every copy runs on one side
stream, in the order it was asked for (so a save into a slot and a later load from it, or a save of a
device block and a later load into the same block, never reorder): a save gathers the evicted blocks
into a staging tensor and copies it to the slots, a load copies the slots into a staging tensor and
scatters it into the blocks. An event recorded after each batch of loads or of evicted blocks' saves
is what the next forward waits on (``before_forward``: the current stream waits on it, the host does
not), so the copies overlap whatever the device still runs and the host's scheduling of the next
step; a writer of the device blocks other than a forward (a KV transfer landing in blocks just reserved)
calls ``synchronize`` first. The side stream does not wait for the compute stream: a saved block is one
whose KV was registered after the step that wrote it finished (its tokens were read), and no step in
flight reads or writes a free block (``BlockManager.before_free``). On a CPU device the buffer is plain
memory and the copies run at once, synchronously.

Eager saves (``presave_blocks``): whenever blocks are freed, the block manager also saves the next
``presave_blocks`` blocks it would evict (its oldest free cached ones) that the tier lacks, while they stay
cached on the device. Nothing waits for those copies (they overlap the steps that run meanwhile); when
such a block is evicted later it costs no copy, and the forward that overwrites it waits only if its
copy is still running. The engine sets ``presave_blocks`` to one step's token budget in blocks.

Counters (``HostTierStats``): blocks saved and loaded, bytes each way, hits (blocks a prefix lookup found
here), evictions; read by the worker's metrics.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch

from engine.kv_cache import KVCachePool

# Blocks gathered into one staging tensor on the device (bounds its size: 64 blocks of Llama-3-8B in
# bf16 are 128 MiB).
STAGING_BLOCKS = 64


@dataclass
class HostTierStats:
    """Counters since start (monotonic) and the tier's size, in blocks and bytes.

    ``hits``: blocks a prefix lookup took from the tier (each also counts in ``loaded_blocks``);
    ``saved_*``: device → host copies (an evicted block already held costs none); ``loaded_*``: host →
    device; ``evictions``: blocks the tier dropped (least recently used) to make room;
    ``skipped``: evicted blocks not saved because every slot was in use by the same operation's loads.
    """

    capacity_blocks: int
    block_bytes: int
    used_blocks: int = 0
    hits: int = 0
    saved_blocks: int = 0
    loaded_blocks: int = 0
    evictions: int = 0
    skipped: int = 0

    @property
    def saved_bytes(self) -> int:
        return self.saved_blocks * self.block_bytes

    @property
    def loaded_bytes(self) -> int:
        return self.loaded_blocks * self.block_bytes


def host_tier_blocks(num_bytes: int, block_bytes: int) -> int:
    """Slots a budget of ``num_bytes`` holds: ``num_bytes // block_bytes``.

    Raises:
        ValueError: ``block_bytes`` < 1, or a positive budget that holds no block (the message gives both
            sizes).
    """
    if block_bytes < 1:
        raise ValueError(f"block_bytes must be >= 1, got {block_bytes}")
    blocks = num_bytes // block_bytes
    if num_bytes > 0 and blocks < 1:
        raise ValueError(f"host KV tier budget of {num_bytes} bytes holds no block: one block takes "
                         f"{block_bytes} bytes")
    return blocks


def _pin(buffer: torch.Tensor) -> None:
    """Page-lock ``buffer``'s memory for the CUDA driver (``cudaHostRegister``), so copies to and from it
    run asynchronously. Not ``pin_memory=True``: PyTorch's pinned-memory allocator rounds a request up to
    a power of two (40 GiB would lock 64 GiB).

    Raises:
        RuntimeError: the driver refused (the message gives the size and the CUDA error).
    """
    size = buffer.numel() * buffer.element_size()
    error = torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), size, 0)
    if int(error) != 0:
        raise RuntimeError(f"cannot pin {size} bytes of host memory for the host KV tier: CUDA error "
                           f"{error}")


def _unpin(buffer: torch.Tensor) -> None:
    torch.cuda.cudart().cudaHostUnregister(buffer.data_ptr())


def _runs(slots: Sequence[int]) -> Iterator[tuple[int, int, int]]:
    """``(index into slots, first slot, length)`` of each run of consecutive slot numbers, in order."""
    i = 0
    while i < len(slots):
        j = i + 1
        while j < len(slots) and slots[j] == slots[j - 1] + 1:
            j += 1
        yield i, slots[i], j - i
        i = j


class KVHostTier:
    """Host slots for evicted prefix blocks of one ``KVCachePool``, least recently used first.

    Args:
        pool: the device pool whose blocks it saves and restores (its shape and dtype).
        num_blocks: slots (``host_tier_blocks`` of a byte budget); at least 1.
        presave_blocks: how many of the device pool's next blocks to evict are saved ahead (see the
            module docstring; 0: none, every save happens at the eviction).

    Raises:
        ValueError: ``num_blocks`` < 1 or ``presave_blocks`` < 0.
    """

    def __init__(self, pool: KVCachePool, num_blocks: int, presave_blocks: int = 0) -> None:
        if num_blocks < 1:
            raise ValueError(f"a host KV tier needs at least one block, got {num_blocks}")
        if presave_blocks < 0:
            raise ValueError(f"presave_blocks must be >= 0, got {presave_blocks}")
        self.presave_blocks = presave_blocks
        self.pool = pool
        self.num_blocks = num_blocks
        self.cuda = pool.device.type == "cuda"
        shape = (num_blocks, pool.num_layers, 2, pool.block_size, pool.num_kv_heads, pool.head_dim)
        self.host_buffer = torch.empty(shape, dtype=pool.dtype)  # every slot is written before it is read
        if self.cuda:
            _pin(self.host_buffer)
            weakref.finalize(self, _unpin, self.host_buffer)
        self.stats = HostTierStats(num_blocks, pool.bytes_per_block)
        self._slot_of: OrderedDict[int, int] = OrderedDict()  # block hash → slot, least recently used first
        self._tokens: list[tuple[int, ...]] = [() for _ in range(num_blocks)]  # by slot
        self._free_slots: list[int] = list(range(num_blocks - 1, -1, -1))  # popped from the end: 0 first
        self._stream = torch.cuda.Stream(pool.device) if self.cuda else None
        # CUDA events of batches of copies, numbered in the order they were recorded on the side stream
        # (waiting for one waits for every earlier one): the latest the next forward must wait for, and
        # the one that filled each slot
        self._copies = 0
        self._wait: tuple[int, torch.cuda.Event] | None = None
        self._slot_event: list[tuple[int, torch.cuda.Event] | None] = [None] * num_blocks

    # ---- lookups (no copies) -----------------------------------------------------------------------
    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._slot_of

    def __len__(self) -> int:
        return len(self._slot_of)

    def holds(self, block_hash: int, token_ids: tuple[int, ...]) -> bool:
        """True when a slot holds the block with this hash and these token ids."""
        slot = self._slot_of.get(block_hash)
        return slot is not None and self._tokens[slot] == token_ids

    def hashes(self) -> list[int]:
        """Every block hash held (least recently used first)."""
        return list(self._slot_of)

    def touch(self, hashes: Iterable[int]) -> None:
        """Make these held hashes the most recently used (unknown ones are ignored)."""
        for h in hashes:
            if h in self._slot_of:
                self._slot_of.move_to_end(h)

    # ---- copies ------------------------------------------------------------------------------------
    def transfer(self, saves: Sequence[tuple[int, tuple[int, ...], int]],
                 loads: Sequence[tuple[int, int]], *, evicted: bool = True) -> list[int]:
        """Save device blocks, then load held blocks into device blocks; returns the hashes the tier
        dropped to make room.

        Args:
            saves: ``(block hash, token ids, device block id)`` of blocks whose KV is in the block; one
                already held is only made most recently used.
            evicted: the saved blocks are leaving the device pool (the next forward may overwrite them:
                it waits for their copies, also for an earlier copy of a block already held that may
                still run). False: an eager save of blocks that stay cached on the device (the eviction
                frontier, ``BlockManager``), which nothing waits for.
            loads: ``(block hash, device block id)``: copy the held block into the device block (counted
                as a hit). Their slots are not dropped by this call's saves (a save that finds no other
                slot is skipped).

        Raises:
            KeyError: a load of a hash the tier does not hold (nothing copied).
        """
        missing = [h for h, _ in loads if h not in self._slot_of]
        if missing:
            raise KeyError(f"host KV tier holds no block with hash {missing[0]:#x}")
        keep = {h for h, _ in loads}
        self.touch(keep)
        dropped: list[int] = []
        placed: list[tuple[int, int, int]] = []  # (hash, device block, slot)
        for h, tokens, block_id in saves:
            if h in self._slot_of:
                self._slot_of.move_to_end(h)
                earlier = self._slot_event[self._slot_of[h]]
                if evicted and earlier is not None and not earlier[1].query():
                    self._must_wait(earlier)
                continue
            slot = self._free_slot(keep, dropped)
            if slot is None:
                self.stats.skipped += 1
                continue
            self._slot_of[h] = slot
            self._tokens[slot] = tokens
            placed.append((h, block_id, slot))
        # a slot taken again by a later save of this call (a tier smaller than the batch) is copied once
        placed = [(h, block_id, slot) for h, block_id, slot in placed if self._slot_of.get(h) == slot]
        save_ids = [block_id for _, block_id, _ in placed]
        save_slots = [slot for _, _, slot in placed]
        load_ids = [block_id for _, block_id in loads]
        load_slots = [self._slot_of[h] for h, _ in loads]
        if save_ids or load_ids:
            event = self._copy(save_ids, save_slots, load_ids, load_slots)
            if event is not None:
                self._copies += 1
                numbered = (self._copies, event)
                for slot in save_slots:
                    self._slot_event[slot] = numbered
                if evicted or load_ids:
                    self._must_wait(numbered)
        self.stats.saved_blocks += len(save_ids)
        self.stats.loaded_blocks += len(load_ids)
        self.stats.hits += len(load_ids)
        self.stats.used_blocks = len(self._slot_of)
        return dropped

    def _must_wait(self, numbered: tuple[int, torch.cuda.Event]) -> None:
        """The next forward waits for this batch of copies (and so for every earlier one)."""
        if self._wait is None or numbered[0] > self._wait[0]:
            self._wait = numbered

    def _free_slot(self, keep: set[int], dropped: list[int]) -> int | None:
        """A free slot, else the least recently used held one not in ``keep`` (its hash appended to
        ``dropped``), else None."""
        if self._free_slots:
            return self._free_slots.pop()
        victim = next((h for h in self._slot_of if h not in keep), None)
        if victim is None:
            return None
        slot = self._slot_of.pop(victim)
        dropped.append(victim)
        self.stats.evictions += 1
        return slot

    def _copy(self, save_ids: list[int], save_slots: list[int], load_ids: list[int],
              load_slots: list[int]) -> torch.cuda.Event | None:
        """Device blocks ``save_ids`` → host slots ``save_slots``, then host slots ``load_slots`` → device
        blocks ``load_ids`` (on the side stream on CUDA, see the module docstring). Returns the event
        recorded after them on CUDA, None on a CPU (done)."""
        kv, host, dev = self.pool.kv_buffer, self.host_buffer, self.pool.device
        if self._stream is None:
            if save_ids:
                ids = torch.tensor(save_ids, dtype=torch.int64)
                host.index_copy_(0, torch.tensor(save_slots, dtype=torch.int64),
                                 kv.index_select(2, ids).permute(2, 0, 1, 3, 4, 5))
            if load_ids:
                kv.index_copy_(2, torch.tensor(load_ids, dtype=torch.int64),
                               host[torch.tensor(load_slots, dtype=torch.int64)].permute(1, 2, 0, 3, 4, 5))
            return None
        with torch.cuda.device(dev), torch.cuda.stream(self._stream):
            for at in range(0, len(save_ids), STAGING_BLOCKS):
                ids = torch.tensor(save_ids[at:at + STAGING_BLOCKS], dtype=torch.int64,
                                   pin_memory=True).to(dev, non_blocking=True)
                staged = kv.index_select(2, ids).permute(2, 0, 1, 3, 4, 5).contiguous()
                for i, first, n in _runs(save_slots[at:at + STAGING_BLOCKS]):
                    host[first:first + n].copy_(staged[i:i + n], non_blocking=True)
            for at in range(0, len(load_ids), STAGING_BLOCKS):
                chunk = load_slots[at:at + STAGING_BLOCKS]
                staged = torch.empty((len(chunk), *host.shape[1:]), dtype=host.dtype, device=dev)
                for i, first, n in _runs(chunk):
                    staged[i:i + n].copy_(host[first:first + n], non_blocking=True)
                ids = torch.tensor(load_ids[at:at + STAGING_BLOCKS], dtype=torch.int64,
                                   pin_memory=True).to(dev, non_blocking=True)
                kv.index_copy_(2, ids, staged.permute(1, 2, 0, 3, 4, 5))
            event = torch.cuda.Event()
            event.record(self._stream)
        return event

    def before_forward(self) -> None:
        """Make the current stream wait for the copies a forward may depend on: loads, saves of evicted
        blocks, and eager saves still running of blocks evicted since (call before a forward; the host
        does not wait). No-op on a CPU device."""
        if self._wait is not None:
            torch.cuda.current_stream(self.pool.device).wait_event(self._wait[1])
            self._wait = None

    def synchronize(self) -> None:
        """Wait (on the host) until every copy asked for so far is done: before something other than a
        forward writes device blocks the tier may still read. No-op on a CPU device."""
        if self._stream is not None:
            self._stream.synchronize()

    def check(self) -> None:
        """Raise ``AssertionError`` when the slot accounting is broken (a slot both free and held, lost,
        or held twice)."""
        held = list(self._slot_of.values())
        if len(set(held)) != len(held) or set(held) & set(self._free_slots) or (
                len(held) + len(self._free_slots) != self.num_blocks):
            raise AssertionError(f"host KV tier slots: {len(held)} held, {len(self._free_slots)} free of "
                                 f"{self.num_blocks}")
