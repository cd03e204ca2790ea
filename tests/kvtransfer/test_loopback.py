"""State machine over the in-process loopback transport (real zmq control plane on 127.0.0.1)."""

from __future__ import annotations

import dataclasses
import random
import threading
import time

import pytest
import torch

from kvtransfer import IncompatiblePeerError, TransferStatus, get_transfer_backend
from tests.kvtransfer.helpers import (
    LAYERS,
    FakeReceiver,
    assert_landed,
    config,
    make_kv,
    release_both,
    sender_settled,
)

S = TransferStatus
WAIT = 5.0


@pytest.fixture
def pair():
    backend = get_transfer_backend("loopback")
    src, dst = make_kv(1), make_kv(None)
    tx = backend.sender(config("p0", "loopback", checksum=True), src)
    rx = backend.receiver(config("d0", "loopback", checksum=True), dst)
    yield tx, rx, src, dst
    tx.close()
    rx.close()


def test_layerwise_concurrent_requests_bit_exact(pair):
    tx, rx, src, dst = pair
    rng = random.Random(0)
    free = list(range(32))
    rng.shuffle(free)
    reqs = {f"r{i}": (free[i * 8:i * 8 + 5], rng.sample(range(32), 5)) for i in range(3)}
    for rid, (dst_ids, src_ids) in reqs.items():
        tx.add_request(rx.expect(rid, dst_ids), src_ids)
    for layer in range(LAYERS):  # interleave layers of all requests
        for rid in reqs:
            tx.send_layer(rid, layer)
            if layer < LAYERS - 1:
                assert rx.status(rid) is not S.DONE
    for rid, (dst_ids, src_ids) in reqs.items():
        assert rx.wait(rid, WAIT) is S.DONE, rx.reason(rid)
        assert tx.wait(rid, WAIT) is S.DONE
        assert_landed(src, src_ids, dst, dst_ids)
        release_both(tx, rx, rid, WAIT)
    tx.check_no_leaks()
    rx.check_no_leaks()


def test_not_done_until_every_layer(pair):
    tx, rx, _src, _dst = pair
    tx.add_request(rx.expect("a", [3, 4]), [0, 1])
    for layer in range(LAYERS - 1):
        tx.send_layer("a", layer)
    assert rx.wait_until(lambda: len(rx.snapshot("a").layers) == LAYERS - 1, WAIT)
    assert rx.status("a") is S.TRANSFERRING and not rx.releasable("a")
    assert rx.ended_at("a") is None and tx.ended_at("a") is None
    with pytest.raises(RuntimeError, match="may still be written"):
        rx.release("a")
    before = time.perf_counter()
    tx.send_layer("a", LAYERS - 1)
    assert rx.wait("a", WAIT) is S.DONE and tx.wait("a", WAIT) is S.DONE
    landed, heard = rx.ended_at("a"), tx.ended_at("a")
    assert landed is not None and heard is not None
    assert before < landed <= heard <= time.perf_counter()  # the sender hears of DONE from the receiver
    release_both(tx, rx, "a", WAIT, leaks=True)


@pytest.mark.parametrize("side", ["sender", "receiver"])
def test_abort_mid_transfer_fences_blocks(pair, side):
    tx, rx, _src, dst = pair
    tx.add_request(rx.expect("a", [5, 6, 7]), [1, 2, 3])
    tx.send_layer("a", 0)
    assert rx.wait_until(lambda: 0 in rx.snapshot("a").layers, WAIT)
    (tx if side == "sender" else rx).abort("a")
    assert rx.wait("a", WAIT) is S.ABORTED and tx.wait("a", WAIT) is S.ABORTED
    assert rx.wait_until(lambda: rx.releasable("a"), WAIT)  # sender confirmed Stopped
    with pytest.raises(KeyError):
        tx.send_layer("b", 1)
    tx.send_layer("a", 1)  # after abort: silently not written
    release_both(tx, rx, "a", WAIT)
    assert dst[1].abs().sum() == 0
    tx.check_no_leaks()
    rx.check_no_leaks()


