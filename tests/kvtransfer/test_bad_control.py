"""Garbage on the control plane must not end a KV endpoint's loop (bad input from a peer: logged and
skipped, every request of the endpoint carries on): a receiver fed undecodable or malformed multipart
messages, a sender fed garbage by its receiver, and two-sided LayerNotices a receiver must not act on
(a layer out of range; any LayerNotice on the control plane of a one-sided transport).

Log records are waited for with a deadline (`_logged`): the endpoint's loop thread writes them, and
on a loaded machine it may do so after the test's own transfer completed (the garbage and the real
sender reach the receiver's socket over different connections, in no fixed order)."""

from __future__ import annotations

import logging
import time

import pytest
import zmq

from kvtransfer import TransferError, TransferStatus, get_transfer_backend
from kvtransfer import wire as m
from tests.kvtransfer.helpers import LAYERS, FakeSender, assert_landed, config, make_kv, release_both

pytestmark = pytest.mark.timeout(60)
PAIR_BACKEND, PAIR_SEED = "loopback", 3  # the `pair` fixture (conftest.py)
S = TransferStatus
WAIT = 5.0
SRC, DST = [0, 1, 2], [5, 6, 7]


def _logged(caplog: pytest.LogCaptureFixture, text: str, timeout: float = WAIT) -> bool:
    """Wait up to `timeout` s for a captured log record containing `text`."""
    end = time.monotonic() + timeout
    while True:
        if any(text in r.getMessage() for r in list(caplog.records)):
            return True
        if time.monotonic() >= end:
            return False
        time.sleep(0.01)


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
        with caplog.at_level(logging.WARNING, logger="kvtransfer"):
            sock.send(b"\xff not msgpack")
            sock.send_multipart([b"two", b"frames"])  # the receiver sees 3 frames with the identity
            _transfer(tx, rx, src, dst, "a")
            assert _logged(caplog, "undecodable control message")
        assert rx.stats().loop.alive
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
        with caplog.at_level(logging.WARNING, logger="kvtransfer"):
            with pytest.raises(TransferError, match="no handshake answer"):
                tx.connect(f"tcp://127.0.0.1:{port}", timeout=0.05)  # its Hello goes out all the same
            assert router.poll(int(WAIT * 1000)), "no Hello"
            identity, _hello = router.recv_multipart()
            router.send_multipart([identity, b"\xc1 garbage"])
            assert _logged(caplog, "undecodable")
        assert tx.stats().loop.alive
    finally:
        tx.close()
        router.close(0)
        ctx.term()


@pytest.mark.parametrize("layer", [LAYERS + 3, 0], ids=["out of range", "one-sided transport"])
def test_control_plane_notice_the_receiver_cannot_act_on_is_ignored(pair, caplog, layer):
    """The sender that claimed a request sends a LayerNotice on the control plane naming a layer out of
    range, or any layer while the receiver's transport is one-sided (loopback: data and notice travel
    together, no receive is ever posted). Ignored with a warning: nothing posted or landed, the request
    still TRANSFERRING, the loop alive (before: a one-sided transport's post raised and ended the loop,
    every request FAILED); the endpoint then serves a real transfer bit-exact."""
    tx, rx, src, dst = pair
    fake = FakeSender(rx.address)
    try:
        handle = rx.expect("a", DST)
        fake.claim("a", handle.epoch)
        assert rx.status("a") is S.TRANSFERRING
        with caplog.at_level(logging.WARNING, logger="kvtransfer"):
            fake.send(m.LayerNotice("a", layer, 1, None, ()))
            assert _logged(caplog, "ignored a notice")
        assert rx.stats().loop.alive and rx.stats().receives_posted == 0
        assert rx.status("a") is S.TRANSFERRING and rx.snapshot("a").layers == frozenset()
        fake.send(m.Stopped("a", True))  # the claimer gives it up: the blocks are free again
        assert rx.wait("a", WAIT) is S.ABORTED and rx.wait_until(lambda: rx.releasable("a"), WAIT)
        rx.release("a")
    finally:
        fake.close()
    _transfer(tx, rx, src, dst, "b")
