"""Per-request state of a sender and of a receiver, and the locked table that holds them (no torch).

`RequestTable` is each endpoint's one lock (a condition variable) and its requests by id: the loop
thread and the callers' threads change a request only under `table.lock`; status changes wake the
threads blocked in `wait`/`wait_until`. The state classes are slotted dataclasses with typed fields:
`SendPlan` (frozen) is what `add_request` computed once; `SendState` and `RecvState` are what changes.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Generic, TypeVar

from kvtransfer.runs import JointRun, Piece
from kvtransfer.types import KVHandle, TransferStatus

if TYPE_CHECKING:
    import torch


@dataclass(slots=True, eq=False)
class RequestState:
    """One request on one side. deadline: monotonic seconds (the endpoint's clock). ended_at:
    time.perf_counter() seconds when the status became terminal (CLOCK_MONOTONIC on Linux: comparable
    between processes of a host), None before. layers: landed (receiver) / handed off (sender)."""

    handle: KVHandle
    deadline: float
    status: TransferStatus = TransferStatus.PENDING
    reason: str = ""
    layers: set[int] = field(default_factory=set)
    ended_at: float | None = None

    @property
    def request_id(self) -> str:
        """The request's id (its handle's)."""
        return self.handle.request_id


@dataclass(frozen=True, slots=True)
class SendPlan:
    """How a request's KV is read and written, fixed at add_request.

    src: the source block ids as int64 `[n]` on kv_buffer's device (the gather's index); src_ids: the
    same ids in token order; runs: joint runs of source and destination blocks if the request goes the
    direct path (straight from kv_buffer), None if it is gathered into staging; pieces: the direct
    path's (source byte offset, destination byte offset, bytes) of every layer, [] when staged; cuts:
    source cuts carried by its direct notices; dst_runs: destination runs (merge_runs) for staged
    pieces; key: base of its two-sided tags (runs.make_tag)."""

    src: torch.Tensor
    src_ids: tuple[int, ...]
    runs: list[JointRun] | None
    pieces: list[list[Piece]]
    cuts: tuple[int, ...]
    dst_runs: list[tuple[int, int, int]]
    key: int

    @property
    def direct(self) -> bool:
        """Written straight from kv_buffer (no staging slot)."""
        return self.runs is not None


@dataclass(slots=True, eq=False)
class SendState(RequestState):
    """A request on the sender. Its protocol with the receiver: begin_sent (our Begin went out to the
    incarnation its handle names), answered (that Begin was answered, or can no longer be: the
    incarnation is gone), begun (accepted: the receiver claimed it, so a write may land). inflight:
    request-layers gathered (or queued into the pipeline, direct) and not yet completed; its Stopped
    fence and release() wait for 0. fence: None, or the `aborted` flag of the Stopped (begun) or
    Withdraw (never begun) still to send. prep: the transport's prepared form of its direct pieces
    (SendTransport.prepare_layers), once begun. first_posted_at / last_written_at: time.perf_counter() s
    just after its first write was posted and when its last completed write was seen done (None before).
    """

    plan: SendPlan = field(kw_only=True)
    begin_sent: bool = False
    answered: bool = False
    begun: bool = False
    inflight: int = 0
    fence: bool | None = None
    prep: list[object] | None = None
    first_posted_at: float | None = None
    last_written_at: float | None = None

    def fence_later(self, aborted: bool) -> None:
        """Send Stopped (we write nothing more) once no write of the request is in flight, or Withdraw
        if its Begin never went out (table lock held)."""
        self.fence = aborted


@dataclass(slots=True, eq=False)
class RecvState(RequestState):
    """A request on the receiver. sender: zmq identity of the sender whose Begin claimed it (None: not
    claimed); stopped: that sender writes nothing more (Stopped, or every layer landed); gone: that
    sender was dropped (lost, restarted, drop_sender), so its blocks are held until the deadline."""

    sender: bytes | None = None
    stopped: bool = False
    gone: bool = False


S = TypeVar("S", bound=RequestState)


class RequestTable(Generic[S]):
    """The requests of one endpoint by id, and `lock`, the condition variable that guards them and
    every state in them. `label` names the endpoint in errors."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.lock = threading.Condition()
        self._by_id: dict[str, S] = {}

    def __iter__(self) -> Iterator[S]:
        """The states (lock held; do not add or remove while iterating)."""
        return iter(self._by_id.values())

    def __len__(self) -> int:
        return len(self._by_id)

    def add(self, st: S, duplicate: str) -> None:
        """Track `st`; raises ValueError(`duplicate`) if its id is tracked already (lock held)."""
        if st.request_id in self._by_id:
            raise ValueError(duplicate)
        self._by_id[st.request_id] = st

    def find(self, request_id: str | None) -> S | None:
        """The state of `request_id`, None if not tracked (lock held)."""
        return None if request_id is None else self._by_id.get(request_id)

    def get(self, request_id: str) -> S:
        """The state of `request_id` (lock held); raises KeyError for an unknown (or released) one."""
        st = self._by_id.get(request_id)
        if st is None:
            raise KeyError(f"unknown request_id {request_id!r}")
        return st

    def remove(self, request_id: str) -> None:
        """Forget `request_id` (lock held); nothing if unknown."""
        self._by_id.pop(request_id, None)

    def set_status(self, st: S, status: TransferStatus, reason: str = "") -> None:
        """Change a request's status (lock held); terminal states are final. Wakes waiters."""
        if st.status.is_terminal:
            return
        st.status, st.reason = status, reason
        if status.is_terminal:
            st.ended_at = time.perf_counter()
        self.lock.notify_all()

    def status(self, request_id: str) -> TransferStatus:
        """Current status; raises KeyError for an unknown (or released) request."""
        with self.lock:
            return self.get(request_id).status

    def reason(self, request_id: str) -> str:
        """Why a request FAILED or was ABORTED ("" otherwise); raises KeyError if unknown."""
        with self.lock:
            return self.get(request_id).reason

    def ended_at(self, request_id: str) -> float | None:
        """time.perf_counter() seconds at which the request became terminal (None while active); raises
        KeyError if unknown."""
        with self.lock:
            return self.get(request_id).ended_at

    def wait(self, request_id: str, timeout: float) -> TransferStatus:
        """Block up to `timeout` seconds until the request is terminal; returns its status then
        (possibly still non-terminal on timeout). Raises KeyError if unknown."""
        end = time.monotonic() + timeout
        with self.lock:
            st = self.get(request_id)
            while not st.status.is_terminal and time.monotonic() < end:
                self.lock.wait(min(0.05, max(0.0, end - time.monotonic())))
            return st.status

    def wait_until(self, pred: Callable[[], bool], timeout: float) -> bool:
        """Block up to `timeout` seconds until `pred()` (evaluated under the lock) holds."""
        end = time.monotonic() + timeout
        with self.lock:
            while not pred():
                if time.monotonic() >= end:
                    return False
                self.lock.wait(min(0.05, max(0.0, end - time.monotonic())))
            return True

    def pending(self) -> list[str]:
        """Request ids still tracked (not yet released)."""
        with self.lock:
            return list(self._by_id)

    def check_no_leaks(self) -> None:
        """Raise AssertionError if any request is still tracked (not released)."""
        with self.lock:
            assert not self._by_id, f"{self.label} still tracks {sorted(self._by_id)}"