def test_receiver_abort_before_begin_refuses_late_sender(pair):
    tx, rx, _src, dst = pair
    handle = rx.expect("a", [1, 2])
    rx.abort("a")
    assert rx.releasable("a")  # no sender claimed it: free at once
    rx.release("a")
    rx.expect("b", [1, 2])  # blocks reused by another request
    tx.add_request(handle, [0, 1])
    assert tx.wait("a", WAIT) is S.FAILED and "unknown request" in tx.reason("a")
    tx.send_layer("a", 0)
    rx.abort("b")
    rx.release("b")
    tx.release("a")
    assert dst.abs().sum() == 0
    tx.check_no_leaks()
    rx.check_no_leaks()


def test_deadline_fails_both_sides(pair):
    tx, rx, _src, _dst = pair
    tx.add_request(rx.expect("a", [1], timeout_s=0.5), [0])
    tx.send_layer("a", 0)  # never the rest
    assert rx.wait("a", WAIT) is S.FAILED and "deadline" in rx.reason("a")
    assert tx.wait("a", WAIT) in (S.FAILED, S.ABORTED)
    release_both(tx, rx, "a", WAIT, leaks=True)


def test_deadline_counts_from_begin_not_from_expect(pair):
    """A request waiting in its sender's queue (no Begin yet) longer than its transfer deadline still
    completes: the transfer's `timeout_s` starts at the Begin. Unclaimed, it fails at its claim deadline."""
    tx, rx, src, dst = pair
    handle = rx.expect("a", [1, 2], timeout_s=0.3, claim_timeout_s=30.0)
    rx.expect("never", [3], timeout_s=30.0, claim_timeout_s=0.3)
    time.sleep(0.6)  # the prefill queue: twice the transfer deadline
    assert rx.status("a") is S.PENDING
    tx.add_request(handle, [0, 1])
    tx.send_layers("a")
    assert rx.wait("a", WAIT) is S.DONE and tx.wait("a", WAIT) is S.DONE
    assert torch.equal(dst[:, :, [1, 2]], src[:, :, [0, 1]])
    assert rx.wait("never", WAIT) is S.FAILED and "before any sender began" in rx.reason("never")
    release_both(tx, rx, "a", WAIT)
    rx.release("never")
    tx.check_no_leaks()
    rx.check_no_leaks()


def test_each_landed_layer_moves_the_deadline_on(pair):
    """A slow but progressing sender (a long prefill step on a loaded CPU hands its layers off one by one)
    is not failed: each landed layer gives the transfer another `timeout_s`; silence still fails it."""
    tx, rx, src, dst = pair
    tx.add_request(rx.expect("a", [1, 2], timeout_s=0.5), [0, 1])
    layers = src.shape[0]
    for layer in range(layers):
        tx.send_layer("a", layer)
        if layer < layers - 1:
            time.sleep(0.8 / (layers - 1))  # 0.8 s in all, more than the deadline, each gap less
    assert rx.wait("a", WAIT) is S.DONE and tx.wait("a", WAIT) is S.DONE
    assert torch.equal(dst[:, :, [1, 2]], src[:, :, [0, 1]])
    release_both(tx, rx, "a", WAIT, leaks=True)


def test_checksum_detects_corruption(pair):
    tx, rx, _src, _dst = pair
    tx.add_request(rx.expect("a", [1, 2]), [0, 1])
    tx.transport.post = _corrupting(tx.transport.post, tx.transport)
    tx.send_layer("a", 0)
    assert rx.wait("a", WAIT) is S.FAILED and "checksum mismatch in layer 0" in rx.reason("a")
    assert tx.wait("a", WAIT) is S.FAILED
    release_both(tx, rx, "a", WAIT, leaks=True)


def _corrupting(post, transport):
    def wrapped(peer, pieces, notice, tag):
        region, offset, _, _ = pieces[0]  # staging ring or (direct path) kv_buffer
        transport.source(region)[offset] ^= 0xFF  # flip a byte after the checksum
        return post(peer, pieces, notice, tag)
    return wrapped


def test_misplaced_blocks_detected_by_checksum(pair):
    tx, rx, _src, _dst = pair
    tx.add_request(rx.expect("a", [1, 2]), [0, 1])
    orig = tx.transport.post
    tx.transport.post = lambda peer, pieces, notice, tag: orig(  # swap K and V destinations
        peer, [(*pieces[0][:2], *pieces[1][2:]), (*pieces[1][:2], *pieces[0][2:])], notice, tag)
    tx.send_layer("a", 0)
    assert rx.wait("a", WAIT) is S.FAILED and "checksum" in rx.reason("a")
    release_both(tx, rx, "a", WAIT, leaks=True)


