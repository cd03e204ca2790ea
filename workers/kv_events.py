"""A worker's prefix-cache change feed for its gateways: numbered ``KVEvents`` deltas, or a snapshot of the
whole cache when one is due.

The engine's block manager logs every block hash entering or leaving its prefix cache
(``BlockManager.record_events``); the worker loop drains that log once per phase into one ``KVEvents``
(``seq_no`` counting up from 1 per worker incarnation). A snapshot (every cached hash, pending changes
dropped) replaces the delta after a gateway accepted the worker's registration or asked for one
(``KVSnapshotRequest``), and when the log overflowed between drains: a gateway that missed changes
starts over from the whole set. The gateway side: gateway/prefix_index.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from protocol.messages import KVEvents

if TYPE_CHECKING:
    from engine.block_manager import BlockManager


class KVEventFeed:
    """The ``KVEvents`` of one worker incarnation (``worker_id``, ``epoch``) over ``block_manager``'s
    prefix cache; starts the block manager's change log."""

    def __init__(self, worker_id: str, epoch: int, block_manager: BlockManager) -> None:
        self.worker_id, self.epoch = worker_id, epoch
        self._block_manager = block_manager
        self._log = block_manager.record_events()
        self._seq_no = 0  # of the last KVEvents built
        self._snapshot_due = False

    def want_snapshot(self) -> None:
        """Make the next ``next`` a snapshot of the whole prefix cache."""
        self._snapshot_due = True

    def next(self) -> KVEvents | None:
        """The prefix-cache changes since the last call as one ``KVEvents``, or None when nothing changed;
        a snapshot instead when one is due (``want_snapshot``) or the change log overflowed. Each message
        built takes the next ``seq_no``."""
        changes = self._log.drain()
        if self._snapshot_due or changes.lost:
            self._snapshot_due = False
            self._seq_no += 1
            return KVEvents(worker_id=self.worker_id, epoch=self.epoch, seq_no=self._seq_no,
                            stored=self._block_manager.cached_hashes(), snapshot=True)
        if not changes:
            return None
        self._seq_no += 1
        return KVEvents(worker_id=self.worker_id, epoch=self.epoch, seq_no=self._seq_no,
                        stored=changes.stored, removed=changes.removed)
