"""CURVE on the KV control plane (kvtransfer/curve.py, over the loopback transport): a receiver with the
fleet's key pair completes a handshake only with senders holding it. A sender without CURVE or with a
key pair of its own never gets a HelloReply (connect fails at its deadline), a raw client with its own
key pair that knows the fleet's public key is refused by the ZAP handler; the receiver knows no such
sender, never adds its transport metadata, counts each refusal, and a sender with the fleet's keys
transfers bit-exact as before, with nothing leaked."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import socket
import threading
import time
from pathlib import Path

import pytest
import zmq
from zmq.utils.monitor import parse_monitor_message

from kvtransfer import IncompatiblePeerError, TransferError, TransferStatus, curve, get_transfer_backend
from kvtransfer import wire as m
from kvtransfer.curve import (
    MONITOR_EVENTS,
    CurveKeys,
    FleetAuthenticator,
    Refusals,
    generate_keys,
    secure_client,
    secure_server,
)
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


@pytest.mark.parametrize("keys", ["own key pair", "no CURVE"])
def test_a_sender_names_a_failed_handshake_with_its_receiver(
        keys: str, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A sender (prefill worker) whose Hello cannot reach a receiver for want of the fleet's keys warns once
    that the handshake failed, naming the keys' flags, and its unanswered Hello's error says so too."""
    fleet, other = generate_keys(tmp_path / "fleet"), generate_keys(tmp_path / "other")
    backend = get_transfer_backend("loopback")
    rx = backend.receiver(config("d0", "loopback", curve=fleet), make_kv(None))
    tx_keys = other if keys == "own key pair" else None
    tx = backend.sender(config("p-x", "loopback", curve=tx_keys), make_kv(5))
    says = ("check --curve-keys / PDSERVE_CURVE_KEYS against the decode worker's" if keys == "own key pair"
            else "this worker runs without CURVE keys (--insecure-control-plane)")
    try:
        with caplog.at_level("WARNING", logger="kvtransfer.peers"):
            with pytest.raises(TransferError, match="did not answer the handshake") as err:
                tx.connect(rx.address, timeout=WAIT)  # peer_timeout_s=1: given up after 2 s
            time.sleep(0.5)  # (retries of the own-key case go on: not warned about again)
        assert says in str(err.value) and rx.address in str(err.value)
        warned = [r.getMessage() for r in caplog.records if r.name == "kvtransfer.peers"]
        assert len(warned) == 1 and says in warned[0] and "handshake failed" in warned[0], warned
    finally:
        tx.close()
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
        rx.admit_sender("p0", tx.epoch)
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