def test_incompatible_peer_refused_at_connect():
    backend = get_transfer_backend("loopback")
    rx = backend.receiver(config("d0", "loopback"), make_kv(None))
    cfg = dataclasses.replace(config("p0", "loopback"), model_id="other", tp_size=2)
    tx = backend.sender(cfg, make_kv(1, dtype=torch.float16))
    try:
        with pytest.raises(IncompatiblePeerError) as info:
            tx.connect(rx.address, timeout=WAIT)
        text = str(info.value)
        for word in ("model_id", "dtype", "tp_size"):
            assert word in text
        assert "block_size" not in text
        handle = rx.expect("a", [1])
        with pytest.raises(ValueError, match="dtype 'float16' != 'bfloat16'"):  # refused before anything
            tx.add_request(handle, [0])
        assert rx.status("a") is S.PENDING  # never claimed
        rx.abort("a")
        rx.release("a")
        # a peer whose blocks fit but whose pairing record differs: its request fails naming the mismatch
        other = backend.sender(dataclasses.replace(config("p1", "loopback"), model_id="other"), make_kv(1))
        try:
            handle = rx.expect("b", [1])
            other.add_request(handle, [0])
            assert other.wait("b", WAIT) is S.FAILED and "model_id" in other.reason("b")
            assert rx.status("b") is S.PENDING  # never claimed
            rx.abort("b")
            rx.release("b")
            other.release("b")
            other.check_no_leaks()
        finally:
            other.close()
        tx.check_no_leaks()
        rx.check_no_leaks()
    finally:
        tx.close()
        rx.close()


def test_bad_input_is_named(pair):
    tx, rx, _src, _dst = pair
    with pytest.raises(ValueError, match="distinct"):
        rx.expect("a", [1, 1])
    with pytest.raises(ValueError, match="block ids"):
        rx.expect("a", [99])
    handle = rx.expect("a", [1, 2])
    with pytest.raises(ValueError, match="already expected"):
        rx.expect("a", [3])
    with pytest.raises(ValueError, match="source blocks"):
        tx.add_request(handle, [0])
    with pytest.raises(ValueError, match="unknown transfer backend"):
        get_transfer_backend("rdma")
    tx.add_request(handle, [0, 1])
    with pytest.raises(ValueError, match="layer 9"):
        tx.send_layer("a", 9)
    rx.abort("a")
    release_both(tx, rx, "a", WAIT, leaks=True)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_restarted_receiver_new_epoch_rehandshakes():
    backend = get_transfer_backend("loopback")
    port = _free_port()
    tx = backend.sender(config("p0", "loopback"), make_kv(1))
    rx = backend.receiver(config("d0", "loopback", port=port), make_kv(None))
    try:
        old = rx.expect("a", [1, 2])
        tx.add_request(old, [0, 1])
        for layer in range(LAYERS):
            tx.send_layer("a", layer)
        assert rx.wait("a", WAIT) is S.DONE and tx.wait("a", WAIT) is S.DONE
        release_both(tx, rx, "a", WAIT)
        rx.close()  # the decode worker restarts on the same address with a new epoch
        dst = make_kv(None)
        rx = backend.receiver(config("d0", "loopback", port=port), dst)
        assert rx.epoch != old.epoch
        tx.add_request(msgspec_replace(old, "stale"), [0, 1])  # a handle of the dead incarnation
        new = rx.expect("b", [3, 4])
        tx.add_request(new, [2, 3])
        for layer in range(LAYERS):
            tx.send_layer("b", layer)
        assert rx.wait("b", WAIT) is S.DONE, rx.reason("b")
        assert tx.wait("stale", WAIT) is S.FAILED and "stale" in tx.reason("stale")
        assert_landed(make_kv(1), [2, 3], dst, [3, 4])
        assert dst[:, :, [1, 2]].abs().sum() == 0
        release_both(tx, rx, "b", WAIT)
        tx.release("stale")
        tx.check_no_leaks()
        rx.check_no_leaks()
    finally:
        tx.close()
        rx.close()


def msgspec_replace(handle, request_id):
    import msgspec

    return msgspec.structs.replace(handle, request_id=request_id)


