"""The sender loop wakes at once when work arrives (Waker), and a direct request's writes are
precomputed per layer (runs.direct_layers, transport.prepare) so a post only concatenates lists."""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import sys
import threading
import time

import pytest
import zmq

import kvtransfer.send_wait as send_wait_mod
from kvtransfer import TransferError, TransferStatus, get_transfer_backend
from kvtransfer.loop import LoopThread
from kvtransfer.runs import direct_layers, direct_pieces, joint_runs
from kvtransfer.staging import layout_of
from kvtransfer.transports.base import KV
from kvtransfer.wakeup import LOOP_TIMER_SLACK_NS, Waker, set_timer_slack
from tests.kvtransfer.helpers import LAYERS, assert_landed, config, make_kv, release_both

S = TransferStatus
WAIT = 5.0
LONG_IDLE_MS = 60_000  # an idle poll this long would fail every wait below unless a wake cut it short


def test_waker_interrupts_a_sleeping_poll_only():
    w = Waker()
    poller = zmq.Poller()
    poller.register(w.fd, zmq.POLLIN)
    w.wake()  # loop not sleeping: no byte, nothing to poll
    assert poller.poll(0) == []
    w.sleeping = True
    threading.Timer(0.05, w.wake).start()
    t = time.monotonic()
    assert dict(poller.poll(LONG_IDLE_MS)) == {w.fd: zmq.POLLIN}
    assert time.monotonic() - t < WAIT
    w.drain()
    assert poller.poll(0) == []  # drained
    w.close()
    w.wake()  # after close: silently nothing (no write into a reused descriptor)


def _quiet_pair(monkeypatch):
    """A loopback pair whose loops would sleep LONG_IDLE_MS (heartbeats every 30 s) unless woken."""
    monkeypatch.setattr(send_wait_mod, "IDLE_POLL_MS", LONG_IDLE_MS)
    backend = get_transfer_backend("loopback")
    src, dst = make_kv(3), make_kv(None)
    slow = dataclasses.replace(config("p0", "loopback"), heartbeat_interval_s=30.0, peer_timeout_s=60.0)
    tx = backend.sender(slow, src)
    rx = backend.receiver(config("d0", "loopback"), dst)
    return tx, rx, src, dst


def test_command_and_send_layer_wake_the_idle_sender(monkeypatch):
    tx, rx, src, dst = _quiet_pair(monkeypatch)
    try:
        assert tx.wait_until(lambda: tx.stats().loop.waiting, WAIT)  # idle: asleep in its poll
        ran = threading.Event()
        tx.run_in_loop(ran.set)
        assert ran.wait(WAIT)  # a command wakes it (not the 60 s idle timeout)
        tx.add_request(rx.expect("a", [4, 5, 6]), [10, 11, 12])
        assert tx.wait_until(lambda: tx.snapshot("a").answered, WAIT)
        assert tx.wait_until(lambda: tx.stats().loop.waiting, WAIT)  # idle again, Begin answered
        t = time.monotonic()
        for layer in range(LAYERS):
            tx.send_layer("a", layer)
        assert tx.wait("a", WAIT) is S.DONE and rx.wait("a", WAIT) is S.DONE, rx.reason("a")
        assert time.monotonic() - t < WAIT
        assert_landed(src, [10, 11, 12], dst, [4, 5, 6])
        release_both(tx, rx, "a", WAIT, leaks=True)
    finally:
        tx.close()
        rx.close()


def test_send_layer_on_a_stopped_sender_raises_and_marks_nothing(monkeypatch):
    tx, rx, _, _ = _quiet_pair(monkeypatch)
    try:
        tx.add_request(rx.expect("a", [1, 2]), [3, 4])
        tx.close()
        with pytest.raises(TransferError, match="not running"):
            tx.send_layer("a", 0)
        assert not tx.snapshot("a").layers and tx.stats().queued == 0
    finally:
        tx.close()
        rx.close()


def test_direct_layers_equal_direct_pieces_of_every_layer():
    src_layout = layout_of(make_kv(None, num_blocks=40))
    dst_layout = layout_of(make_kv(None, num_blocks=24))  # other block count: other layer stride
    runs = joint_runs([3, 4, 5, 9, 10], [20, 21, 7, 8, 9])
    per_layer = direct_layers(src_layout, dst_layout, runs)
    assert len(per_layer) == LAYERS
    for layer in range(LAYERS):
        assert per_layer[layer] == direct_pieces(src_layout, dst_layout, runs, layer)


def test_direct_request_is_prepared_once_begun():
    backend = get_transfer_backend("loopback")
    tx = backend.sender(config("p0", "loopback"), make_kv(5))
    rx = backend.receiver(config("d0", "loopback"), make_kv(None))
    try:
        prepared: list[list[object]] = []
        prepare = tx.transport.prepare_layers

        def recording(peer: str, layers: list[object]) -> list[object]:
            prepared.append(prepare(peer, layers))
            return prepared[-1]
        tx.transport.prepare_layers = recording
        handle = rx.expect("a", [8, 9, 2])
        tx.add_request(handle, [0, 1, 2])
        assert tx.wait_until(lambda: tx.snapshot("a").prepared, WAIT)
        runs = joint_runs([0, 1, 2], [8, 9, 2])
        want = [[(KV, *p) for p in direct_pieces(tx.layout, handle.layout, runs, la)] for la in range(LAYERS)]
        assert prepared == [want]  # once; loopback's prepare: the pieces themselves
        tx.abort("a")
        assert rx.wait("a", WAIT) is S.ABORTED
        release_both(tx, rx, "a", WAIT, leaks=True)
    finally:
        tx.close()
        rx.close()


def _slack_ns() -> int:
    """The calling thread's timer slack (prctl PR_GET_TIMERSLACK)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    return int(libc.prctl(30, 0, 0, 0, 0))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_TIMERSLACK is Linux-only")
def test_loop_threads_run_with_a_small_timer_slack():
    """set_timer_slack changes the calling thread's slack only (read back with PR_GET_TIMERSLACK); an
    endpoint's loop thread sets it when it starts, so a 50 µs nap is not stretched by the kernel's default
    50 µs slack."""
    seen: dict[str, int] = {}

    def probe() -> None:
        seen["before"] = _slack_ns()
        seen["ok"] = int(set_timer_slack(2000))
        seen["after"] = _slack_ns()

    t = threading.Thread(target=probe)
    t.start()
    t.join()
    assert seen == {"before": seen["before"], "ok": 1, "after": 2000} and seen["before"] != 2000
    assert _slack_ns() == seen["before"]  # this thread untouched
    with pytest.raises(ValueError, match=">= 1 ns"):
        set_timer_slack(0)
    stepped = threading.Event()

    def step() -> None:
        seen.setdefault("loop", _slack_ns())
        stepped.set()
        time.sleep(0.001)
    waker = Waker()
    loop = LoopThread("one-step", "a test loop", step, teardown=waker.close, on_crash=lambda exc: None,
                      waker=waker)
    loop.start()
    assert stepped.wait(WAIT)
    loop.close()
    assert seen["loop"] == LOOP_TIMER_SLACK_NS  # set by LoopThread before the first step
