"""The receiver's senders: who completed the handshake, their liveness, and which notices to trust.

A sender is known from its accepted Hello until it is dropped: silent (no message, KeepAlives
included) for `peer_timeout_s`, restarted (a Hello of the same sender id with another epoch), or by
`KVReceiver.drop_sender`. A dropped sender's reason is kept (at most FORGOTTEN_MAX, oldest dropped
first) for the Rehandshake that answers its next message. `lost` only says which senders are silent;
the receiver decides what dropping one does to its requests (receiver.py). Call it right after the
socket was drained, so that a stall of the receiver's own loop never counts as a sender's silence.

Notifications of one-sided transports come from any transport peer, so nothing in them is trusted
(`notices_from`, `accepted`): one that does not decode is skipped (a warning naming the peer), and a
notice whose layer is outside [0, num_layers) or whose request was not claimed (Begin) by the peer
that sent it is ignored (a warning), never counted as landed. A notice for a request the receiver
does not track (released, never expected) is left to the receiver, which ignores it.

Loop thread only, except `ids` (stats, any thread). Times: the monotonic clock, seconds.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import msgspec

from kvtransfer import wire
from kvtransfer.requests import RecvState
from kvtransfer.types import TransferConfig

log = logging.getLogger(__name__)
FORGOTTEN_MAX = 1024  # dropped senders whose drop reason is kept for their Rehandshake


@dataclass(eq=False)
class SenderPeer:
    """One known sender: its zmq identity (the transport's peer key is identity.hex()), id and epoch
    from its Hello, and when we last heard from it."""

    identity: bytes
    sender_id: str
    epoch: int
    last_seen: float


class SenderPeers:
    """The senders one receiver knows, by zmq identity."""

    def __init__(self, config: TransferConfig) -> None:
        self.config = config
        self._known: dict[bytes, SenderPeer] = {}
        self._forgotten: dict[bytes, str] = {}  # dropped sender identity → why (for its Rehandshake)
        self._next_beat = 0.0

    def all(self) -> list[SenderPeer]:
        """Every known sender (a copy: safe to drop senders while iterating)."""
        return list(self._known.values())

    def ids(self) -> tuple[str, ...]:
        """The known senders' ids. Any thread."""
        return tuple(s.sender_id for s in list(self._known.values()))

    def seen(self, identity: bytes) -> SenderPeer | None:
        """The known sender of `identity` (None: unknown), marked heard from now."""
        sender = self._known.get(identity)
        if sender is not None:
            sender.last_seen = time.monotonic()
        return sender

    def known(self, identity: bytes) -> bool:
        """Whether `identity` completed the handshake and was not dropped since."""
        return identity in self._known

    def add(self, identity: bytes, hello: wire.Hello) -> None:
        """Know the sender of an accepted Hello (it is no longer forgotten)."""
        self._forgotten.pop(identity, None)
        self._known[identity] = SenderPeer(identity, hello.sender_id, hello.epoch, time.monotonic())

    def restarted(self, hello: wire.Hello) -> list[SenderPeer]:
        """Known senders with the Hello's sender id and another epoch (earlier incarnations)."""
        return [s for s in self._known.values() if s.sender_id == hello.sender_id and s.epoch != hello.epoch]

    def named(self, sender_id: str) -> list[SenderPeer]:
        """Known senders called `sender_id`."""
        return [s for s in self._known.values() if s.sender_id == sender_id]

    def forget(self, sender: SenderPeer, reason: str) -> None:
        """Drop `sender`, keeping `reason` for the Rehandshake that answers its next message."""
        self._known.pop(sender.identity, None)
        self._forgotten[sender.identity] = reason
        while len(self._forgotten) > FORGOTTEN_MAX:  # senders that never came back (oldest first)
            del self._forgotten[next(iter(self._forgotten))]

    def why_unknown(self, identity: bytes) -> str:
        """Why `identity` is not known: the reason it was dropped, or that it never said Hello."""
        return self._forgotten.get(identity, "no handshake with this sender (receiver restarted?)")

    def lost(self, now: float) -> list[tuple[SenderPeer, str]]:
        """(sender, why) of each sender silent for more than peer_timeout_s at `now`."""
        timeout = self.config.peer_timeout_s
        return [(s, f"sender {s.sender_id} lost (no heartbeat for {timeout}s)")
                for s in self._known.values() if now - s.last_seen > timeout]

    def due_beats(self, now: float) -> list[bytes]:
        """The identities to send a KeepAlive to now (every known sender, once per heartbeat interval)."""
        if now < self._next_beat:
            return []
        self._next_beat = now + self.config.heartbeat_interval_s
        return list(self._known)


def notices_from(peer: str, raw: bytes) -> list[wire.LayerNotice]:
    """The LayerNotices of the notification `raw` from transport peer `peer` (the sender's zmq
    identity, hex); [] (and a warning naming the peer) if it does not decode. Never raises."""
    try:
        return wire.decode_notices(raw)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        log.warning("skipped an undecodable notification (%d bytes) from peer %s: %s", len(raw), peer, exc)
        return []


def accepted(peer: str, n: wire.LayerNotice, st: RecvState | None, num_layers: int) -> bool:
    """False (and a warning) if notice `n` from transport peer `peer` must not count as a landed layer:
    its layer is out of range [0, num_layers), or its request `st` (None: not tracked) was not claimed
    by that peer (st.sender, the zmq identity of the sender whose Begin was accepted)."""
    if not 0 <= n.layer < num_layers:
        log.warning("ignored a notice for layer %d (of %d) of request %r from peer %s", n.layer, num_layers,
                    n.request_id, peer)
        return False
    if st is None:
        return True
    if st.sender is None or st.sender.hex() != peer:
        log.warning("ignored a notice for request %r from peer %s, which did not claim it", n.request_id,
                    peer)
        return False
    return True
