"""Control-plane client of a worker: a pyzmq DEALER connected to the gateway's ROUTER.

Protocol (protocol/messages.py): the worker sends ``RegisterWorker`` first and waits for ``RegisterAck``;
then ``Heartbeat`` every ``heartbeat_interval`` seconds carrying its load (waiting, running, free/total KV
blocks), which the gateway turns into the per-worker ``pdserve_kv_blocks_used/free`` gauges. Every
frame is one msgpack-encoded message (``protocol.messages.encode``). With the fleet's CURVE keys
(kvtransfer/curve.py) the socket is a CURVE client: a gateway without the fleet's key pair never completes
the handshake, so nothing is sent to it nor read from it.
"""

from __future__ import annotations

import asyncio
import logging

import msgspec
import zmq
import zmq.asyncio

from kvtransfer.curve import CurveKeys, secure_client
from protocol.messages import Message, RegisterAck, RegisterWorker, WorkerShutdown, decode, encode

log = logging.getLogger("pdserve.worker.control")


class RegistrationError(RuntimeError):
    """The gateway refused the registration, or did not answer in time."""


class ControlClient:
    """DEALER socket to the gateway at ``endpoint`` (e.g. ``tcp://127.0.0.1:7100``); a CURVE client
    with ``keys`` (None: plain, ``--insecure-control-plane``).

    Raises:
        ValueError: ``endpoint`` is not a zmq endpoint (``tcp://``, ``ipc://``, ``inproc://``).
    """

    def __init__(self, endpoint: str, keys: CurveKeys | None = None) -> None:
        if not endpoint.startswith(("tcp://", "ipc://", "inproc://")):
            raise ValueError(f"--gateway-control must be a zmq endpoint like tcp://host:port, "
                             f"got {endpoint!r}")
        self.endpoint = endpoint
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 500)
        if keys is not None:
            secure_client(self._sock, keys)
        self._sock.connect(endpoint)

    async def send(self, msg: Message) -> None:
        """Queue one message for the gateway (zmq buffers it while the gateway is unreachable)."""
        await self._sock.send(encode(msg))

    async def recv_frame(self) -> bytes:
        """Next frame from the gateway, undecoded (``WorkerLoop.decode_frame`` decodes it)."""
        frame: bytes = await self._sock.recv()
        return frame

    async def recv(self) -> Message | None:
        """Next message from the gateway; None for an undecodable frame (logged and dropped)."""
        data = await self.recv_frame()
        try:
            return decode(data)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            log.warning("undecodable control message dropped: %s", exc)
            return None

    async def register(self, msg: RegisterWorker, timeout: float = 60.0) -> RegisterAck:
        """Send ``msg`` and wait up to ``timeout`` seconds for the gateway's ``RegisterAck``; returns it.

        Other messages arriving first are dropped (the gateway sends nothing else before the ack).

        Raises:
            RegistrationError: refused (the reason is in the message) or no answer in time.
        """
        await self.send(msg)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise RegistrationError(f"no RegisterAck from the gateway at {self.endpoint} "
                                        f"within {timeout:.0f} s")
            try:
                reply = await asyncio.wait_for(self.recv(), remaining)
            except TimeoutError:
                continue
            if isinstance(reply, RegisterAck) and reply.worker_id == msg.worker_id:
                if not reply.accepted:
                    raise RegistrationError(f"gateway refused worker {msg.worker_id}: {reply.reason}")
                return reply

    async def close(self, shutdown: WorkerShutdown | None = None) -> None:
        """Send ``shutdown`` (if given), then close the socket (waits at most 0.5 s to flush)."""
        if shutdown is not None:
            try:
                await asyncio.wait_for(self.send(shutdown), 0.5)
            except (TimeoutError, zmq.ZMQError):
                log.warning("could not send WorkerShutdown to the gateway")
        self._sock.close(linger=500)
        self._ctx.term()
