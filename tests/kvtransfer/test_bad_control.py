"""Garbage on the control plane must not end a KV endpoint's loop (bad input from a peer: logged and
skipped, every request of the endpoint carries on): a receiver fed undecodable or malformed multipart
messages, a sender fed garbage by its receiver, and a two-sided LayerNotice naming a layer out of range."""

from __future__ import annotations

import logging

import pytest
import zmq

from kvtransfer import TransferStatus, get_transfer_backend
from kvtransfer import wire as m
from tests.kvtransfer.helpers import LAYERS, assert_landed, config, make_kv, release_both

pytestmark = pytest.mark.timeout(60)
PAIR_BACKEND, PAIR_SEED = "loopback", 3  # the `pair` fixture (conftest.py)
S = TransferStatus
WAIT = 5.0
SRC, DST = [0, 1, 2], [5, 6, 7]


def _alive(endpoint) -> bool:
    return endpoint._thread is not None and endpoint._thread.is_alive() and endpoint._error is None


def _transfer(tx, rx, src, dst, rid: str) -> None:
    tx.add_request(rx.expect(rid, DST), SRC)
    tx.send_layers(rid)
    assert rx.wait(rid, WAIT) is S.DONE, rx.reason(rid)
    assert tx.wait(rid, WAIT) is S.DONE, tx.reason(rid)
    assert_landed(src, SRC, dst, DST)
    release_both(tx, rx, rid, leaks=True)


def test_receiver_skips_garbage_and_malformed_multipart(pair, caplog):
    tx, rx, src, dst = pair
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(rx.address)
    try:
        with caplog.at_level(logging.WARNING, logger="kvtransfer.wire"):
            sock.send(b"\xff not msgpack")
            sock.send_multipart([b"two", b"frames"])  # the receiver sees 3 frames with the identity
            _transfer(tx, rx, src, dst, "a")  # its own messages come after ours: ours were read first
        assert _alive(rx)
        assert any("undecodable control message" in r.getMessage() for r in caplog.records)
    finally:
        sock.close(0)
        ctx.term()


def test_sender_skips_garbage_from_its_receiver(caplog):
    """A 'receiver' that answers the Hello with garbage: the sender logs it, lives on, and can still
    close (before: the decode error ended its loop, every request failed)."""
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    tx = get_transfer_backend("loopback").sender(config("p0", "loopback"), make_kv(3))
    try:
        with caplog.at_level(logging.WARNING, logger="kvtransfer.wire"):
            tx._call(lambda: tx._hello(f"tcp://127.0.0.1:{port}", None))
            assert router.poll(int(WAIT * 1000)), "no Hello"
            identity, _hello = router.recv_multipart()
            router.send_multipart([identity, b"\xc1 garbage"])
            assert tx.wait_until(lambda: any("undecodable" in r.getMessage() for r in caplog.records), WAIT)
        assert _alive(tx)
    finally:
        tx.close()
        router.close(0)
        ctx.term()


def test_two_sided_notice_with_a_layer_out_of_range_is_ignored(pair, caplog):
    tx, rx, src, dst = pair
    tx.add_request(rx.expect("a", DST), SRC)
    assert rx.wait_until(lambda: rx._requests["a"].status is S.TRANSFERRING, WAIT)
    sender = rx._requests["a"].extra["sender"]
    bad = m.LayerNotice("a", LAYERS + 3, 1, None, ())
    with caplog.at_level(logging.WARNING, logger="kvtransfer.wire"):
        rx._call(lambda: rx._on_notice(sender, bad))
        assert rx.wait_until(lambda: any("ignored a notice" in r.getMessage() for r in caplog.records), WAIT)
    assert _alive(rx) and not rx._posted and rx.status("a") is S.TRANSFERRING
    tx.send_layers("a")
    assert rx.wait("a", WAIT) is S.DONE, rx.reason("a")
    assert tx.wait("a", WAIT) is S.DONE
    assert_landed(src, SRC, dst, DST)
    release_both(tx, rx, "a", leaks=True)
