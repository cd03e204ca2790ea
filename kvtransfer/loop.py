"""The background thread of one KV endpoint (sender or receiver): commands, then a step, until closed.

Each endpoint owns its zmq socket(s) and transport, neither of which is thread safe, and lets only its
loop thread touch them: a public call from another thread queues a command (`call`), which the loop
runs before its next step, and wakes the loop if it sleeps (`Waker`). No torch here.

Life cycle: at most ONE thread per loop, ever. A zmq socket must be used by one thread at a time and a
context terminated once (pyzmq/libzmq: `zmq_ctx_term` on a terminated context fails with EFAULT, "Bad
address"); a second thread would share the first one's sockets, and libzmq asserts (signaler.cpp,
fq.cpp, ctx.cpp) and aborts the process. So `start` on a running loop changes nothing, and `start`
after `close` raises: the sockets and transport were released with the thread and cannot run again.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

from kvtransfer.stats import LoopStats
from kvtransfer.types import TransferError
from kvtransfer.wakeup import Waker, set_timer_slack


class LoopThread:
    """Runs `step()` over and over on one daemon thread named `name`, each time after the commands
    queued by `call`. When the loop ends (close, or an exception out of a step or command) `teardown()`
    runs on the thread; an exception is first handed to `on_crash(exc)` (the endpoint fails its
    requests) and kept for `stats`. `label` names the endpoint in errors ("KVSender p0")."""

    def __init__(self, name: str, label: str, step: Callable[[], None], teardown: Callable[[], None],
                 on_crash: Callable[[BaseException], None], waker: Waker) -> None:
        self.name, self.label = name, label
        self.waker = waker
        self._step, self._teardown, self._on_crash = step, teardown, on_crash
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._life = threading.Lock()  # orders start() against start() and close()
        self._steps = 0

    def start(self, setup: Callable[[], None] | None = None) -> None:
        """Run `setup` (on the caller's thread: e.g. bind the receiver's socket; the loop thread takes
        its sockets over when it starts, which orders memory as pyzmq requires to pass a socket between
        threads), then start the thread. Does nothing if it was started already; raises TransferError
        once close() was called (before or after a start)."""
        with self._life:
            if self._stop.is_set():
                raise TransferError(f"{self.label} was closed: it cannot start again (make a new one)")
            if self._thread is not None:
                return
            if setup is not None:
                setup()
            thread = threading.Thread(target=self._run, name=self.name, daemon=True)
            thread.start()
            self._thread = thread

    @property
    def running(self) -> bool:
        """Started, not closed, and not crashed (an exception ended the thread: `stats().error`)."""
        return self._thread is not None and not self._stop.is_set() and self._error is None

    def call(self, fn: Callable[[], None]) -> None:
        """Queue `fn` for the loop thread (commands run in order, before the next step) and wake the
        loop. Raises TransferError if the loop is not running (never started, closed, or crashed: a
        command queued to a dead loop would never run, and its caller would wait for nothing)."""
        if self._error is not None:
            raise TransferError(f"{self.label} crashed: {self._error!r}")
        if not self.running:
            raise TransferError(f"{self.label} is not running (call start() first)")
        self._commands.put(fn)
        self.waker.wake()

    def has_commands(self) -> bool:
        """Whether a command waits (the loop thread checks before it sleeps)."""
        return not self._commands.empty()

    def close(self, timeout: float = 5.0) -> None:
        """Stop the loop after its current step, let it tear down, and wait up to `timeout` s for the
        thread. Idempotent; a later start() raises TransferError."""
        with self._life:
            self._stop.set()
            thread = self._thread
        self.waker.wake()
        if thread is not None:
            thread.join(timeout)

    def stats(self) -> LoopStats:
        """The loop now (any thread)."""
        t, err = self._thread, self._error
        return LoopStats(alive=t is not None and t.is_alive() and err is None and not self._stop.is_set(),
                         error=None if err is None else repr(err), thread_id=None if t is None else t.ident,
                         steps=self._steps, waiting=self.waker.sleeping, wakes=self.waker.wakes)

    def _run(self) -> None:
        set_timer_slack()  # the loop's naps are tens of µs: the default 50 µs slack would double them
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
            self._on_crash(exc)
        finally:
            self._teardown()
