"""The gateway's control socket: a pyzmq ROUTER (asyncio) bound at ``--control-bind``.

Workers connect DEALER sockets; each frame pair is (worker routing identity, one ``protocol.messages``
message). ``ROUTER_MANDATORY`` makes a send to a vanished identity fail instead of vanishing silently.
"""

from __future__ import annotations

import logging

import msgspec
import zmq
import zmq.asyncio

from protocol.messages import Message, decode, encode

log = logging.getLogger(__name__)


class ControlSocket:
    """Bound ROUTER socket. ``recv()`` → (identity, message); ``send(identity, message)`` → delivered?"""

    def __init__(self, bind: str) -> None:
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._sock.setsockopt(zmq.LINGER, 0)
        try:
            self._sock.bind(bind)
        except zmq.ZMQError as exc:
            self.close()
            raise OSError(f"cannot bind control socket at {bind}: {exc}") from exc
        self.endpoint: str = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)

    async def recv(self) -> tuple[bytes, Message | None]:
        """Next (identity, message); message is None when the frame was not a valid message."""
        frames = await self._sock.recv_multipart()
        if len(frames) != 2:
            log.warning("control frame with %d parts dropped", len(frames))
            return frames[0], None
        try:
            return frames[0], decode(frames[1])
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            log.warning("undecodable control message dropped: %s", exc)
            return frames[0], None

    async def send(self, identity: bytes, msg: Message) -> bool:
        """Send to one worker; False when the worker is no longer connected."""
        try:
            await self._sock.send_multipart([identity, encode(msg)], flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.warning("send to %r failed: %s", identity, exc)
            return False
        return True

    def close(self) -> None:
        """Close the socket and its context."""
        self._sock.close(linger=0)
        self._ctx.term()
