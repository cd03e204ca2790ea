"""Gateway-side approximate prefix index: which prefill worker has seen which prompt blocks.

Blocks are hashed as chains, like the workers' prefix cache (engine/block_manager.py): hash of block i =
hash((hash of block i-1, tuple(token ids of block i))); only full blocks count. The index remembers the
hashes of prompts routed to each worker (LRU-bounded), so it approximates what the worker has cached.
"""

from __future__ import annotations

from collections import OrderedDict


def block_hashes(token_ids: list[int], block_size: int) -> list[int]:
    """Chained hashes of the full ``block_size``-token blocks of ``token_ids``.

    Raises:
        ValueError: ``block_size`` < 1.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    out: list[int] = []
    prev = 0
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        prev = hash((prev, tuple(token_ids[start:start + block_size])))
        out.append(prev)
    return out


class PrefixIndex:
    """Per-worker LRU sets of block hashes; ``max_blocks`` bounds each worker's set."""

    def __init__(self, max_blocks: int = 100_000) -> None:
        self.max_blocks = max_blocks
        self._by_worker: dict[str, OrderedDict[int, None]] = {}

    def match(self, worker_id: str, hashes: list[int]) -> int:
        """Number of leading blocks of ``hashes`` the worker is believed to hold."""
        known = self._by_worker.get(worker_id)
        if not known:
            return 0
        n = 0
        for h in hashes:
            if h not in known:
                break
            n += 1
        return n

    def insert(self, worker_id: str, hashes: list[int]) -> None:
        """Record that ``worker_id`` computed these blocks (most recent last)."""
        known = self._by_worker.setdefault(worker_id, OrderedDict())
        for h in hashes:
            known[h] = None
            known.move_to_end(h)
        while len(known) > self.max_blocks:
            known.popitem(last=False)

    def remove_worker(self, worker_id: str) -> None:
        """Forget a worker (dead, or restarted with a new epoch: its cache is gone)."""
        self._by_worker.pop(worker_id, None)
