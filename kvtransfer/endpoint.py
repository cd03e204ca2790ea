"""Common machinery of KVSender and KVReceiver: the background loop thread and request bookkeeping.

Each endpoint runs one daemon thread that owns its zmq socket(s) and transport (neither is thread
safe); public methods only touch state under `self._lock` and queue commands for the thread (one
exception: a sender's hand-off may call its transport while it holds the sender's data lock, which the
loop lets go only while it waits: kvtransfer/post_now.py). Status changes wake `wait()` callers
through a condition variable. No torch here.

Life cycle: at most ONE loop thread per endpoint, ever. A zmq socket must be used by one thread at a
time and a context terminated once (pyzmq/libzmq: `zmq_ctx_term` on a terminated context fails with
EFAULT, "Bad address"); a second loop thread shares the first one's sockets, and libzmq asserts
(signaler.cpp, fq.cpp, ctx.cpp) and aborts the process. So start() on a running endpoint (e.g. on what
TransferBackend.sender()/receiver() returned, already started) changes nothing, and start() after
close() raises: the sockets and transport were released with the loop and cannot run again.
"""

from __future__ import annotations

import queue
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvtransfer.api import KVHandle, LoopStats, TransferConfig, TransferError, TransferStatus
from kvtransfer.wakeup import set_timer_slack


@dataclass
class RequestState:
    """One request on one side. deadline: time.monotonic() seconds. ended_at: time.perf_counter() seconds
    when the status became terminal (CLOCK_MONOTONIC on Linux: comparable between processes of a host),
    None before."""

    handle: KVHandle
    deadline: float
    status: TransferStatus = TransferStatus.PENDING
    reason: str = ""
    layers: set[int] = field(default_factory=set)  # landed (receiver) / queued-or-sent (sender)
    extra: dict[str, Any] = field(default_factory=dict)
    ended_at: float | None = None


class Endpoint:
    """Base of KVSender/KVReceiver: thread, command queue, request table, waits."""

    def __init__(self, config: TransferConfig) -> None:
        self.config = config
        self.epoch = secrets.randbits(62) + 1  # this incarnation; a restart draws a new one
        self._lock = threading.Condition()
        self._requests: dict[str, RequestState] = {}
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._life = threading.Lock()  # orders start() against start() and close() (module docstring)
        self._steps = 0

    # ---- thread -------------------------------------------------------------------------------
    def _start_thread(self, name: str, setup: Callable[[], None] | None = None) -> None:
        """Run `setup` (on the caller's thread: e.g. bind the receiver's socket; the loop thread takes
        its sockets over when it starts, which orders memory as pyzmq requires to pass a socket between
        threads), then start the loop thread `name`. Does nothing if it was started already; raises
        TransferError once close() was called (before or after a start)."""
        with self._life:
            if self._stop.is_set():
                raise TransferError(f"{type(self).__name__} {self.config.worker_id} was closed: it cannot "
                                    "start again (make a new one)")
            if self._thread is not None:
                return
            if setup is not None:
                setup()
            thread = threading.Thread(target=self._run, name=name, daemon=True)
            thread.start()
            self._thread = thread

    def _run(self) -> None:
        set_timer_slack()  # this loop's naps are tens of µs: the default 50 µs slack would double them
        try:
            while not self._stop.is_set():
                while True:
                    try:
                        self._commands.get_nowait()()
                    except queue.Empty:
                        break
                self._step()
                self._steps += 1
        except BaseException as exc:  # reported to every waiter instead of dying silently
            self._error = exc
            with self._lock:
                for st in self._requests.values():
                    if not st.status.is_terminal:
                        self._set(st, TransferStatus.FAILED, f"endpoint loop crashed: {exc!r}")
        finally:
            self._teardown()

    def _step(self) -> None:
        raise NotImplementedError

    def _teardown(self) -> None:
        """Close sockets and transport (runs on the loop thread)."""

    def close(self, timeout: float = 5.0) -> None:
        """Stop the loop thread and release sockets and transport (the loop thread's teardown; waits up
        to `timeout` s for it). Idempotent; a later start() raises TransferError."""
        with self._life:
            self._stop.set()
            thread = self._thread
        self._wake()
        if thread is not None:
            thread.join(timeout)
            self._thread = None

    def _call(self, fn: Callable[[], None]) -> None:
        if self._thread is None or self._stop.is_set():
            raise TransferError("endpoint is not running (call start() first)")
        self._commands.put(fn)
        self._wake()

    def run_in_loop(self, fn: Callable[[], None]) -> None:
        """Queue `fn` to run on the loop thread before its next step (in order with other commands).
        A seam for tests and diagnostics (e.g. stall the loop); raises TransferError if not running."""
        self._call(fn)

    def _loop_stats(self, waker: Any) -> LoopStats:
        t = self._thread
        return LoopStats(alive=t is not None and t.is_alive() and self._error is None,
                         error=None if self._error is None else repr(self._error),
                         thread_id=None if t is None else t.ident, steps=self._steps,
                         waiting=waker.sleeping, wakes=waker.wakes)

    def _wake(self) -> None:
        """Wake the loop if it sleeps waiting for work (a subclass hook; by default it polls)."""

    # ---- request table ------------------------------------------------------------------------
    def _set(self, st: RequestState, status: TransferStatus, reason: str = "") -> None:
        """Change a request's status (caller holds the lock); terminal states are final."""
        if st.status.is_terminal:
            return
        st.status, st.reason = status, reason
        if status.is_terminal:
            st.ended_at = time.perf_counter()
        self._lock.notify_all()

    def _get(self, request_id: str) -> RequestState:
        st = self._requests.get(request_id)
        if st is None:
            raise KeyError(f"unknown request_id {request_id!r}")
        return st

    def status(self, request_id: str) -> TransferStatus:
        """Current TransferStatus; raises KeyError for an unknown (or released) request."""
        with self._lock:
            return self._get(request_id).status

    def reason(self, request_id: str) -> str:
        """Why a request FAILED or was ABORTED ("" otherwise); raises KeyError if unknown."""
        with self._lock:
            return self._get(request_id).reason

    def ended_at(self, request_id: str) -> float | None:
        """time.perf_counter() seconds at which the request became terminal (None while active); raises
        KeyError if unknown."""
        with self._lock:
            return self._get(request_id).ended_at

    def wait(self, request_id: str, timeout: float) -> TransferStatus:
        """Block up to `timeout` seconds until the request is terminal; returns its status then
        (possibly still non-terminal on timeout). Raises KeyError if unknown."""
        end = time.monotonic() + timeout
        with self._lock:
            st = self._get(request_id)
            while not st.status.is_terminal and time.monotonic() < end:
                self._lock.wait(min(0.05, max(0.0, end - time.monotonic())))
            return st.status

    def wait_until(self, pred: Callable[[], bool], timeout: float) -> bool:
        """Block up to `timeout` seconds until `pred()` (evaluated under the lock) holds."""
        end = time.monotonic() + timeout
        with self._lock:
            while not pred():
                if time.monotonic() >= end:
                    return False
                self._lock.wait(min(0.05, max(0.0, end - time.monotonic())))
            return True

    def pending(self) -> list[str]:
        """Request ids still tracked (not yet released)."""
        with self._lock:
            return list(self._requests)

    def check_no_leaks(self) -> None:
        """Raise AssertionError if any request is still tracked (not released)."""
        with self._lock:
            assert not self._requests, f"{type(self).__name__} still tracks {sorted(self._requests)}"
