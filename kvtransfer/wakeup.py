"""Wake a loop thread that sleeps in a poll, and nap briefly until woken (no torch).

The sender loop sleeps in `zmq.Poller.poll(timeout)` when it has nothing to do; a caller that queues
work (send_layer, a command) must cut that sleep short without the loop busy-spinning. A `Waker` is a
socketpair whose read end sits in the loop's poller: `wake()` writes one byte, but only while the loop
has announced (`sleeping = True`) that it is about to sleep, so a busy loop costs callers no syscall.
The loop must look for work once more after setting `sleeping` (work queued before that line sent no
byte). Python socket objects are used, not raw fds: after close() a late wake() raises OSError
(suppressed) instead of writing into a reused descriptor.

`nap` is the short wait of a loop that has work in flight it can only poll for (CUDA events, write
completions): zmq's poll counts its timeout in whole milliseconds, so it waits in `select.select`
(microsecond timeout, GIL released) on the waker and the zmq sockets' `zmq.FD`s instead. That fd is
edge-triggered (man zmq_getsockopt, ZMQ_FD): it signals a change of the socket's state, not "a message
is queued", so `zmq.EVENTS` is read first (which also resets the fd) and the nap is skipped when a
message is already waiting.

Linux adds a timer slack (50 µs by default, man 2 prctl, PR_SET_TIMERSLACK) to every timed sleep of a
thread, so a 50 µs nap lasts ~100-150 µs. `set_timer_slack` lowers it for the calling (loop) thread.

`nap_until` strings naps together for a loop that must also look at something no fd signals between
them (the receiver's `transport.poll()`: NIXL notifications, ucx progress), up to a cap after which the
loop's periodic work (heartbeats, deadlines) is due.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import select
import socket
import sys
import time
from collections.abc import Callable

import zmq

PR_SET_TIMERSLACK = 29  # linux/prctl.h
LOOP_TIMER_SLACK_NS = 1000


def set_timer_slack(slack_ns: int = LOOP_TIMER_SLACK_NS) -> bool:
    """Set the calling thread's timer slack to `slack_ns` nanoseconds (Linux `prctl(PR_SET_TIMERSLACK)`;
    applies to this thread's select()/sleep timeouts only). Returns False (and changes nothing) off Linux
    or when the call fails. Raises ValueError for `slack_ns` < 1 (0 would restore the default)."""
    if slack_ns < 1:
        raise ValueError(f"timer slack must be >= 1 ns, got {slack_ns}")
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return int(libc.prctl(PR_SET_TIMERSLACK, ctypes.c_ulong(slack_ns), 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


class Waker:
    """A thread-safe wake-up channel for one polling loop; register `fileno()` with zmq.POLLIN."""

    def __init__(self) -> None:
        self._rx, self._tx = socket.socketpair()
        self._rx.setblocking(False)
        self._tx.setblocking(False)
        self.fd = self._rx.fileno()
        self.sleeping = False  # set by the loop thread just before it polls with a timeout
        self.wakes = 0  # wake-up bytes sent so far (stats)

    def wake(self) -> None:
        """Interrupt the loop's poll if it sleeps (any thread); never blocks or raises."""
        if self.sleeping:
            self.wakes += 1
            with contextlib.suppress(OSError):  # buffer full (a byte is pending anyway) or closed
                self._tx.send(b"\0")

    def drain(self) -> None:
        """Consume pending wake-up bytes (loop thread, after its poll reported `fd` readable)."""
        with contextlib.suppress(OSError):
            while self._rx.recv(4096):
                pass

    def close(self) -> None:
        """Close both ends (loop thread, at teardown)."""
        self._rx.close()
        self._tx.close()


def nap(waker: Waker, socks: list[zmq.Socket], timeout_s: float) -> bool:
    """Sleep up to `timeout_s` seconds with the GIL released, until `waker` is woken or one of `socks`
    has a message (see the module docstring). Returns True if one of them is readable (or may be: the
    caller then polls them without waiting), False on timeout. Set `waker.sleeping` before (and look
    for queued work once more after setting it). Where a descriptor is too large for select()
    (>= FD_SETSIZE, 1024), it sleeps the whole `timeout_s` (the caller's bound on the added latency)."""
    fds = [waker.fd]
    for sock in socks:
        if int(sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
            return True
        fds.append(int(sock.getsockopt(zmq.FD)))
    try:
        readable, _, _ = select.select(fds, [], [], timeout_s)
    except ValueError:  # "filedescriptor out of range in select()"
        time.sleep(timeout_s)
        return True
    return bool(readable)


def nap_until(waker: Waker, socks: list[zmq.Socket], nap_s: float, cap_s: float,
              look: Callable[[], bool]) -> bool:
    """Nap (`nap`) up to `nap_s` seconds at a time, calling `look()` after each nap that timed out, for
    at most about `cap_s` seconds in all (monotonic clock). Returns True as soon as `waker` or one of
    `socks` is readable (the caller reads them), False once `look()` returned True (it found
    something) or `cap_s` passed. What `look()` watches is thus seen at most `nap_s` (plus the
    kernel's timer slack) after it happens. Same preconditions as `nap` (`waker.sleeping` set)."""
    end = time.monotonic() + cap_s
    while True:
        if nap(waker, socks, min(nap_s, cap_s)):
            return True
        if look() or time.monotonic() >= end:
            return False
