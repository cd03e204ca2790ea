"""Regression: a receiver that dropped a sender which is still alive tells it so (Rehandshake).

Before: a decode worker that declared a prefill worker lost (its loop stalled past peer_timeout_s) or
restarted silently ignored that sender's later heartbeats and notices; the sender, never told, kept its
in-flight requests TRANSFERRING until their deadline and only then FAILED them. Now the receiver
answers any message of a sender it does not know with `messages.Rehandshake` (its epoch and the
reason); the sender fails the requests it had begun there at once, cancels its writes to it, hands
PENDING ones a fresh Begin after a new handshake, and the next request completes. The receiver keeps
the dropped sender's blocks until their deadline (no Stopped fence from it is trusted: its writes
were cancelled, not completed).
"""

from __future__ import annotations

import time

import msgspec
import pytest

from kvtransfer import PROTOCOL_VERSION, TransferStatus, get_transfer_backend
from kvtransfer import wire as m
from tests.kvtransfer.helpers import (
    LAYERS,
    FakeSender,
    assert_landed,
    config,
    make_kv,
    patient_config,
    release_both,
    stall_once,
)

S = TransferStatus
WAIT = 5.0
STALL_S = 1.5  # > the receiver's peer_timeout_s (1.0 s, helpers.config)
DEADLINE_S = 4.0  # the in-flight request's deadline: the sender must learn long before it





def _send_all(tx, rid: str) -> None:
    for layer in range(LAYERS):
        tx.send_layer(rid, layer)


def _next_request_completes(tx, rx, src, dst) -> None:
    tx.add_request(rx.expect("b", [10, 11, 12]), [20, 21, 22])
    _send_all(tx, "b")
    assert rx.wait("b", WAIT) is S.DONE, rx.reason("b")
    assert tx.wait("b", WAIT) is S.DONE, tx.reason("b")
    assert_landed(src, [20, 21, 22], dst, [10, 11, 12])
    release_both(tx, rx, "b", WAIT)


def _release_dropped(tx, rx, rid: str) -> None:
    """The dropped request: free on the sender once terminal, on the receiver only after its deadline."""
    assert tx.wait_until(lambda: tx.snapshot(rid).inflight == 0, WAIT)
    tx.release(rid)
    assert not rx.releasable(rid)  # a write of the dropped sender might still land: blocks stay held
    assert rx.wait_until(lambda: rx.releasable(rid), DEADLINE_S + WAIT)
    rx.release(rid)
    tx.check_no_leaks()
    rx.check_no_leaks()
    assert rx.stats().receives_posted == 0 and tx.stats().in_pipeline == 0


def test_sender_stalled_past_receivers_timeout_learns_it_was_dropped():
    backend = get_transfer_backend("loopback")
    src, dst = make_kv(1), make_kv(None)
    tx = backend.sender(patient_config("p0"), src)  # never gives up on the receiver by itself
    rx = backend.receiver(config("d0", "loopback"), dst)  # drops a sender silent for 1.0 s
    try:
        tx.add_request(rx.expect("a", [1, 2, 3], timeout_s=DEADLINE_S), [4, 5, 6])
        stalled = stall_once(tx.transport, "post", STALL_S)  # the sender loop blocks 1.5 s in its 1st write
        _send_all(tx, "a")
        assert rx.wait("a", WAIT) is S.FAILED and "lost" in rx.reason("a")
        assert tx.wait_until(lambda: bool(stalled), WAIT)
        # told by the receiver's answer to its next heartbeat, not at the deadline
        late = tx.wait("a", 1.0)
        assert late is S.FAILED, f"still {late.name} {time.monotonic() - stalled[0]:.1f}s after the stall"
        assert "dropped" in tx.reason("a") and "lost" in tx.reason("a")
        _next_request_completes(tx, rx, src, dst)
        _release_dropped(tx, rx, "a")
    finally:
        tx.close()
        rx.close()


