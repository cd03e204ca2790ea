"""Judging the one-sided notifications a receiver's transport reports (NIXL notif, loopback): which
LayerNotices may count as a landed request-layer.

A notification comes from any NIXL peer, so nothing in it is trusted: one that does not decode is
skipped (a warning naming the peer), and a notice whose layer is outside [0, num_layers) or whose
request was not claimed (Begin) by the peer that sent it is ignored (a warning), never counted as
landed. A notice for a request the receiver does not track (released, never expected) is left to
KVReceiver._landed, which ignores it as before.
"""

from __future__ import annotations

import logging

import msgspec

from kvtransfer import wire as m
from kvtransfer.endpoint import RequestState

log = logging.getLogger(__name__)


def decode_from(peer: str, raw: bytes) -> list[m.LayerNotice]:
    """The LayerNotices of the notification `raw` from peer key `peer` (the sender's zmq identity, hex);
    [] (and a warning naming the peer) if it does not decode. Never raises."""
    try:
        return m.decode_notices(raw)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        log.warning("skipped an undecodable notification (%d bytes) from peer %s: %s", len(raw), peer, exc)
        return []


def accepted(peer: str, n: m.LayerNotice, st: RequestState | None, num_layers: int) -> bool:
    """False (and a warning) if notice `n` from peer key `peer` must not count as a landed layer: its
    layer is out of range [0, num_layers), or its request `st` (None: not tracked) was not claimed by
    that peer (st.extra["sender"], the zmq identity of the sender whose Begin was accepted)."""
    if not 0 <= n.layer < num_layers:
        log.warning("ignored a notice for layer %d (of %d) of request %r from peer %s", n.layer, num_layers,
                    n.request_id, peer)
        return False
    if st is None:
        return True
    sender = st.extra["sender"]
    if sender is None or sender.hex() != peer:
        log.warning("ignored a notice for request %r from peer %s, which did not claim it", n.request_id,
                    peer)
        return False
    return True