def _raw_hello(ctx: zmq.Context, keys: CurveKeys, address: str, hello: m.Hello) -> m.HelloReply:  # type: ignore[type-arg]
    """Send `hello` from a fresh CURVE client holding the fleet's keys; its HelloReply (within WAIT)."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    # a fresh identity per socket: a ROUTER refuses a connection whose identity a peer it has not yet
    # seen leave still holds (the previous call's socket), and the Hello would go unanswered
    sock.setsockopt(zmq.IDENTITY, f"{hello.sender_id}:{hello.epoch}:{os.urandom(4).hex()}".encode())
    secure_client(sock, keys)
    sock.connect(address)
    try:
        sock.send(m.encode(hello))
        assert sock.poll(int(WAIT * 1000)), "no HelloReply"
        reply = m.decode(sock.recv())
        assert isinstance(reply, m.HelloReply)
        return reply
    finally:
        sock.close(0)


def test_fence_checks_the_sender_epoch_and_a_restarted_sender_serves_once_named(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The fence admits one (sender id, epoch) pair per id: a Hello with the admitted id and another
    epoch (an impostor reusing a known id, or a restarted sender not yet named) is refused, counted as
    `unnamed_sender_epoch` and logged once per (id, epoch), and its metadata never reaches the
    transport; the admitted pair transfers. A restart: the new sender (same id, new epoch) is refused
    until the worker admits its epoch, then transfers; the old one, still alive, is dropped at its next
    message and its Hellos are refused from then on. Nothing leaks."""
    fleet = generate_keys(tmp_path / "fleet")
    backend = get_transfer_backend("loopback")
    src, dst = make_kv(7), make_kv(None)
    rx = backend.receiver(config("d0", "loopback", curve=fleet, fence_senders=True), dst)
    added: list[str] = []
    add_peer = rx.transport.add_peer
    rx.transport.add_peer = lambda peer, meta: (added.append(peer), add_peer(peer, meta))[1]
    counts = rx.refusals.counts  # type: ignore[attr-defined]
    old = backend.sender(config("p0", "loopback", curve=fleet), src)
    new = None
    ctx = zmq.Context()
    try:
        rx.admit_sender("p0", old.epoch)
        with caplog.at_level("WARNING", logger="pdserve"):
            for _ in range(2):  # the same impostor twice: counted twice, logged once
                reply = _raw_hello(ctx, fleet, rx.address, m.Hello("p0", old.epoch + 1, rx.compat, b"x"))
                assert reply.transport == b"" and "not the incarnation" in reply.mismatches[0], reply
        assert counts()["unnamed_sender_epoch"] == 2 and "unregistered_sender" not in counts()
        assert rx.refused_handshakes() == 2  # the count the worker reports in its heartbeats
        logged = [r for r in caplog.records if "unnamed_sender_epoch" in r.getMessage()]
        assert len(logged) == 1 and f"p0 epoch {old.epoch + 1}" in logged[0].getMessage()
        assert added == [] and rx.stats().senders == ()
        old.connect(rx.address, timeout=WAIT)  # the admitted pair
        old.add_request(rx.expect("a", [1, 2]), [3, 4])
        old.send_layers("a")
        assert rx.wait("a", WAIT) is S.DONE and old.wait("a", WAIT) is S.DONE, rx.reason("a")
        assert_landed(src, [3, 4], dst, [1, 2])
        release_both(old, rx, "a")
        assert len(added) == 1
        src2 = make_kv(8)
        new = backend.sender(config("p0", "loopback", curve=fleet), src2)  # p0 restarted
        assert new.epoch != old.epoch
        with pytest.raises(IncompatiblePeerError, match="not the incarnation"):
            new.connect(rx.address, timeout=WAIT)  # its gateway has not named it to this receiver yet
        assert counts()["unnamed_sender_epoch"] == 3 and len(added) == 1
        rx.admit_sender("p0", new.epoch)  # the new registration, named in a ReserveKV
        # the old incarnation, still alive, is dropped at its next message (a KeepAlive) and refused
        assert rx.wait_until(lambda: counts()["unnamed_sender_epoch"] >= 4, WAIT), counts()
        new.connect(rx.address, timeout=WAIT)
        new.add_request(rx.expect("b", [5, 6]), [0, 1])
        new.send_layers("b")
        assert rx.wait("b", WAIT) is S.DONE and new.wait("b", WAIT) is S.DONE, rx.reason("b")
        assert_landed(src2, [0, 1], dst, [5, 6])
        assert rx.stats().senders == ("p0",) and len(added) == 2  # only the new incarnation is known
        release_both(new, rx, "b", leaks=True)
        old.check_no_leaks()
    finally:
        ctx.term()
        for s in (old, new):
            if s is not None:
                s.close()
        rx.close()


NULL_GREETING = b"\xff" + b"\0" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\0") + b"\0" + b"\0" * 31