def test_dropped_sender_fails_begun_rebegins_pending_and_cancels_writes():
    backend = get_transfer_backend("loopback")
    src, dst = make_kv(2), make_kv(None)
    tx = backend.sender(patient_config("p0", checksum=True), src)
    rx = backend.receiver(patient_config("d0", checksum=True), dst)
    try:
        tx.add_request(rx.expect("a", [1, 2], timeout_s=DEADLINE_S), [3, 4])
        assert tx.wait_until(lambda: tx.status("a") is S.TRANSFERRING, WAIT)
        tx.transport.deliver.clear()  # type: ignore[attr-defined]  # a's first layer stays in flight
        tx.send_layer("a", 0)
        assert tx.wait_until(lambda: tx.stats().writing == 1, WAIT)
        rx.drop_sender(tx.config.worker_id, "dropped by test")
        assert rx.wait("a", WAIT) is S.FAILED
        pending = rx.expect("p", [5, 6])
        tx.add_request(pending, [7, 8])  # its Begin reaches a receiver that no longer knows us
        assert tx.wait("a", 2.0) is S.FAILED and "dropped by test" in tx.reason("a")
        tx.transport.deliver.set()  # type: ignore[attr-defined]
        _send_all(tx, "p")
        assert rx.wait("p", WAIT) is S.DONE, rx.reason("p")
        assert tx.wait("p", WAIT) is S.DONE, tx.reason("p")
        assert_landed(src, [7, 8], dst, [5, 6])
        assert dst[:, :, [1, 2]].abs().sum() == 0  # the cancelled write of "a" never landed
        release_both(tx, rx, "p", WAIT)
        _next_request_completes(tx, rx, src, dst)
        _release_dropped(tx, rx, "a")
    finally:
        tx.close()
        rx.close()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_restarted_receiver_tells_sender_before_its_heartbeat_timeout():
    backend = get_transfer_backend("loopback")
    port = _free_port()
    src = make_kv(3)
    tx = backend.sender(patient_config("p0"), src)  # would take 30 s to notice the silence
    rx = backend.receiver(config("d0", "loopback", port=port), make_kv(None))
    try:
        tx.add_request(rx.expect("a", [1, 2]), [0, 1])
        assert tx.wait_until(lambda: tx.status("a") is S.TRANSFERRING, WAIT)
        rx.close()  # restarts on the same address with a new epoch, knowing no sender
        dst = make_kv(None)
        rx = backend.receiver(config("d0", "loopback", port=port), dst)
        assert tx.wait("a", 3.0) is S.FAILED and "restarted" in tx.reason("a"), tx.reason("a")
        tx.release("a")
        _next_request_completes(tx, rx, src, dst)
        tx.check_no_leaks()
        rx.check_no_leaks()
    finally:
        tx.close()
        rx.close()


def test_a_dropped_senders_late_stopped_is_no_fence():
    """A sender dropped while it claimed a request says Hello again and then Stopped for it: the blocks
    stay held until the request's deadline (its writes were cancelled, not completed: its word that
    nothing more lands is not trusted for a request of its dropped incarnation)."""
    backend = get_transfer_backend("loopback")
    rx = backend.receiver(patient_config("d0"), make_kv(None))
    fake = FakeSender(rx.address, "p-dropped")
    try:
        handle = rx.expect("a", [1, 2], timeout_s=DEADLINE_S)
        fake.claim("a", handle.epoch)
        rx.drop_sender("p-dropped", "dropped by test")
        assert rx.wait("a", WAIT) is S.FAILED and "dropped by test" in rx.reason("a")
        assert isinstance(fake.hello(), m.HelloReply)  # known again, same identity
        fake.send(m.Stopped("a", False, "late"))
        # one zmq stream: the answer to a Begin sent after the Stopped means it was handled
        assert isinstance(fake.request(m.Begin("sync", handle.epoch)), m.BeginReply)
        assert not rx.releasable("a") and not rx.snapshot("a").stopped
        assert rx.wait_until(lambda: rx.releasable("a"), DEADLINE_S + WAIT)  # at its deadline
        rx.release("a")
        rx.check_no_leaks()
    finally:
        fake.close()
        rx.close()


def test_rehandshake_message_round_trips_and_version_is_bumped():
    msg = m.Rehandshake("d0", 7, "sender p0 lost (no heartbeat for 1.0s)")
    assert m.decode(m.encode(msg)) == msg
    assert PROTOCOL_VERSION >= 4
    with pytest.raises(msgspec.ValidationError):
        m.decode(msgspec.msgpack.encode({"type": "Rehandshake", "receiver_id": "d0"}))
