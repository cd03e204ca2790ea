"""KV cache events: how the set of cached block hashes changed since the last drain (no torch).

The block manager (engine/block_manager.py) reports each hash it registers (``stored``: a full block's
KV is now reusable by a prefix hit) and each it drops (``removed``: the block was evicted or handed out
again); a worker drains the log once per phase and publishes the net change (protocol ``KVEvents``), so a
gateway can mirror the worker's prefix cache, as vLLM's KV events feed llm-d's precise prefix scorer.
Only the net change of each hash since the last drain is kept (the last event wins: a hash stored and
removed in one phase is reported removed), which is exact for a set. Bounded: past ``max_pending``
distinct hashes the log keeps none and says so (``KVCacheChanges.lost``); the reader then sends the
whole set instead (``BlockManager.cached_hashes``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVCacheChanges:
    """The net change since the last drain: hashes now cached (``stored``) and no longer cached
    (``removed``), disjoint, each in first-touched order. ``lost``: more than ``max_pending`` hashes
    changed, none is listed, and the reader must resend the whole set."""

    stored: list[int]
    removed: list[int]
    lost: bool = False

    def __bool__(self) -> bool:
        return bool(self.stored or self.removed or self.lost)


class KVEventLog:
    """Pending cache changes, hash → True (stored) / False (removed), at most ``max_pending`` of them.

    Raises:
        ValueError: ``max_pending`` < 1.
    """

    def __init__(self, max_pending: int) -> None:
        if max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {max_pending}")
        self.max_pending = max_pending
        self._changes: dict[int, bool] = {}
        self._lost = False

    def stored(self, block_hash: int) -> None:
        """A block with this hash entered the prefix cache."""
        self._record(block_hash, True)

    def removed(self, block_hash: int) -> None:
        """The block with this hash left the prefix cache."""
        self._record(block_hash, False)

    def _record(self, block_hash: int, present: bool) -> None:
        if self._lost:
            return
        self._changes[block_hash] = present
        if len(self._changes) > self.max_pending:
            self._changes.clear()
            self._lost = True

    def __len__(self) -> int:
        return len(self._changes)

    def drain(self) -> KVCacheChanges:
        """The changes since the last drain (empty: falsy), and forget them."""
        changes = KVCacheChanges([h for h, present in self._changes.items() if present],
                                 [h for h, present in self._changes.items() if not present], self._lost)
        self._changes, self._lost = {}, False
        return changes