def test_failed_handshakes_are_logged_once_per_kind_and_peer_host(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Refusals.on_monitor fed a real CURVE server's monitor: raw TCP peers from two loopback hosts, one of
    them twice, each either closing before any handshake (no_handshake) or offering the NULL mechanism
    (handshake). Each (kind, host) is logged once, naming the host; every refusal is counted."""
    fleet = generate_keys(tmp_path / "fleet")
    counted: list[str] = []
    refusals = Refusals("test socket", counted.append)
    ctx = zmq.Context()
    auth = FleetAuthenticator(ctx, fleet, refusals)
    server = ctx.socket(zmq.ROUTER)
    server.setsockopt(zmq.LINGER, 0)
    secure_server(server, fleet)
    monitor = server.get_monitor_socket(MONITOR_EVENTS)
    port = server.bind_to_random_port("tcp://127.0.0.1")

    def feed_until(event_kind: int) -> None:
        while True:
            assert monitor.poll(int(WAIT * 1000)), "no monitor event"
            event = parse_monitor_message(monitor.recv_multipart())
            refusals.on_monitor(event["event"], event["value"])
            if event["event"] == event_kind:
                return

    try:
        with caplog.at_level("WARNING", logger="pdserve"):
            for host, greeting in (("127.0.0.2", b""), ("127.0.0.2", b""), ("127.0.0.3", b""),
                                   ("127.0.0.2", NULL_GREETING), ("127.0.0.2", NULL_GREETING)):
                peer = socket.create_connection(("127.0.0.1", port), timeout=WAIT, source_address=(host, 0))
                try:
                    feed_until(zmq.EVENT_ACCEPTED)  # the host is read while the connection is open
                    if greeting:
                        peer.sendall(greeting)
                    else:
                        peer.close()
                    feed_until(zmq.EVENT_DISCONNECTED)
                finally:
                    peer.close()
        lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("test socket refused")]
        assert len(lines) == 3, lines
        assert sum("before any handshake" in line and "from 127.0.0.2" in line for line in lines) == 1
        assert sum("before any handshake" in line and "from 127.0.0.3" in line for line in lines) == 1
        assert sum("without the fleet's CURVE keys" in line and "from 127.0.0.2" in line
                   for line in lines) == 1
        assert refusals.counts()["no_handshake"] == 3 and refusals.counts()["handshake"] == 2
        assert sorted(counted) == ["handshake"] * 2 + ["no_handshake"] * 3
    finally:
        server.disable_monitor()
        monitor.close(0)
        server.close(0)
        auth.stop()
        ctx.term()


def test_refusal_logs_are_bounded(caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """Past MAX_REMEMBERED (kind, peer) pairs, new peers are counted and the cap is said once."""
    monkeypatch.setattr(curve, "MAX_REMEMBERED", 3)
    refusals = curve.Refusals("capped")
    with caplog.at_level("WARNING", logger="pdserve"):
        for i in range(6):
            refusals.refused(curve.UNKNOWN_KEY, f"key{i}")
        refusals.refused(curve.UNKNOWN_KEY, "key0")
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("capped")]
    assert len(lines) == 4 and "counted, not logged" in lines[3] and "3 refused peers" in lines[3], lines
    assert refusals.counts()["unknown_key"] == 7


def test_a_clients_failed_handshakes_are_warned_about_once_until_one_succeeds(
        caplog: pytest.LogCaptureFixture) -> None:
    """A peer that only hangs up (NO_DETAIL) is warned about at the FAILURES_TO_WARN-th failure in a row, a
    refused key (AUTH) at once; never again until a handshake succeeded; ``cause`` holds the last failure
    until then, naming the keys' flags."""
    log = logging.getLogger("pdserve.test.handshake")
    hung_up, refused = zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, zmq.EVENT_HANDSHAKE_FAILED_AUTH
    watch = curve.HandshakeWatch("gateway", "tcp://10.0.0.7:7100", True, log)

    def warned() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.name == log.name]

    with caplog.at_level("DEBUG", logger=log.name):
        assert not watch.on_event(zmq.EVENT_DISCONNECTED) and watch.failures == 0
        for n in range(1, curve.FAILURES_TO_WARN):
            assert watch.on_event(hung_up, errno.EPIPE) and warned() == [] and watch.failures == n
        assert "CURVE handshake failed" in watch.cause and "tcp://10.0.0.7:7100" in watch.cause
        watch.on_event(hung_up, errno.ECONNRESET)
        for _ in range(20):
            watch.on_event(hung_up, errno.EPIPE)
        assert len(warned()) == 1 and watch.failures == curve.FAILURES_TO_WARN + 20
        assert warned()[0].startswith("gateway tcp://10.0.0.7:7100: the CURVE handshake failed (the gateway "
                                      "does not accept this worker's key, or this worker has the wrong "
                                      "gateway public key")
        assert "check --curve-keys / PDSERVE_CURVE_KEYS against the gateway's" in warned()[0]
        assert not watch.on_event(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        assert (watch.failures, watch.cause) == (0, "")
        assert watch.on_event(refused, 400)  # after a success, a new failure is warned about, at once
        assert len(warned()) == 2 and "does not accept this worker's key" in warned()[1]
        assert "libzmq does not retry" in warned()[1]
    mismatch = zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH
    protocol = zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    assert "does not use CURVE" in curve.handshake_failure(protocol, mismatch, "gateway", "x", True)
    assert "requires CURVE" in curve.handshake_failure(protocol, mismatch, "gateway", "x", False)
    assert "ZMTP protocol error 0x10000001" in curve.handshake_failure(protocol, 0x10000001, "gateway", "x",
                                                                        True)


def test_unusable_transport_metadata_is_refused_and_both_loops_live_on(tmp_path: Path) -> None:
    """A key holder's Hello (to a receiver) or HelloReply (to a sender) whose transport metadata the
    transport cannot use (here bytes that are not UTF-8, for the loopback transport) is refused as an
    incompatible peer, named in the reply or the error; neither endpoint's loop ends, and a good peer
    transfers afterwards."""
    fleet = generate_keys(tmp_path / "fleet")
    backend = get_transfer_backend("loopback")
    src, dst = make_kv(9), make_kv(None)
    rx = backend.receiver(config("d0", "loopback", curve=fleet), dst)
    ctx = zmq.Context()
    fake = ctx.socket(zmq.ROUTER)
    fake.setsockopt(zmq.LINGER, 0)
    secure_server(fake, fleet)
    fake_address = f"tcp://127.0.0.1:{fake.bind_to_random_port('tcp://127.0.0.1')}"
    tx = backend.sender(config("p0", "loopback", curve=fleet), src)
    try:
        reply = _raw_hello(ctx, fleet, rx.address, m.Hello("p-bad", 1, rx.compat, b"\xff\xfe"))
        assert reply.transport == b"" and "transport metadata unusable" in reply.mismatches[0], reply
        assert rx.stats().senders == () and rx.stats().loop.alive

        def answer_badly() -> None:
            assert fake.poll(int(WAIT * 1000)), "no Hello from the sender"
            ident, _ = fake.recv_multipart()
            fake.send_multipart([ident, m.encode(m.HelloReply("fake-d", 1, [], b"\xff\xfe"))])

        t = threading.Thread(target=answer_badly)
        t.start()
        with pytest.raises(IncompatiblePeerError, match="transport metadata unusable"):
            tx.connect(fake_address, timeout=WAIT)
        t.join(WAIT)
        assert tx.stats().loop.alive
        tx.connect(rx.address, timeout=WAIT)
        tx.add_request(rx.expect("a", [1, 2]), [3, 4])
        tx.send_layers("a")
        assert rx.wait("a", WAIT) is S.DONE and tx.wait("a", WAIT) is S.DONE, rx.reason("a")
        assert_landed(src, [3, 4], dst, [1, 2])
        release_both(tx, rx, "a", leaks=True)
    finally:
        fake.close(0)
        ctx.term()
        tx.close()
        rx.close()
