"""LoopThread after a crash: an exception out of a step or command ends the thread, is handed to
on_crash, and from then on `running` is False and `call` raises TransferError naming it (a command queued
to a dead loop would never run, and whoever waits on it would wait for nothing)."""

from __future__ import annotations

import threading
import time

import pytest

from kvtransfer.loop import LoopThread
from kvtransfer.types import TransferError
from kvtransfer.wakeup import Waker

WAIT = 10.0


def test_crashed_loop_refuses_commands() -> None:
    crashed: list[BaseException] = []
    torn_down = threading.Event()
    waker = Waker()

    def teardown() -> None:
        waker.close()
        torn_down.set()

    loop = LoopThread("crash", "a test loop", lambda: time.sleep(0.001),
                      teardown=teardown, on_crash=crashed.append, waker=waker)
    loop.start()
    ran: list[int] = []
    loop.call(lambda: ran.append(1))
    assert loop.running

    def boom() -> None:
        raise ValueError("boom in a command")

    loop.call(boom)
    assert torn_down.wait(WAIT)
    assert ran == [1] and [repr(e) for e in crashed] == ["ValueError('boom in a command')"]
    assert not loop.running
    stats = loop.stats()
    assert not stats.alive and stats.error == "ValueError('boom in a command')"
    with pytest.raises(TransferError, match="crashed: ValueError"):
        loop.call(lambda: ran.append(2))
    loop.close()
    assert ran == [1]
