"""CURVE on the KV control plane (kvtransfer/curve.py, over the loopback transport): a receiver with the
fleet's key pair completes a handshake only with senders holding it. A sender without CURVE or with a
key pair of its own never gets a HelloReply (connect fails at its deadline), a raw client with its own
key pair that knows the fleet's public key is refused by the ZAP handler; the receiver knows no such
sender, never adds its transport metadata, counts each refusal, and a sender with the fleet's keys
transfers bit-exact as before, with nothing leaked."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import zmq

from kvtransfer import IncompatiblePeerError, TransferError, TransferStatus, get_transfer_backend
from kvtransfer import wire as m
from kvtransfer.curve import generate_keys
from tests.kvtransfer.helpers import assert_landed, config, make_kv, release_both

pytestmark = pytest.mark.timeout(60)
S = TransferStatus
WAIT = 5.0


def test_kv_control_socket_refuses_peers_without_the_fleet_keys(tmp_path: Path) -> None:
    fleet, other = generate_keys(tmp_path / "fleet"), generate_keys(tmp_path / "other")
    backend = get_transfer_backend("loopback")
    src, dst = make_kv(5), make_kv(None)
    rx = backend.receiver(config("d0", "loopback", curve=fleet), dst)
    added: list[str] = []
    add_peer = rx.transport.add_peer
    rx.transport.add_peer = lambda peer, meta: (added.append(peer), add_peer(peer, meta))[1]
    strangers = [backend.sender(config("p-plain", "loopback"), src),
                 backend.sender(config("p-other", "loopback", curve=other), src)]
    ctx = zmq.Context()
    raw = ctx.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.curve_publickey, raw.curve_secretkey = zmq.curve_keypair()
    raw.curve_serverkey = fleet.public  # knows the fleet's public key, not its secret one
    raw.connect(rx.address)
    tx = None
    try:
        for stranger in strangers:
            with pytest.raises(TransferError):
                stranger.connect(rx.address, timeout=1.0)
        hello = m.Hello("p-raw", 1, rx.compat, b"")  # type: ignore[attr-defined]
        with contextlib.suppress(zmq.Again):  # refused before anything could be queued
            raw.send(m.encode(hello), zmq.NOBLOCK)
        # a client without CURVE that hangs up first shows as no_handshake (libzmq's NO_DETAIL), not
        # handshake: which of the two it is depends on which side saw the mechanism mismatch first
        counts = rx.refusals.counts  # type: ignore[attr-defined]
        assert rx.wait_until(lambda: counts()["handshake"] + counts()["no_handshake"] >= 2
                             and counts()["unknown_key"] >= 1, WAIT), counts()
        assert raw.poll(200) == 0  # no HelloReply, nothing at all
        assert rx.stats().senders == () and added == []  # no stranger known, no transport peer added
        tx = backend.sender(config("p0", "loopback", curve=fleet), src)
        tx.connect(rx.address, timeout=WAIT)
        tx.add_request(rx.expect("a", [4, 5, 6]), [0, 1, 2])
        tx.send_layers("a")
        assert rx.wait("a", WAIT) is S.DONE, rx.reason("a")
        assert tx.wait("a", WAIT) is S.DONE, tx.reason("a")
        assert_landed(src, [0, 1, 2], dst, [4, 5, 6])
        assert rx.stats().senders == ("p0",) and len(added) == 1
        release_both(tx, rx, "a", leaks=True)
    finally:
        raw.close(0)
        ctx.term()
        for s in [*strangers, tx]:
            if s is not None:
                s.close()
        rx.close()


def test_fenced_receiver_handshakes_only_with_admitted_senders(tmp_path: Path) -> None:
    """fence_senders: a key holder whose sender id the worker never admitted (the gateway never named it)
    gets a HelloReply naming why, its transport metadata never reaches the transport, and it is counted;
    once admitted, the same id handshakes and transfers."""
    fleet = generate_keys(tmp_path / "fleet")
    backend = get_transfer_backend("loopback")
    src, dst = make_kv(6), make_kv(None)
    rx = backend.receiver(config("d0", "loopback", curve=fleet, fence_senders=True), dst)
    added: list[str] = []
    add_peer = rx.transport.add_peer
    rx.transport.add_peer = lambda peer, meta: (added.append(peer), add_peer(peer, meta))[1]
    tx = backend.sender(config("p0", "loopback", curve=fleet), src)
    try:
        with pytest.raises(IncompatiblePeerError, match="not named to this receiver"):
            tx.connect(rx.address, timeout=WAIT)
        assert added == [] and rx.stats().senders == ()
        assert rx.refusals.counts()["unregistered_sender"] == 1  # type: ignore[attr-defined]
        rx.admit_sender("p0")
        tx.connect(rx.address, timeout=WAIT)
        tx.add_request(rx.expect("a", [7, 8]), [1, 2])
        tx.send_layers("a")
        assert rx.wait("a", WAIT) is S.DONE, rx.reason("a")
        assert tx.wait("a", WAIT) is S.DONE, tx.reason("a")
        assert_landed(src, [1, 2], dst, [7, 8])
        assert rx.stats().senders == ("p0",) and len(added) == 1
        release_both(tx, rx, "a", leaks=True)
    finally:
        tx.close()
        rx.close()
