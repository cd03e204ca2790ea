"""The sender's receivers: one zmq DEALER per receiver address, the handshake with each, their liveness.

Handshake: `hello` sends Hello (this sender's id, epoch, compatibility record, transport metadata); the
HelloReply names every mismatch (compat.mismatches, checked by the receiver) or carries the receiver's
epoch and transport metadata, which `answered` adopts: the transport connects to that incarnation (a
new epoch means the receiver restarted: the old connection is dropped first). connect() callers wait
on futures resolved by the answer.

Liveness: a receiver is lost when silent (no message, KeepAlives included) for `peer_timeout_s`, or
when it leaves a Hello unanswered for 2 × `peer_timeout_s` (e.g. a decode worker that died before we
first reached it, or one whose CURVE keys are not ours: each peer's socket monitor feeds a
curve.HandshakeWatch, which warns once about a failed handshake, and the unanswered Hello's reason names
it). `lost` only says which; the sender decides what that does to its requests
(send_control.py) and then calls `forget` or `give_up_hello`. It must be called right after the
sockets were drained (sender.py), so that a stall of the sender's own loop never counts as a peer's
silence: their KeepAlives would be waiting unread. `beat` sends our KeepAlives.

Loop thread only, except `epochs` (stats, any thread). Times: the monotonic clock, seconds.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import zmq
from zmq.utils.monitor import parse_monitor_message

from kvtransfer import wire
from kvtransfer.compat import KVCompat
from kvtransfer.curve import HANDSHAKE_FAILED, HandshakeWatch, secure_client
from kvtransfer.transports.base import SendTransport
from kvtransfer.types import IncompatiblePeerError, TransferConfig, TransferError

log = logging.getLogger(__name__)
HANDSHAKE_EVENTS = HANDSHAKE_FAILED | zmq.EVENT_HANDSHAKE_SUCCEEDED  # what a peer's socket monitor reports


@dataclass(eq=False)
class ReceiverPeer:
    """The sender's view of one receiver (control endpoint `address`). epoch: the incarnation whose
    HelloReply we adopted (0: none yet, or forgotten); hello_at: when the unanswered Hello went out (0:
    none pending); hello_since: when the first of the unanswered Hellos went out; waiters: connect()
    calls waiting for the answer; monitor: `sock`'s monitor (HANDSHAKE_EVENTS), read into `handshake`."""

    address: str
    sock: zmq.Socket
    monitor: zmq.Socket
    handshake: HandshakeWatch
    epoch: int = 0
    last_seen: float = 0.0
    hello_at: float = 0.0
    hello_since: float = 0.0
    waiters: list[cf.Future[None]] = field(default_factory=list)


