"""Worker registry: registration with epochs, heartbeats, liveness, pairing compatibility (no torch).

A worker is live while its last message is younger than ``heartbeat_timeout`` seconds; a live worker is
routable unless its load says it is draining (it was asked to stop and finishes what it holds). A registration
with a higher epoch for a known ``worker_id`` replaces the old entry (the caller fails the old entry's
requests); the same epoch again (a worker answering several ``ReRegister`` messages) only refreshes it;
a lower epoch is refused as stale.

The registry also remembers, for ``/v1/status`` (and ``/ready``'s reason), the workers it lost
(``dropped``: why and when, until they register again) and the registrations it refused (``refused``),
the most recent ``MAX_REMEMBERED`` of each.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from kvtransfer.compat import mismatches
from protocol.messages import RegisterWorker, Role, WorkerLoad


@dataclass
class WorkerEntry:
    """One registered worker: its registration, zmq routing identity, last-seen time and load."""

    info: RegisterWorker
    identity: bytes
    last_seen: float
    load: WorkerLoad
    requests: set[str] = field(default_factory=set)  # request ids this worker holds state for
    # request ids routed to this worker whose first message to it waits on another worker: a disaggregated
    # request's prefill worker while its decode worker reserves the KV blocks
    unsent: set[str] = field(default_factory=set)

    @property
    def worker_id(self) -> str:
        """The worker's id."""
        return self.info.worker_id

    @property
    def role(self) -> Role:
        """prefill, decode or colocated."""
        return self.info.role

    def load_score(self) -> int:
        """Sequences queued or running, including requests routed since the last heartbeat and those
        routed here whose first message waits on another worker (``unsent``): requests that arrive together
        count against the prefill worker they were routed to from the moment they are routed."""
        return max(self.load.num_waiting + self.load.num_running, len(self.requests) + len(self.unsent))


MAX_REMEMBERED = 32  # dropped and refused workers kept for the status view, each


@dataclass(frozen=True)
class LostWorker:
    """A worker out of routing: dropped (lost, left, unreachable) or refused at registration.
    ``at`` is the wall-clock time (Unix seconds) it happened; ``address`` its KV transfer address."""

    worker_id: str
    role: Role
    epoch: int
    address: str
    reason: str
    at: float


def pairing_mismatch(prefill: RegisterWorker, decode: RegisterWorker) -> str | None:
    """Why a prefill/decode pair cannot exchange KV, naming each differing field of their KV pairing
    records with the prefill worker's value first (kvtransfer.compat.mismatches, the check their KV
    handshake makes too), or None if it can."""
    diffs = mismatches(prefill.compat, decode.compat)
    if not diffs:
        return None
    return f"{prefill.worker_id} / {decode.worker_id}: " + ", ".join(diffs)


class WorkerRegistry:
    """Live workers by id. ``clock`` returns seconds (monotonic); injectable for tests."""

    def __init__(self, heartbeat_timeout: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.heartbeat_timeout = heartbeat_timeout
        self._clock = clock
        self._workers: dict[str, WorkerEntry] = {}
        self.dropped: OrderedDict[str, LostWorker] = OrderedDict()  # by worker id, oldest first
        self.refused: OrderedDict[str, LostWorker] = OrderedDict()

    def register(self, msg: RegisterWorker, identity: bytes) -> tuple[WorkerEntry | None, str]:
        """Add or replace a worker. Returns (the replaced old entry or None, refusal reason or "").

        A refused registration (stale epoch) leaves the registry unchanged.
        """
        old = self._workers.get(msg.worker_id)
        if old is not None and msg.epoch < old.info.epoch:
            reason = f"stale epoch {msg.epoch} < registered {old.info.epoch} for {msg.worker_id}"
            _remember(self.refused, LostWorker(msg.worker_id, msg.role, msg.epoch, msg.transfer_address,
                                               reason, time.time()))
            return None, reason
        self.dropped.pop(msg.worker_id, None)
        self.refused.pop(msg.worker_id, None)
        if old is not None and msg.epoch == old.info.epoch:  # a repeated ReRegister answer: idempotent
            old.identity, old.last_seen = identity, self._clock()
            return None, ""
        self._workers[msg.worker_id] = WorkerEntry(msg, identity, self._clock(), msg.load)
        return old, ""

    def record_dropped(self, entry: WorkerEntry, reason: str) -> None:
        """Remember that ``entry`` (already removed) left routing for ``reason``, now."""
        _remember(self.dropped, LostWorker(entry.worker_id, entry.role, entry.info.epoch,
                                           entry.info.transfer_address, reason, time.time()))

    def by_identity(self, identity: bytes) -> WorkerEntry | None:
        """The registered worker whose zmq routing identity is ``identity``, None if none has it."""
        return next((e for e in self._workers.values() if e.identity == identity), None)

    def remove_identity(self, identity: bytes) -> WorkerEntry | None:
        """Drop the worker whose zmq routing identity is ``identity`` (its connection is gone); returns
        the dropped entry, None if no registered worker has it."""
        entry = self.by_identity(identity)
        if entry is None:
            return None
        return self._workers.pop(entry.worker_id)

    def touch(self, worker_id: str, epoch: int, load: WorkerLoad | None = None) -> WorkerEntry | None:
        """Record a sign of life (and load) from ``worker_id``/``epoch``; None if unknown or stale."""
        entry = self._workers.get(worker_id)
        if entry is None or entry.info.epoch != epoch:
            return None
        entry.last_seen = self._clock()
        if load is not None:
            entry.load = load
        return entry

    def remove(self, worker_id: str, epoch: int | None = None) -> WorkerEntry | None:
        """Drop a worker (only if ``epoch`` matches, when given); returns the dropped entry."""
        entry = self._workers.get(worker_id)
        if entry is None or (epoch is not None and entry.info.epoch != epoch):
            return None
        return self._workers.pop(worker_id)

    def knows(self, worker_id: str, epoch: int) -> bool:
        """Whether ``worker_id`` is registered with exactly this ``epoch``."""
        entry = self._workers.get(worker_id)
        return entry is not None and entry.info.epoch == epoch

    def reap(self) -> list[WorkerEntry]:
        """Remove and return every worker silent for longer than ``heartbeat_timeout``."""
        now = self._clock()
        dead = [e for e in self._workers.values() if now - e.last_seen > self.heartbeat_timeout]
        for entry in dead:
            del self._workers[entry.worker_id]
        return dead

    def get(self, worker_id: str) -> WorkerEntry | None:
        """The entry of ``worker_id`` or None."""
        return self._workers.get(worker_id)

    def live(self, role: Role | None = None) -> list[WorkerEntry]:
        """Registered workers (of ``role``), in registration order, draining ones included."""
        return [e for e in self._workers.values() if role is None or e.role == role]

    def routable(self, role: Role | None = None) -> list[WorkerEntry]:
        """The registered workers (of ``role``) a new request may be routed to: those not draining
        (``WorkerLoad.draining``: asked to stop, finishing what they hold), in registration order."""
        return [e for e in self.live(role) if not e.load.draining]

    def age(self, entry: WorkerEntry) -> float:
        """Seconds since ``entry``'s last message."""
        return self._clock() - entry.last_seen

    def first_model_path(self) -> str | None:
        """The ``model_path`` of some registered worker (for loading the tokenizer)."""
        return next((e.info.model_path for e in self._workers.values() if e.info.model_path), None)


def _remember(records: OrderedDict[str, LostWorker], record: LostWorker) -> None:
    records.pop(record.worker_id, None)
    records[record.worker_id] = record
    while len(records) > MAX_REMEMBERED:
        records.popitem(last=False)
