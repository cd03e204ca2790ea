"""The sender loop naps with the GIL released while it only waits: request-layers in flight
whose writes have not completed, or whose CUDA events have not, cost it a step per `busy_wait_s`, not
a step back to back; a Done, a command or a send_layer the pipeline has room for ends the nap at once;
a send_layer into a full pipeline sends no wake-up."""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import zmq

import kvtransfer.send_wait as send_wait_mod
from kvtransfer import TransferConfig, TransferStatus, get_transfer_backend
from kvtransfer.events import EventPool
from kvtransfer.transports.loopback import LoopbackSendTransport
from kvtransfer.wakeup import nap
from tests.kvtransfer.helpers import (
    LAYERS,
    assert_landed,
    config,
    loop_cost,
    make_kv,
    release_both,
    sender_with,
    waker_and_pair,
)

S = TransferStatus
WAIT = 5.0
WINDOW = 0.3  # seconds over which the waiting loop's steps and CPU time are counted
NAP = 2e-3  # busy_wait_s of the CPU/step tests


class GatedTransport(LoopbackSendTransport):
    """Loopback whose writes posted while `hold` is true stay in flight until `gate` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.hold = False
        self.gate = threading.Event()

    def post(self, peer: str, pieces: list[tuple[int, int, int, int]], notice: bytes, tag: int) -> object:
        if not self.hold:
            return super().post(peer, pieces, notice, tag)
        self.deliver.clear()  # loopback then delivers at the first test() that finds it set
        try:
            write = super().post(peer, pieces, notice, tag)
        finally:
            self.deliver.set()
        write.held = True  # type: ignore[attr-defined]
        return write

    def test(self, handle: object) -> bool:
        if getattr(handle, "held", False) and not self.gate.is_set():
            return False
        return super().test(handle)


class GatedEvent:
    """Stands for send_layer's torch.cuda.Event on CPU: complete once `gate` is set."""

    gate = threading.Event()

    def record(self, stream: object) -> None:
        pass

    def query(self) -> bool:
        return self.gate.is_set()


def _pair(busy_wait_s: float, depth: int = LAYERS, quiet: bool = False,
          events: EventPool | None = None) -> tuple[Any, Any, Any, Any]:
    """(sender over a GatedTransport, loopback receiver, src, dst); `quiet`: heartbeats every 30 s, so
    nothing but the test's own actions can end a nap; `events`: the sender's event pool."""
    cfg = config("p0", "loopback", busy_wait_s=busy_wait_s, max_inflight_layers=depth)
    rcfg = config("d0", "loopback")
    if quiet:
        cfg = dataclasses.replace(cfg, heartbeat_interval_s=30.0, peer_timeout_s=60.0)
        rcfg = dataclasses.replace(rcfg, heartbeat_interval_s=30.0, peer_timeout_s=60.0)
    src, dst = make_kv(7), make_kv(None)
    tx = sender_with(cfg, src, GatedTransport(), events=events)
    rx = get_transfer_backend("loopback").receiver(rcfg, dst)
    return tx, rx, src, dst


def _steps(tx: Any) -> Callable[[], int]:
    """The loop's step count, read from its stats."""
    return lambda: tx.stats().loop.steps


def _begin(tx: Any, rx: Any, rid: str, src_ids: list[int], dst_ids: list[int]) -> None:
    tx.add_request(rx.expect(rid, dst_ids), src_ids)
    assert tx.wait_until(lambda: tx.snapshot(rid).answered, WAIT)


def _posted(tx: Any, n: int) -> bool:
    st = tx.stats()
    return st.queued == 0 and st.in_pipeline == n and st.writing == n


def _napping(tx: Any) -> bool:
    return tx.stats().loop.waiting


def test_loop_naps_while_its_writes_are_in_flight():
    tx, rx, src, dst = _pair(NAP)
    transport = tx.transport
    assert isinstance(transport, GatedTransport)
    try:
        _begin(tx, rx, "a", [3, 4, 5], [9, 10, 11])
        transport.hold = True
        for layer in range(LAYERS):
            tx.send_layer("a", layer)
        assert tx.wait_until(lambda: _posted(tx, LAYERS), WAIT)
        cpu, n = loop_cost(tx, _steps(tx), WINDOW)
        # the old loop stepped back to back here: ~10^4 steps and 50-100 % of a core in WINDOW
        assert n <= 1.5 * WINDOW / NAP + 20, f"{n} steps in {WINDOW}s: the loop spins"
        assert cpu < 0.15, f"the waiting loop used {cpu:.0%} of a core"
        assert tx.status("a") is S.TRANSFERRING and rx.status("a") is S.TRANSFERRING
        t = time.monotonic()
        transport.gate.set()  # the writes complete now: the next nap's end finds them
        assert tx.wait_until(lambda: tx.stats().in_pipeline == 0, WAIT)
        assert time.monotonic() - t < 0.5  # NAP-bounded; generous for a loaded 2-core machine
        assert rx.wait("a", WAIT) is S.DONE and tx.wait("a", WAIT) is S.DONE, rx.reason("a")
        assert_landed(src, [3, 4, 5], dst, [9, 10, 11])
        release_both(tx, rx, "a", WAIT, leaks=True)
    finally:
        tx.close()
        rx.close()


