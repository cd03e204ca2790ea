"""Control-plane client of a worker for one gateway: a pyzmq DEALER connected to that gateway's ROUTER.

Protocol (protocol/messages.py): the worker sends ``RegisterWorker`` and the gateway answers
``RegisterAck``; then ``Heartbeat`` every ``heartbeat_interval`` seconds carrying its load (waiting,
running, free/total KV blocks), which the gateway turns into the per-worker ``pdserve_kv_blocks_used/free``
gauges. Every frame is one msgpack-encoded message (``protocol.messages.encode``). With the fleet's CURVE
keys (kvtransfer/curve.py) the socket is a CURVE client: a gateway without the fleet's key pair never
completes the handshake, so nothing is sent to it nor read from it.

A worker may serve several gateways (workers/gateway_links.py), so a send never waits: messages are
queued only on a completed connection (``ZMQ_IMMEDIATE``), and ``try_send`` says False at once when the
gateway is not connected or its queue (``SEND_HWM`` frames) is full. A dead gateway is noticed without
waiting for TCP: ZMTP heartbeats (a PING every ``ZMTP_HEARTBEAT_IVL_MS``, the connection closed when
nothing comes back for ``ZMTP_HEARTBEAT_TIMEOUT_MS``) and a socket monitor whose events ``next_event``
returns (``EVENT_DISCONNECTED``, ``EVENT_HANDSHAKE_SUCCEEDED``, and the ``EVENT_HANDSHAKE_FAILED_*`` of a
key mismatch: ``kvtransfer.curve.HandshakeWatch`` says what each means).
"""

from __future__ import annotations

import asyncio
import logging
from typing import cast

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from kvtransfer.curve import HANDSHAKE_FAILED, CurveKeys, secure_client
from protocol.messages import Message, encode

log = logging.getLogger("pdserve.worker.control")

ZMTP_HEARTBEAT_IVL_MS = 1000  # a ZMTP PING to the gateway this often
ZMTP_HEARTBEAT_TIMEOUT_MS = 3000  # no traffic this long after a PING: the connection is closed
SEND_HWM = 1000  # frames queued for one gateway before try_send says False (a gateway that stopped reading)
EVENTS = zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED | HANDSHAKE_FAILED


class RegistrationError(RuntimeError):
    """No gateway accepted the worker: refused (the reason is in the message), or none answered in time."""


class ControlClient:
    """DEALER socket to the gateway at ``endpoint`` (e.g. ``tcp://10.0.0.7:7100``, ``tcp://[::1]:7100``);
    a CURVE client with ``keys`` (None: plain, ``--insecure-control-plane``). ``ctx``: the zmq context to
    use (None: its own, terminated by ``close``).

    Raises:
        ValueError: ``endpoint`` is not a zmq endpoint (``tcp://``, ``ipc://``, ``inproc://``).
    """

    def __init__(self, endpoint: str, keys: CurveKeys | None = None,
                 ctx: zmq.asyncio.Context | None = None) -> None:
        if not endpoint.startswith(("tcp://", "ipc://", "inproc://")):
            raise ValueError(f"--gateway-control must be a zmq endpoint like tcp://host:port, "
                             f"got {endpoint!r}")
        self.endpoint = endpoint
        self.secured = keys is not None  # a CURVE client
        self._own_ctx = ctx is None
        self._ctx = zmq.asyncio.Context() if ctx is None else ctx
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 500)
        self._sock.setsockopt(zmq.IMMEDIATE, 1)
        self._sock.setsockopt(zmq.SNDHWM, SEND_HWM)
        self._sock.setsockopt(zmq.HEARTBEAT_IVL, ZMTP_HEARTBEAT_IVL_MS)
        self._sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, ZMTP_HEARTBEAT_TIMEOUT_MS)
        if endpoint.startswith("tcp://["):
            self._sock.setsockopt(zmq.IPV6, 1)
        if keys is not None:
            secure_client(self._sock, keys)
        self._monitor: zmq.asyncio.Socket = self._sock.get_monitor_socket(EVENTS)
        self._sock.connect(endpoint)

    def try_send(self, msg: Message) -> bool:
        """Queue one message for the gateway without waiting; False (nothing queued) when the gateway is
        not connected or its queue is full."""
        # the asyncio socket tries a non-blocking send at once and returns a finished future (sending
        # through a second, plain handle of the socket would leave its asyncio reader waiting for an
        # edge of the socket's file descriptor that zmq already consumed)
        sent = cast("asyncio.Future[None]", self._sock.send(encode(msg), zmq.NOBLOCK))
        error = sent.exception() if sent.done() else None
        if isinstance(error, zmq.Again):
            return False
        if error is not None:
            raise error
        return True

    async def recv_frame(self) -> bytes:
        """Next frame from the gateway, undecoded (``WorkerLoop.decode_frame`` decodes it)."""
        frame: bytes = await self._sock.recv()
        return frame

    async def next_event(self) -> tuple[int, int]:
        """Wait for the next monitor event of the socket, as (event, value): ``zmq.EVENT_DISCONNECTED``
        (the connection to the gateway dropped: closed by the peer, ZMTP heartbeats unanswered, or a
        failed handshake), ``zmq.EVENT_HANDSHAKE_SUCCEEDED`` (connected, CURVE included) or one of
        ``HANDSHAKE_FAILED`` (``value``: libzmq's error or status code)."""
        event = parse_monitor_message(await self._monitor.recv_multipart())
        return int(event["event"]), int(event["value"])

    def close(self, shutdown: Message | None = None) -> None:
        """Send ``shutdown`` (if given and the gateway is connected), then close the socket (zmq flushes
        for at most 0.5 s)."""
        if shutdown is not None and not self.try_send(shutdown):
            log.info("no WorkerShutdown sent to the gateway at %s: not connected", self.endpoint)
        self._sock.disable_monitor()
        self._monitor.close(linger=0)
        self._sock.close(linger=500)
        if self._own_ctx:
            self._ctx.term()
