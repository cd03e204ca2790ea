"""Regression: a sender that aborts a request before its Begin went out tells the receiver (Withdraw).

Before: KVSender.abort of a request whose Begin was never sent (its receiver's handshake still
pending: the first request to a decode worker, or the new handshake after a Rehandshake) sent
nothing; Stopped fences go out only for begun requests. The receiver kept the request PENDING, its
blocks reserved, until its own deadline (TransferConfig.timeout_s, 30 s by default). Now the sender
sends `messages.Withdraw` once that receiver knows it (after the handshake), and the receiver ends the
request (ABORTED, never claimed: releasable at once). Only a handshaked sender, for the receiver's
current epoch, for a PENDING request no sender claimed: a Withdraw can never end a claimed request.
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
    stall_once,
)
from tests.kvtransfer.loop_probes import stall_loop

S = TransferStatus
WAIT = 5.0  # far below the receiver's deadline (DEADLINE_S): a request PENDING until then fails
DEADLINE_S = 30.0


@pytest.fixture
def pair():
    backend = get_transfer_backend("loopback")
    src, dst = make_kv(1), make_kv(None)
    tx = backend.sender(patient_config("p0"), src)
    rx = backend.receiver(patient_config("d0"), dst)
    yield tx, rx, src, dst
    tx.close()
    rx.close()


def _withdrawn_on_both_sides(tx, rx, rid: str) -> None:
    """The receiver learned of the sender's abort well before its deadline, as a request no sender
    ever claimed (so no write can land: free at once); both sides then hold nothing."""
    assert tx.wait(rid, WAIT) is S.ABORTED, tx.reason(rid)
    start = time.monotonic()
    status = rx.wait(rid, WAIT)
    late = time.monotonic() - start
    assert status is S.ABORTED, f"receiver still {status.name} {late:.1f}s after the abort"
    assert "before Begin" in rx.reason(rid), rx.reason(rid)
    assert not rx.snapshot(rid).claimed  # never claimed: the Withdraw path, not Stopped
    assert rx.releasable(rid)
    rx.release(rid)
    assert tx.wait_until(lambda: not tx.snapshot(rid).fence_pending, WAIT)
    tx.release(rid)
    tx.check_no_leaks()
    rx.check_no_leaks()
    assert rx.kv_buffer.abs().sum() == 0  # nothing was written


def test_abort_while_the_first_handshake_is_pending_tells_the_receiver(pair):
    tx, rx, _src, _dst = pair
    handle = rx.expect("a", [1, 2, 3], timeout_s=DEADLINE_S)
    gate = stall_loop(tx, WAIT)
    tx.add_request(handle, [4, 5, 6])  # its Begin waits for the first handshake with rx
    tx.abort("a")  # runs right after the Hello went out, before any HelloReply is read
    gate.set()
    _withdrawn_on_both_sides(tx, rx, "a")
    assert tx.stats().receivers[rx.address] == rx.epoch  # the handshake itself completed


def test_abort_after_a_rehandshake_tells_the_receiver_after_the_new_handshake(pair):
    """The receiver dropped the sender: the request's Begin is answered with Rehandshake, and the
    sender aborts it while its new Hello is unanswered (the receiver stalls in it: in its transport's
    add_peer, which a Hello from a sender it does not know calls before the HelloReply goes out)."""
    tx, rx, _src, _dst = pair
    _connected_then_dropped(tx, rx)
    handle = rx.expect("p", [7, 8], timeout_s=DEADLINE_S)
    stalled = stall_once(rx.transport, "add_peer", 1.0)
    tx.add_request(handle, [9, 10])
    assert tx.wait_until(lambda: tx.stats().receivers[rx.address] == 0 and not tx.snapshot("p").begin_sent,
                         WAIT)
    tx.abort("p")
    _withdrawn_on_both_sides(tx, rx, "p")
    assert stalled  # the new Hello was answered only after the abort


def test_abort_while_its_begin_meets_a_rehandshake_tells_the_receiver(pair):
    """Aborted while its Begin is in flight to a receiver that dropped the sender: that Begin is
    answered with Rehandshake (never claimed), so the Withdraw follows the new handshake."""
    tx, rx, _src, _dst = pair
    _connected_then_dropped(tx, rx)
    handle = rx.expect("q", [3, 4], timeout_s=DEADLINE_S)
    gate = stall_loop(tx, WAIT)
    tx.add_request(handle, [5, 6])  # its Begin goes out at once (the sender still knows the receiver)
    tx.abort("q")
    gate.set()
    _withdrawn_on_both_sides(tx, rx, "q")


def _connected_then_dropped(tx, rx) -> None:
    """Handshake tx with rx, then have rx drop tx (as after a stall of tx's loop): tx's next message but
    Hello is answered with Rehandshake."""
    tx.connect(rx.address, timeout=WAIT)
    assert rx.stats().senders == (tx.config.worker_id,)
    rx.drop_sender(tx.config.worker_id, "dropped by test")
    assert rx.wait_until(lambda: not rx.stats().senders, WAIT)


def test_withdraw_cannot_end_a_claimed_request_nor_one_of_another_epoch():
    """Another handshaked sender's Withdraw for a request a first sender claimed (Begin) changes
    nothing, nor one naming another receiver epoch for a PENDING request; an unknown sender's is
    answered with Rehandshake and changes nothing."""
    backend = get_transfer_backend("loopback")
    src, dst = make_kv(1), make_kv(None)
    tx = backend.sender(config("p-owner", "loopback"), src)
    other = backend.sender(config("p-other", "loopback"), make_kv(2))
    rx = backend.receiver(config("d0", "loopback"), dst)
    forger = FakeSender(rx.address, "p-forger")  # a handshaked sender that sends what it is told
    stranger = FakeSender(rx.address, "p-stranger")  # one that never said Hello
    try:
        tx.add_request(rx.expect("a", [1, 2], timeout_s=DEADLINE_S), [3, 4])
        assert tx.wait_until(lambda: tx.status("a") is S.TRANSFERRING, WAIT)
        pending = rx.expect("p", [5, 6], timeout_s=DEADLINE_S)
        assert isinstance(forger.hello(), m.HelloReply)
        for msg in (m.Withdraw("a", rx.epoch, True, "forged"), m.Withdraw("p", rx.epoch + 1, True, "stale")):
            forger.send(msg)
        # one zmq stream per sender: the answer to a Begin sent after them means both were handled
        assert isinstance(forger.request(m.Begin("unknown", rx.epoch)), m.BeginReply)
        reply = stranger.request(m.Withdraw("p", rx.epoch, True, "unknown sender"))
        assert isinstance(reply, m.Rehandshake)
        assert rx.status("a") is S.TRANSFERRING and rx.snapshot("a").claimed
        assert rx.status("p") is S.PENDING
        for layer in range(LAYERS):  # the claimed request still completes
            tx.send_layer("a", layer)
        assert rx.wait("a", WAIT) is S.DONE, rx.reason("a")
        assert tx.wait("a", WAIT) is S.DONE, tx.reason("a")
        assert_landed(src, [3, 4], dst, [1, 2])
        other.add_request(pending, [7, 8])  # and the PENDING one can still be claimed
        assert other.wait_until(lambda: other.status("p") is S.TRANSFERRING, WAIT)
    finally:
        forger.close()
        stranger.close()
        tx.close()
        other.close()
        rx.close()


def test_withdraw_message_round_trips_and_version_is_bumped():
    msg = m.Withdraw("r1", 7, False, "deadline of 1.0s passed")
    assert m.decode(m.encode(msg)) == msg
    assert PROTOCOL_VERSION >= 5
    with pytest.raises(msgspec.ValidationError):
        m.decode(msgspec.msgpack.encode({"type": "Withdraw", "request_id": "r1"}))