def test_loop_naps_while_send_layer_events_are_pending():
    GatedEvent.gate = threading.Event()
    pool = EventPool(0, GatedEvent, lambda device: f"stream-{device}", limit=LAYERS)
    tx, rx, src, dst = _pair(NAP, events=pool)
    try:
        _begin(tx, rx, "a", [3, 4, 5], [9, 10, 11])  # direct: each layer waits for its event
        for layer in range(LAYERS):
            tx.send_layer("a", layer)
        assert tx.wait_until(lambda: tx.stats().queued == 0 and tx.stats().in_pipeline == LAYERS, WAIT)
        cpu, n = loop_cost(tx, _steps(tx), WINDOW)
        assert n <= 1.5 * WINDOW / NAP + 20, f"{n} steps in {WINDOW}s: the loop spins"
        assert cpu < 0.15, f"the waiting loop used {cpu:.0%} of a core"
        assert tx.stats().writing == 0  # nothing written before its event
        GatedEvent.gate.set()
        assert rx.wait("a", WAIT) is S.DONE and tx.wait("a", WAIT) is S.DONE, rx.reason("a")
        assert_landed(src, [3, 4, 5], dst, [9, 10, 11])
        release_both(tx, rx, "a", WAIT, leaks=True)
        assert pool.free == pool.created  # every event came back
    finally:
        tx.close()
        rx.close()


def test_done_command_and_send_layer_end_a_long_nap(monkeypatch):
    monkeypatch.setattr(send_wait_mod, "IDLE_POLL_MS", 60_000)  # the nap's cap: 60 s
    tx, rx, src, dst = _pair(30.0, depth=2 * LAYERS, quiet=True)
    transport = tx.transport
    assert isinstance(transport, GatedTransport)
    try:
        _begin(tx, rx, "b", [20, 21], [0, 1])
        transport.hold = True
        for layer in range(LAYERS):
            tx.send_layer("b", layer)
        assert tx.wait_until(lambda: _posted(tx, LAYERS) and _napping(tx), WAIT)  # a 30 s nap
        transport.hold = False
        t = time.monotonic()
        _begin(tx, rx, "a", [3, 4, 5], [9, 10, 11])  # a command (Begin) and the BeginReply
        for layer in range(LAYERS):
            tx.send_layer("a", layer)  # room in the pipeline: each may wake the nap
        assert rx.wait("a", WAIT) is S.DONE
        assert tx.wait("a", WAIT) is S.DONE  # the receiver's Done ended the nap ("b" still in flight)
        assert time.monotonic() - t < WAIT < 30.0
        assert_landed(src, [3, 4, 5], dst, [9, 10, 11])
        transport.gate.set()
        tx.run_in_loop(lambda: None)  # end the nap: "b"'s writes are found complete
        assert rx.wait("b", WAIT) is S.DONE and tx.wait("b", WAIT) is S.DONE, rx.reason("b")
        release_both(tx, rx, "a", WAIT)
        release_both(tx, rx, "b", WAIT, leaks=True)
    finally:
        tx.close()
        rx.close()


def test_send_layer_into_a_full_pipeline_does_not_wake_the_loop(monkeypatch):
    monkeypatch.setattr(send_wait_mod, "IDLE_POLL_MS", 60_000)
    tx, rx, src, dst = _pair(30.0, depth=LAYERS, quiet=True)
    transport = tx.transport
    assert isinstance(transport, GatedTransport)
    try:
        _begin(tx, rx, "b", [20, 21], [0, 1])
        _begin(tx, rx, "a", [3, 4, 5], [9, 10, 11])
        transport.hold = True
        for layer in range(LAYERS):
            tx.send_layer("b", layer)
        assert tx.wait_until(lambda: _posted(tx, LAYERS) and _napping(tx), WAIT)  # full, napping
        transport.hold = False
        steps, wakes = tx.stats().loop.steps, tx.stats().loop.wakes
        for layer in range(LAYERS):
            tx.send_layer("a", layer)
        time.sleep(0.2)
        # no wake byte (a step may still run when a receiver heartbeat ends a nap: not counted here)
        assert tx.stats().loop.wakes == wakes, "send_layer woke a loop that could not take the layer"
        assert tx.stats().queued == LAYERS
        transport.gate.set()
        tx.run_in_loop(lambda: None)  # a command still ends the nap at once
        for rid in ("a", "b"):
            assert rx.wait(rid, WAIT) is S.DONE and tx.wait(rid, WAIT) is S.DONE, rx.reason(rid)
        assert tx.stats().loop.steps > steps
        assert_landed(src, [3, 4, 5], dst, [9, 10, 11])
        release_both(tx, rx, "a", WAIT)
        release_both(tx, rx, "b", WAIT, leaks=True)
    finally:
        tx.close()
        rx.close()


def test_nap_returns_on_timeout_wake_or_a_queued_message():
    with waker_and_pair("nap") as (w, a, b):
        t = time.monotonic()
        assert nap(w, [b], 0.02) is False
        assert 0.015 < time.monotonic() - t < 1.0
        w.sleeping = True
        w.wake()
        assert nap(w, [b], 10.0) is True  # the wake byte: at once
        w.drain()
        a.send(b"x")
        time.sleep(0.05)  # queued before the nap: zmq.FD may not signal it again, EVENTS does
        t = time.monotonic()
        assert nap(w, [b], 10.0) is True and time.monotonic() - t < 1.0
        assert b.recv(zmq.NOBLOCK) == b"x"
        threading.Timer(0.05, a.send, (b"y",)).start()
        t = time.monotonic()
        assert nap(w, [b], 10.0) is True and time.monotonic() - t < 5.0  # arrives during the nap


@pytest.mark.parametrize("bad", [0.0, -1e-6, math.nan])
def test_busy_wait_s_must_be_positive(bad):
    with pytest.raises(ValueError, match="busy_wait_s"):
        TransferConfig(worker_id="p0", model_id="m", busy_wait_s=bad)
