"""Wake a loop thread that sleeps in a poll (no torch).

The sender loop sleeps in `zmq.Poller.poll(timeout)` when it has nothing to do; a caller that queues
work (send_layer, a command) must cut that sleep short without the loop busy-spinning. A `Waker` is a
socketpair whose read end sits in the loop's poller: `wake()` writes one byte, but only while the loop
has announced (`sleeping = True`) that it is about to sleep, so a busy loop costs callers no syscall.
The loop must look for work once more after setting `sleeping` (work queued before that line sent no
byte). Python socket objects are used, not raw fds: after close() a late wake() raises OSError
(suppressed) instead of writing into a reused descriptor.
"""

from __future__ import annotations

import contextlib
import socket


class Waker:
    """A thread-safe wake-up channel for one polling loop; register `fileno()` with zmq.POLLIN."""

    def __init__(self) -> None:
        self._rx, self._tx = socket.socketpair()
        self._rx.setblocking(False)
        self._tx.setblocking(False)
        self.fd = self._rx.fileno()
        self.sleeping = False  # set by the loop thread just before it polls with a timeout

    def wake(self) -> None:
        """Interrupt the loop's poll if it sleeps (any thread); never blocks or raises."""
        if self.sleeping:
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
