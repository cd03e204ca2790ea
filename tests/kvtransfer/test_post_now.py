"""The hand-off fast path (kvtransfer/post_now.py) over NIXL, sender and receiver in this process: a
send_layers of every layer of a begun request whose KV is complete is posted by the caller's own
thread (its pre-made write); otherwise (the loop in a long step, the Begin not answered, a busy CUDA stream,
the pipeline too shallow) the layers are queued and the loop posts them, as before."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest
import torch

from kvtransfer import TransferStatus, get_transfer_backend, post_now
from tests.kvtransfer.helpers import (
    LAYERS,
    assert_landed,
    config,
    make_kv,
    need_nixl,
    release_both,
    stall_once,
)

need_nixl()
pytestmark = pytest.mark.timeout(60)
S = TransferStatus
WAIT = 10.0
SRC, DST = list(range(6)), [14, 3, 9, 10, 27, 0]  # one source run: direct


def _pair(device: str = "cpu", rx_device: str = "cpu", **kw: object):
    backend = get_transfer_backend("nixl")
    src, dst = make_kv(11).to(device), make_kv(None).to(rx_device)
    # heartbeats every 5 s: no message wakes the sender's loop between _begun and the hand-off
    quiet = {"heartbeat_interval_s": 5.0, "peer_timeout_s": 30.0}
    tx_config = config("p0", "nixl", **{"max_inflight_layers": LAYERS, **kw})
    tx = backend.sender(dataclasses.replace(tx_config, **quiet), src)
    rx = backend.receiver(dataclasses.replace(config("d0", "nixl"), **quiet), dst)
    return tx, rx, src, dst


def _transfer_threads(tx) -> list[str]:
    """Names of the threads that call the sender agent's transfer() from now on."""
    agent, names = tx.transport.agent, []
    orig = agent.transfer

    def call(*args, **kwargs):
        names.append(threading.current_thread().name)
        return orig(*args, **kwargs)
    agent.transfer = call
    return names


def _begun(tx, rx, rid: str) -> None:
    """Add the request, wait for its Begin answer and then for the loop to wait (idle): a hand-off while
    the loop is still in its step queues the layers (test_a_loop_in_its_step_gets_the_layers_queued)."""
    tx.add_request(rx.expect(rid, DST), SRC)
    assert tx.wait_until(lambda: tx._requests[rid].extra["prep"] is not None, WAIT)
    end = time.monotonic() + WAIT
    while not (tx._waker.sleeping and tx._data.acquire(blocking=False)) and time.monotonic() < end:
        time.sleep(0.001)
    tx._data.release()  # (raises if the loop never waited)


def _finish(tx, rx, rid: str, src, dst) -> None:
    assert rx.wait(rid, WAIT) is S.DONE, rx.reason(rid)
    assert tx.wait(rid, WAIT) is S.DONE, tx.reason(rid)
    assert_landed(src.cpu(), SRC, dst.cpu(), DST)  # (on two GPUs torch.equal needs one device)
    release_both(tx, rx, rid, leaks=True)
    assert tx.transport.prepared_count() == 0


def test_complete_kv_of_a_begun_request_is_posted_by_the_callers_thread():
    tx, rx, src, dst = _pair()
    try:
        names = _transfer_threads(tx)
        trace: list = []
        _begun(tx, rx, "a")
        tx.set_trace(trace)
        tx.send_layers("a")
        assert names == [threading.current_thread().name]  # posted before send_layers returned
        assert [e[1] for e in trace if e[1] == "handoff:now"] == ["handoff:now"]
        _finish(tx, rx, "a", src, dst)
        assert not tx._queue and tx._events is None  # nothing was queued (CPU: no events)
    finally:
        tx.close()
        rx.close()


def test_a_loop_in_a_long_step_gets_the_layers_queued():
    """The loop holds the data lock during a step: the hand-off must not post beside it, and waits for
    it only post_now.STEP_WAIT_S; then it queues the layers and the loop posts them after its step."""
    tx, rx, src, dst = _pair()
    try:
        names = _transfer_threads(tx)
        _begun(tx, rx, "a")
        assert tx._data.acquire(timeout=WAIT)  # as the loop does for a step
        try:
            t = time.monotonic()
            tx.send_layers("a")
            assert time.monotonic() - t >= post_now.STEP_WAIT_S
            assert names == [] and len(tx._queue) == LAYERS
        finally:
            tx._data.release()
        _finish(tx, rx, "a", src, dst)
        assert len(names) == 1 and names[0].startswith("kv-sender"), names
    finally:
        tx.close()
        rx.close()