def test_dead_receiver_fails_sender_within_deadline():
    backend = get_transfer_backend("loopback")
    tx = backend.sender(config("p0", "loopback"), make_kv(1))
    rx = backend.receiver(config("d0", "loopback"), make_kv(None))
    try:
        tx.add_request(rx.expect("a", [1, 2], timeout_s=5.0), [0, 1])
        tx.send_layer("a", 0)
        assert tx.wait_until(lambda: tx.status("a") is S.TRANSFERRING, WAIT)
        # layer 0 landed first: else its write could race the close and fail as "peer gone" instead
        assert rx.wait_until(lambda: len(rx.snapshot("a").layers) == 1, WAIT)
        rx.close()  # the decode worker dies: no more heartbeats
        start = __import__("time").monotonic()
        assert tx.wait("a", 5.0) is S.FAILED and "lost" in tx.reason("a")
        assert __import__("time").monotonic() - start < 5.0
        tx.release("a")
        tx.check_no_leaks()
    finally:
        tx.close()


def test_receiver_that_never_answers_the_handshake_fails_fast_and_frees():
    """A decode worker that died before the prefill side first reached it never answers Hello: its
    requests fail after 2 × peer_timeout_s (not the much longer deadline) and can be released."""
    import socket
    import time

    import msgspec

    backend = get_transfer_backend("loopback")
    tx = backend.sender(config("p0", "loopback"), make_kv(1))
    rx = backend.receiver(config("d0", "loopback"), make_kv(None))
    try:
        handle = rx.expect("a", [1, 2], timeout_s=60.0)
        rx.close()  # dies before the sender ever connects
        with socket.socket() as s:  # a port nobody listens on
            s.bind(("127.0.0.1", 0))
            dead = f"tcp://127.0.0.1:{s.getsockname()[1]}"
        tx.add_request(msgspec.structs.replace(handle, address=dead), [0, 1])
        start = time.monotonic()
        limit = 2 * tx.config.peer_timeout_s + 2.0
        assert tx.wait("a", limit) is S.FAILED and "handshake" in tx.reason("a")
        assert time.monotonic() - start < limit
        tx.release("a")
        tx.check_no_leaks()
    finally:
        tx.close()


def test_messages_of_another_receiver_for_a_request_change_nothing():
    """A Done, Abort or Fail for request "a" that comes from a receiver other than the one its handle
    names (e.g. a late message of an earlier request of that id) is ignored."""
    from kvtransfer import KVHandle
    from kvtransfer import wire as m

    backend = get_transfer_backend("loopback")
    src = make_kv(1)
    tx = backend.sender(config("p0", "loopback"), src)
    rx_b = backend.receiver(config("d-b", "loopback"), make_kv(None))
    rx_a = FakeReceiver()  # answers Hello and Begin; sends what the test tells it
    synced = lambda msg: isinstance(msg, m.Begin) and msg.request_id == "sync"  # noqa: E731
    serving = threading.Thread(target=rx_a.serve, args=(WAIT,), kwargs={"until": synced})
    try:
        serving.start()
        tx.connect(rx_a.address, timeout=WAIT)
        tx.add_request(rx_b.expect("a", [5, 6]), [1, 2])
        assert tx.wait_until(lambda: tx.snapshot("a").answered, WAIT)
        for msg in (m.Done("a"), m.Abort("a"), m.Fail("a", "forged")):
            rx_a.send(msg)
        # one zmq stream from rx_a: once the Begin of "sync" (sent after them) is answered, they were read
        sync = KVHandle(worker_id="fake-d", epoch=rx_a.epoch, request_id="sync", block_ids=(0,),
                        layout=rx_b.layout, address=rx_a.address, backend="loopback", timeout_s=WAIT)
        tx.add_request(sync, [9])
        assert tx.wait_until(lambda: tx.snapshot("sync").answered, WAIT)
        assert tx.status("a") is S.TRANSFERRING, tx.reason("a")
        tx.abort("sync")
        assert tx.wait_until(lambda: sender_settled(tx, "sync"), WAIT)
        tx.release("sync")
        for layer in range(LAYERS):
            tx.send_layer("a", layer)
        assert rx_b.wait("a", WAIT) is S.DONE and tx.wait("a", WAIT) is S.DONE
        assert_landed(src, [1, 2], rx_b.kv_buffer, [5, 6])
        release_both(tx, rx_b, "a", WAIT, leaks=True)
    finally:
        tx.close()
        rx_b.close()
        serving.join(WAIT + 1)
        rx_a.close()
