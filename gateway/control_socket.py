"""The gateway's control socket: a pyzmq ROUTER (asyncio) bound at ``--control-bind``.

Workers connect DEALER sockets; each frame pair is (worker routing identity, one ``protocol.messages``
message). ``ROUTER_MANDATORY`` makes a send to a vanished identity fail (EHOSTUNREACH) instead of
vanishing silently: the ROUTER forgets an identity as soon as its peer's connection is gone, so such a
failure is definite. A send that would block (the peer's queue is full: a slow, not a dead, worker) is a
different outcome. A socket monitor reports each dropped connection (``disconnects``); it does not say
whose, so the caller probes its workers to find out. Only connections that completed a handshake count:
the end of one refused (a peer without the fleet's keys, a port scan) was never a worker's.

With ``keys`` the socket is a CURVE server (kvtransfer/curve.py): only clients holding the fleet's key
pair complete a handshake; every refused one is counted in ``refusals`` (the ZAP handler's thread counts
unknown keys, the monitor counts failed handshakes). Without keys it accepts any peer
(``--insecure-control-plane``).
"""

from __future__ import annotations

import asyncio
import errno
import logging
from enum import Enum

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from kvtransfer.curve import MONITOR_EVENTS, CurveKeys, FleetAuthenticator, Refusals, secure_server
from protocol.messages import Message, decode, encode

log = logging.getLogger(__name__)

# every way a connection's handshake fails (the monitor reports one of them, then the connection's
# DISCONNECTED): ZAP denials (an unknown key) too, which Refusals leaves to the ZAP handler
HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                    | zmq.EVENT_HANDSHAKE_FAILED_AUTH)


class SendOutcome(Enum):
    """What one ``ControlSocket.send_outcome`` did."""

    SENT = "sent"
    UNREACHABLE = "unreachable"  # no connection with that identity (EHOSTUNREACH): the peer is gone
    BUSY = "busy"  # the peer's queue is full, or another error: not delivered, the peer may be alive


class ControlSocket:
    """Bound ROUTER socket. ``recv()`` → (identity, message); ``send(identity, message)`` → delivered?"""

    def __init__(self, bind: str, keys: CurveKeys | None = None, refusals: Refusals | None = None) -> None:
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._monitor: zmq.asyncio.Socket | None = None
        self.refusals = refusals or Refusals(f"gateway control socket {bind}")
        self._auth: FleetAuthenticator | None = None
        if keys is not None:
            self._auth = FleetAuthenticator(self._ctx, keys, self.refusals)
            secure_server(self._sock, keys)
        try:
            self._sock.bind(bind)
        except zmq.ZMQError as exc:
            self.close()
            raise OSError(f"cannot bind control socket at {bind}: {exc}") from exc
        self.endpoint: str = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._monitor = self._sock.get_monitor_socket(MONITOR_EVENTS | HANDSHAKE_FAILED)
        # failed handshakes whose connection's DISCONNECTED has not come yet (the events do not name the
        # connection, but each failure precedes its own DISCONNECTED)
        self._failed_open = 0
        self._sync: zmq.Socket[bytes] = zmq.Socket.shadow(self._sock.underlying)  # the same socket, read
        # without asyncio when frames are already there

    async def recv(self) -> tuple[bytes, Message | None]:
        """Next (identity, message); message is None when the frame was not a valid message."""
        return self._parse(await self._sock.recv_multipart())

    async def recv_many(self, limit: int = 256) -> list[tuple[bytes, Message | None]]:
        """The next (identity, message) and every further one already received (at most ``limit`` in
        all), in arrival order; waits only for the first. Message None: the frame was not valid."""
        out = [self._parse(await self._sock.recv_multipart())]
        while len(out) < limit:
            try:
                frames = self._sync.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            out.append(self._parse(frames))
        return out

    @staticmethod
    def _parse(frames: list[bytes]) -> tuple[bytes, Message | None]:
        if len(frames) != 2:
            log.warning("control frame with %d parts dropped", len(frames))
            return frames[0], None
        try:
            return frames[0], decode(frames[1])
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            log.warning("undecodable control message dropped: %s", exc)
            return frames[0], None

    async def send(self, identity: bytes, msg: Message) -> bool:
        """Send to one worker; False when it was not delivered (``send_outcome`` says why)."""
        return await self.send_outcome(identity, msg) is SendOutcome.SENT

    async def send_outcome(self, identity: bytes, msg: Message) -> SendOutcome:
        """Send to one worker without blocking: SENT, UNREACHABLE (no connection with that identity)
        or BUSY (its queue is full, or another zmq error). Logs nothing: the caller knows the worker
        behind ``identity`` and reports a failure in its terms (``GatewayService.send``)."""
        try:
            await self._sock.send_multipart([identity, encode(msg)], flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.debug("send to %s failed: %s", identity.hex(), exc)
            return SendOutcome.UNREACHABLE if exc.errno == errno.EHOSTUNREACH else SendOutcome.BUSY
        return SendOutcome.SENT

    async def disconnects(self) -> None:
        """Wait for the next dropped connection that had completed its handshake (a socket monitor
        event), then read every event queued by then: the drops since the last call coalesce into one
        return (a burst of worker connections lost costs the caller one probe round, not one per
        connection, and never backs the queue up). A refused connection's end (a failed handshake, then
        its DISCONNECTED: a client without the fleet's keys reconnecting every 100 ms) is no drop: it
        never carried a worker, so it never returns; its failed handshake is counted in ``refusals`` at
        once. Never returns after ``close``; cancel the waiting task instead."""
        if self._monitor is None:
            await asyncio.Event().wait()
        assert self._monitor is not None
        while True:
            dropped = False
            event = parse_monitor_message(await self._monitor.recv_multipart())
            while True:
                self.refusals.on_monitor(event["event"], event["value"])
                dropped = self._was_a_drop(event["event"]) or dropped
                if not int(self._monitor.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                    break
                event = parse_monitor_message(await self._monitor.recv_multipart())
            if dropped:
                return

    def _was_a_drop(self, event: int) -> bool:
        """Take one monitor event; True for the DISCONNECTED of a connection whose handshake had not
        failed. A DISCONNECTED is matched to a failed handshake still open first (when a worker's drop
        and a refusal's end interleave, the drop is reported at the later of the two: still once)."""
        if event & HANDSHAKE_FAILED:
            self._failed_open += 1
            return False
        if not event & zmq.EVENT_DISCONNECTED:
            return False
        if self._failed_open:
            self._failed_open -= 1
            return False
        return True

    def close(self, linger_ms: int = 0) -> None:
        """Close the socket, its monitor, the ZAP handler and the context; messages still queued get up to
        ``linger_ms`` milliseconds to go out (0: dropped)."""
        if self._monitor is not None:
            self._sock.disable_monitor()
            self._monitor.close(linger=0)
            self._monitor = None
        self._sock.close(linger=linger_ms)
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        self._ctx.term()