def test_a_hand_off_waits_for_the_end_of_a_short_step(monkeypatch):
    """A loop in a step shorter than STEP_WAIT_S: the hand-off waits for it and posts itself. (STEP_WAIT_S
    made 5 s and the step 50 ms, so a loaded 2-core box cannot turn the step into a long one.)"""
    monkeypatch.setattr(post_now, "STEP_WAIT_S", 5.0)
    tx, rx, src, dst = _pair()
    try:
        names = _transfer_threads(tx)
        _begun(tx, rx, "a")
        assert tx._data.acquire(timeout=WAIT)  # as the loop does for a step ...
        threading.Timer(0.05, tx._data.release).start()  # ... that ends well within STEP_WAIT_S
        t = time.monotonic()
        tx.send_layers("a")
        assert time.monotonic() - t >= 0.04  # it waited for the step
        assert names == [threading.current_thread().name]
        _finish(tx, rx, "a", src, dst)
    finally:
        tx.close()
        rx.close()


@pytest.mark.parametrize("loop", ["idle", "napping"])
def test_a_post_stalled_on_the_callers_thread_keeps_the_receiver(loop):
    """A fast post that stalls (a starved thread, as the loop's write in test_stall.py) 1.5 × the
    sender's peer_timeout_s keeps the loop waiting for the data lock after its wait (its idle poll, or
    a nap beside another request's write in flight); it must read the heartbeats that came meanwhile
    before it checks liveness, not declare its receiver lost. The receiver beats every 0.5 s, so the
    loop's last wait most likely saw none of them."""
    backend = get_transfer_backend("nixl")
    src, dst = make_kv(11), make_kv(None)
    tx = backend.sender(config("p0", "nixl", max_inflight_layers=2 * LAYERS), src)  # peer_timeout_s 1.0
    rx_config = dataclasses.replace(config("d0", "nixl"), heartbeat_interval_s=0.5, peer_timeout_s=30.0)
    rx = backend.receiver(rx_config, dst)
    gate = threading.Event()
    try:
        if loop == "napping":  # "b" is written first; the loop sees its write in progress until the gate
            tx.add_request(rx.expect("b", [1, 2]), [20, 21])
            test = tx.transport.test
            tx.transport.test = lambda handle: gate.is_set() and test(handle)
        _begun(tx, rx, "a")
        if loop == "napping":
            assert tx.wait_until(lambda: tx._requests["b"].extra["prep"] is not None, WAIT)
            tx.send_layers("b")
            assert tx.wait_until(lambda: tx._waker.sleeping and bool(tx._pipe.ops), WAIT)  # napping
        names = _transfer_threads(tx)
        stalled = stall_once(tx.transport, "post_whole", 1.5)
        tx.send_layers("a")
        assert stalled and names == [threading.current_thread().name]  # posted (and stalled) here
        gate.set()
        if loop == "napping":
            assert rx.wait("b", WAIT) is S.DONE and tx.wait("b", WAIT) is S.DONE, tx.reason("b")
            assert_landed(src, [20, 21], dst, [1, 2])
            release_both(tx, rx, "b")
        _finish(tx, rx, "a", src, dst)
        assert all(p.epoch for p in tx._peers.values())  # the receiver was never declared lost
    finally:
        gate.set()
        tx.close()
        rx.close()


@pytest.mark.parametrize("why", ["not begun", "stream busy", "some layers", "shallow pipeline"])
def test_the_loop_posts_when_the_fast_path_does_not_apply(why):
    tx, rx, src, dst = _pair(**({"max_inflight_layers": LAYERS - 1} if why == "shallow pipeline" else {}))
    try:
        names = _transfer_threads(tx)
        if why == "not begun":
            tx.add_request(rx.expect("a", DST), SRC)  # the Begin round trip is not waited for
        else:
            _begun(tx, rx, "a")
        if why == "stream busy":
            tx._stream_idle = lambda: False  # what a GPU stream with kernels pending answers
        if why == "some layers":
            tx.send_layers("a", range(LAYERS - 1))
            tx.send_layer("a", LAYERS - 1)
        else:
            tx.send_layers("a")
        _finish(tx, rx, "a", src, dst)
        assert names and all(n.startswith("kv-sender") for n in names), names
    finally:
        tx.close()
        rx.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_kv_still_being_stored_is_not_posted_early():
    """On a GPU: the KV is stored behind a spin on the caller's stream, so the stream is busy at the
    hand-off and the write must wait for the stores (the loop's event path); with the stream idle the
    caller posts it. Both land bit-exact."""
    tx, rx, src, dst = _pair("cuda:0", "cuda:1" if torch.cuda.device_count() > 1 else "cuda:0")
    ref = src.clone()
    try:
        names = _transfer_threads(tx)
        for rnd, busy in enumerate([True, False, True]):
            rid = f"a{rnd}"
            src.zero_()
            _begun(tx, rx, rid)
            if busy:
                torch.cuda._sleep(50_000_000)  # a slow "forward pass" before the stores
            src.copy_(ref)
            if not busy:
                torch.cuda.synchronize()
            names.clear()
            tx.send_layers(rid)
            assert (names == [threading.current_thread().name]) is not busy, (rnd, names)
            _finish(tx, rx, rid, src, dst)
            assert len(names) == 1 and names[0].startswith("kv-sender") is busy, (rnd, names)
            dst.zero_()
    finally:
        tx.close()
        rx.close()