class ReceiverPeers:
    """Every receiver this sender talks to, by control address. `wake_fd`: the loop's Waker, polled with
    the peers' sockets (`poller`)."""

    def __init__(self, config: TransferConfig, epoch: int, info: KVCompat, transport: SendTransport,
                 wake_fd: int) -> None:
        self.config, self.epoch, self.info, self.transport = config, epoch, info, transport
        self._wake_fd = wake_fd
        self._ctx = zmq.Context()
        self._by_address: dict[str, ReceiverPeer] = {}
        self._poller: zmq.Poller | None = None  # rebuilt when a peer is added
        self._next_beat = 0.0

    def __iter__(self) -> Iterator[ReceiverPeer]:
        return iter(list(self._by_address.values()))

    def get(self, address: str) -> ReceiverPeer:
        """The peer at `address`, connected (a new DEALER socket) on first use."""
        peer = self._by_address.get(address)
        if peer is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.IDENTITY, f"{self.config.worker_id}:{self.epoch}".encode())
            if self.config.curve is not None:  # a receiver without the fleet's key pair: no handshake
                secure_client(sock, self.config.curve)
            monitor = sock.get_monitor_socket(HANDSHAKE_EVENTS)
            sock.connect(address)
            watch = HandshakeWatch("decode worker", address, self.config.curve is not None, log)
            peer = self._by_address[address] = ReceiverPeer(address, sock, monitor, watch,
                                                            last_seen=time.monotonic())
            self._poller = None
        return peer

    def find(self, address: str) -> ReceiverPeer | None:
        """The peer at `address` if we ever talked to it."""
        return self._by_address.get(address)

    def epochs(self) -> dict[str, int]:
        """Each peer's address → adopted epoch (0: handshake not answered). Any thread."""
        return {address: p.epoch for address, p in list(self._by_address.items())}

    def send(self, peer: ReceiverPeer, msg: wire.Message) -> None:
        """Queue `msg` for `peer`; dropped if zmq cannot take it now (peer unreachable: liveness and
        deadlines report it)."""
        with contextlib.suppress(zmq.Again):
            peer.sock.send(wire.encode(msg), zmq.NOBLOCK)

    def hello(self, address: str, waiter: cf.Future[None] | None = None) -> None:
        """Say Hello to `address` (unless a Hello went out less than 5 heartbeat intervals ago: one in
        flight is enough); `waiter` is resolved by its answer or by giving up on it."""
        peer = self.get(address)
        if waiter is not None:
            peer.waiters.append(waiter)
        now = time.monotonic()
        if peer.hello_at and now - peer.hello_at < self.config.heartbeat_interval_s * 5:
            return
        if not peer.hello_at:
            peer.hello_since = now
        peer.last_seen = peer.hello_at = now
        self.send(peer, wire.Hello(self.config.worker_id, self.epoch, self.info, self.transport.metadata()))

    def answered(self, peer: ReceiverPeer, reply: wire.HelloReply,
                 err: IncompatiblePeerError | None) -> IncompatiblePeerError | None:
        """Adopt a HelloReply: without `err`, connect the transport to its incarnation (dropping the
        connection to an older one) and take its epoch; then resolve the connect() waiters (with `err`
        if given). Call after failing the requests of an older incarnation (their writes are cancelled
        while the transport still knows the peer). Returns `err`, or, when the transport cannot use the
        reply's metadata (malformed bytes from a broken or hostile peer), an IncompatiblePeerError
        naming why: the peer is then left without an epoch, as if it had never answered."""
        if err is None:
            if peer.epoch and peer.epoch != reply.epoch:
                self.transport.remove_peer(peer.address)
            if peer.epoch != reply.epoch:
                try:
                    self.transport.add_peer(peer.address, reply.transport)
                except Exception as exc:  # any transport's parse or connect failure: the peer is unusable
                    err = IncompatiblePeerError(f"{reply.receiver_id}@{peer.address}", [
                        f"transport metadata unusable: {type(exc).__name__}: {exc}"])
                    log.warning("%s", err)
                    peer.epoch = 0
            if err is None:
                peer.epoch = reply.epoch
        peer.hello_at = 0.0
        for fut in peer.waiters:
            fut.set_exception(err) if err else fut.set_result(None)
        peer.waiters.clear()
        return err

    def forget(self, peer: ReceiverPeer) -> None:
        """Drop the transport's connection to `peer` and its epoch (lost, or it forgot us): a Hello must
        be answered again before anything is written to it."""
        self.transport.remove_peer(peer.address)
        peer.epoch = 0

    def lost(self, now: float) -> list[tuple[ReceiverPeer, str, bool]]:
        """(peer, why, handshake unanswered) of each peer lost at `now` (see the module docstring); the
        why of an unanswered Hello names a failed handshake (wrong CURVE keys) when that is what the
        peer's socket monitor saw last."""
        out = []
        timeout = self.config.peer_timeout_s
        for p in self:
            self._read_monitor(p)
            if p.epoch and now - p.last_seen > timeout:
                out.append((p, f"receiver at {p.address} lost (no heartbeat for {timeout}s)", False))
            elif p.hello_at and now - p.hello_since > 2 * timeout:
                cause = f" ({p.handshake.cause})" if p.handshake.cause else ""
                out.append((p, f"receiver at {p.address} did not answer the handshake for {2 * timeout}s"
                               f"{cause}", True))
        return out

    @staticmethod
    def _read_monitor(peer: ReceiverPeer) -> None:
        """Feed every event waiting on `peer`'s socket monitor to its HandshakeWatch."""
        while int(peer.monitor.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
            event = parse_monitor_message(peer.monitor.recv_multipart())
            peer.handshake.on_event(int(event["event"]), int(event["value"]))

    def give_up_hello(self, peer: ReceiverPeer, why: str) -> None:
        """Stop waiting for `peer`'s HelloReply: connect() callers get TransferError(`why`)."""
        for fut in peer.waiters:
            fut.set_exception(TransferError(why))
        peer.waiters.clear()
        peer.hello_at = peer.hello_since = 0.0

    def beat(self, now: float) -> None:
        """Send a KeepAlive to every handshaken peer once per heartbeat interval."""
        if now >= self._next_beat:
            self._next_beat = now + self.config.heartbeat_interval_s
            for p in self:
                if p.epoch:
                    self.send(p, wire.KeepAlive(self.epoch))

    def poller(self) -> zmq.Poller:
        """A poller of the waker and every peer's socket."""
        if self._poller is None:
            self._poller = zmq.Poller()
            self._poller.register(self._wake_fd, zmq.POLLIN)
            for p in self:
                self._poller.register(p.sock, zmq.POLLIN)
        return self._poller

    def sockets(self) -> list[zmq.Socket]:
        """Every peer's socket (a nap watches them)."""
        return [p.sock for p in self]

    def read(self, ready: dict[object, int], handle: Callable[[ReceiverPeer, wire.Message], None]) -> None:
        """Hand every message waiting on a socket in `ready` (a poll result) to `handle`, marking its
        peer seen. Garbage is logged and skipped (wire.decode_from): a peer's bad bytes never end the
        loop."""
        for p in self:
            while p.sock in ready:
                try:
                    raw = p.sock.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                msg = wire.decode_from(raw, p.address)
                if msg is not None:
                    p.last_seen = time.monotonic()
                    handle(p, msg)

    def close(self) -> None:
        """Close every socket and the context (loop thread, at teardown)."""
        for p in self:
            p.sock.disable_monitor()
            p.monitor.close(0)
            p.sock.close(0)
        self._ctx.term()
