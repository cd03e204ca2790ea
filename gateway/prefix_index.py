"""Gateway-side prefix index: which blocks each worker holds in its prefix cache, from the ``KVEvents`` the
workers publish, plus the blocks this gateway just routed to a worker ("pending": not reported yet).

Blocks are named by the workers' own chained hash (engine/block_hash.py): hash of block i =
``block_hash(hash of block i-1, token ids of block i)``; only full blocks count. Per worker (and its
epoch) the index holds:

* ``cached``: the hashes the worker reported, kept exactly as its ``KVEvents`` say (a snapshot replaces
  them; a delta adds ``stored`` and drops ``removed``). Every gateway receives the same events, so every
  gateway holds the same ``cached`` sets, and a prefix match on them is the same everywhere.
* ``pending``: the hashes of prompts this gateway routed to the worker in the last ``pending_ttl``
  seconds and not yet reported stored, so a burst of requests sharing a new prefix follows the first one
  before its blocks are reported. They are this gateway's alone; the router ranks by ``cached`` first
  (``PrefixMatch``), so pending entries only break ties between workers equally matched on reported
  blocks.

Sequence numbers: each worker numbers its ``KVEvents`` 1, 2, 3 … A delta whose ``seq_no`` is not the one
after the last applied (a message lost, or this gateway started after the worker) makes the worker's
state unknown: ``cached`` is emptied and ``apply`` says to ask for a snapshot (``KVSnapshotRequest``; at
most once per ``resync_interval`` s while none comes). A worker that never sends events has only
``pending`` entries.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

from engine.block_hash import block_hashes
from protocol.messages import KVEvents

__all__ = ["ApplyOutcome", "PrefixIndex", "PrefixMatch", "block_hashes"]

# what ``PrefixIndex.apply`` did: applied a snapshot / a delta; ignored a delta older than the state held
# ("stale"); found a gap and the caller should ask for a snapshot ("gap"); ignored a delta while the state
# is unknown and a snapshot was asked for less than ``resync_interval`` s ago ("waiting")
ApplyOutcome = Literal["snapshot", "delta", "stale", "gap", "waiting"]


class PrefixMatch(NamedTuple):
    """Leading blocks of a prompt a worker holds: ``cached`` as reported by its KV events, ``pending``
    counting this gateway's routed-not-yet-reported blocks too (``pending >= cached``)."""

    cached: int
    pending: int


@dataclass
class _WorkerCache:
    epoch: int = 0
    next_seq_no: int = 0  # the seq_no expected next; 0: no snapshot yet (state unknown)
    cached: set[int] = field(default_factory=set)
    pending: OrderedDict[int, float] = field(default_factory=OrderedDict)  # hash → expiry (clock s)
    snapshot_asked: float = -math.inf  # clock s of the last snapshot request


class PrefixIndex:
    """Per-worker prefix-cache state. ``pending_ttl``: seconds a routed prompt's blocks count as pending;
    ``max_pending``: pending hashes kept per worker (oldest dropped first); ``resync_interval``: seconds
    between two snapshot requests to one worker; ``clock``: seconds, monotonic.

    Raises:
        ValueError: a non-positive ``pending_ttl``, ``max_pending`` or ``resync_interval``.
    """

    def __init__(self, pending_ttl: float = 10.0, max_pending: int = 100_000, resync_interval: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if pending_ttl <= 0 or max_pending < 1 or resync_interval <= 0:
            raise ValueError(f"pending_ttl, max_pending and resync_interval must be > 0, got "
                             f"{pending_ttl}, {max_pending}, {resync_interval}")
        self.pending_ttl, self.max_pending, self.resync_interval = pending_ttl, max_pending, resync_interval
        self.clock = clock
        self._by_worker: dict[str, _WorkerCache] = {}

    def apply(self, events: KVEvents) -> ApplyOutcome:
        """Apply one ``KVEvents`` of a live worker (the caller checked its epoch is the registered one).
        Returns "gap" when the caller should send the worker a ``KVSnapshotRequest`` (a delta whose
        ``seq_no`` is not the next one, or no snapshot yet, and no snapshot asked for in the last
        ``resync_interval`` s); see ``ApplyOutcome`` for the others. Events of a new epoch replace what
        was held of the worker (pending entries of a worker never heard from are kept)."""
        state = self._by_worker.get(events.worker_id)
        if state is None or (state.epoch != events.epoch and state.epoch):
            state = self._by_worker[events.worker_id] = _WorkerCache()
        state.epoch = events.epoch
        if events.snapshot:
            state.cached = set(events.stored)
            state.next_seq_no = events.seq_no + 1
            self._drop_pending(state, events.stored)
            return "snapshot"
        if state.next_seq_no and events.seq_no < state.next_seq_no:
            return "stale"  # older than the state held: already in it
        if events.seq_no != state.next_seq_no:  # a delta missed, or no snapshot yet: state unknown
            state.cached.clear()
            state.next_seq_no = 0
            now = self.clock()
            if now - state.snapshot_asked < self.resync_interval:
                return "waiting"
            state.snapshot_asked = now
            return "gap"
        state.cached.difference_update(events.removed)
        state.cached.update(events.stored)
        state.next_seq_no += 1
        self._drop_pending(state, events.stored)
        return "delta"

    @staticmethod
    def _drop_pending(state: _WorkerCache, stored: list[int]) -> None:
        if state.pending:
            for h in stored:
                state.pending.pop(h, None)

    def match(self, worker_id: str, hashes: list[int]) -> PrefixMatch:
        """Leading blocks of ``hashes`` (a prompt's chain, ``block_hashes``) the worker holds."""
        state = self._by_worker.get(worker_id)
        if state is None:
            return PrefixMatch(0, 0)
        cached = 0
        for h in hashes:
            if h not in state.cached:
                break
            cached += 1
        pending, now = cached, self.clock()
        for h in hashes[cached:]:
            expiry = state.pending.get(h)
            if h not in state.cached and (expiry is None or expiry <= now):
                break
            pending += 1
        return PrefixMatch(cached, pending)

    def expect(self, worker_id: str, hashes: list[int]) -> None:
        """This gateway routed a prompt with these blocks to ``worker_id``: count them as pending for
        ``pending_ttl`` s (those it already reported are skipped)."""
        state = self._by_worker.setdefault(worker_id, _WorkerCache())
        now = self.clock()
        expiry = now + self.pending_ttl
        pending = state.pending
        for h in hashes:
            if h not in state.cached:
                pending[h] = expiry
                pending.move_to_end(h)
        while pending and (len(pending) > self.max_pending or next(iter(pending.values())) <= now):
            pending.popitem(last=False)

    def num_cached(self, worker_id: str) -> int:
        """Blocks the worker reported cached (0 for an unknown worker)."""
        state = self._by_worker.get(worker_id)
        return len(state.cached) if state is not None else 0

    def synced(self, worker_id: str) -> bool:
        """True once a snapshot of the worker's current epoch was applied and no delta went missing since."""
        state = self._by_worker.get(worker_id)
        return state is not None and state.next_seq_no > 0

    def remove_worker(self, worker_id: str) -> None:
        """Forget a worker (dead, or restarted with a new epoch: its cache is gone)."""
        self._by_worker.pop(worker_id, None)
