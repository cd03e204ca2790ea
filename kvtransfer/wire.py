"""Control-plane messages between a KV sender and a KV receiver (msgspec, over pyzmq; no torch).

Sender = prefill worker, one DEALER socket per receiver; receiver = decode worker, one ROUTER socket.

- Hello → HelloReply: the compatibility handshake (compat.KVCompat; the receiver answers each
  mismatch) and the transports' metadata; each side's epoch (a restart draws a new one).
- Begin → BeginReply: the sender claims a request before writing any block; the receiver refuses one
  it no longer expects, which fences late writes into reused blocks.
- LayerNotice: two-sided transports only, on this plane: the data of a layer follows under its tags.
  One-sided transports carry it (or a LayerNotices batch) as the notification of the write itself.
- Done / Fail / Abort from the receiver; Stopped from the sender (it writes nothing more for the
  request: the receiver may free its blocks); Withdraw from the sender (it gives up a request whose
  Begin it never sent).
- KeepAlive both ways (liveness); Rehandshake from the receiver in answer to any message but Hello of
  a sender it does not know (it dropped that sender, or restarted): the sender fails what it had begun
  there and says Hello again.

Any change to these classes changes the encoding: bump api.PROTOCOL_VERSION.
"""

from __future__ import annotations

import logging
import secrets

import msgspec

from kvtransfer.compat import KVCompat

log = logging.getLogger(__name__)


def new_epoch() -> int:
    """A fresh incarnation number of an endpoint (random, never 0): a restarted worker's peers see a
    new epoch and drop what they knew of the old one."""
    return secrets.randbits(62) + 1


class Hello(msgspec.Struct, tag=True):
    sender_id: str
    epoch: int
    info: KVCompat
    transport: bytes


class HelloReply(msgspec.Struct, tag=True):
    receiver_id: str
    epoch: int
    mismatches: list[str]
    transport: bytes


class Begin(msgspec.Struct, tag=True):
    request_id: str
    receiver_epoch: int


class BeginReply(msgspec.Struct, tag=True):
    request_id: str
    ok: bool
    reason: str = ""


class Rehandshake(msgspec.Struct, tag=True):
    """The receiver does not know the sender of the message it answers: it dropped that sender (no
    heartbeat for peer_timeout_s, e.g. while the sender's loop stalled) or restarted (`epoch` is then
    new). Every write of that sender it had accepted is void (its requests FAILED there, their blocks
    held until their deadline); the sender must fail the requests it began there, cancel its writes
    to it and send Hello before any Begin. `reason`: why the receiver dropped it, for the request's
    FAILED reason."""

    receiver_id: str
    epoch: int
    reason: str


class LayerNotice(msgspec.Struct, tag=True):
    """Layer `layer` of `request_id` is written (one-sided) or follows under tags tag..tag+n (two-sided).

    cuts: token positions where the sender's source blocks stop being adjacent (a direct write splits
    its pieces there too, runs.layer_pieces); empty for a staged write."""

    request_id: str
    layer: int
    tag: int
    checksum: int | None = None
    cuts: tuple[int, ...] = ()


class LayerNotices(msgspec.Struct, tag=True):
    """Several LayerNotices carried by one one-sided write that moved several request-layers at once."""

    notices: list[LayerNotice]


class Done(msgspec.Struct, tag=True):
    request_id: str


class Fail(msgspec.Struct, tag=True):
    request_id: str
    reason: str


class Abort(msgspec.Struct, tag=True):
    request_id: str


class Stopped(msgspec.Struct, tag=True):
    """The sender will issue no more writes for this request; `aborted` if the sender aborted it."""

    request_id: str
    aborted: bool
    reason: str = ""


class Withdraw(msgspec.Struct, tag=True):
    """The sender made terminal a request whose Begin it never sent: it will never claim nor write it.
    Sent once the receiver of epoch `receiver_epoch` answered the sender's Hello. The receiver ends the
    request (ABORTED if `aborted`, else FAILED with `reason`) only if it is of that epoch, still PENDING
    and claimed by no sender; a sender it does not know is answered with Rehandshake instead."""

    request_id: str
    receiver_epoch: int
    aborted: bool
    reason: str = ""


class KeepAlive(msgspec.Struct, tag=True):
    epoch: int


Message = (Hello | HelloReply | Begin | BeginReply | Rehandshake | LayerNotice | LayerNotices | Done | Fail
           | Abort | Stopped | Withdraw | KeepAlive)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)
_notice_decoder = msgspec.msgpack.Decoder(LayerNotice | LayerNotices)


def encode(msg: Message) -> bytes:
    """Serialize a control message (msgpack)."""
    return _encoder.encode(msg)


def decode(data: bytes) -> Message:
    """Parse a control message; raises msgspec.DecodeError/ValidationError on garbage."""
    return _decoder.decode(data)


def decode_from(data: bytes, source: str) -> Message | None:
    """Parse a control message from `source` (for the log); None and one warning naming the source if it
    does not decode: a peer's garbage must not end the loop that reads it. Never raises."""
    try:
        return _decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        log.warning("skipped an undecodable control message (%d bytes) from %s: %s", len(data), source, exc)
        return None


def decode_notice(data: bytes) -> LayerNotice:
    """Parse a notification that carries a single LayerNotice (see decode_notices for batches).

    Raises ValueError for a LayerNotices batch, msgspec.DecodeError/ValidationError on garbage.
    """
    msg = _notice_decoder.decode(data)
    if isinstance(msg, LayerNotices):
        raise ValueError(f"notification carries {len(msg.notices)} layer notices: use decode_notices")
    return msg


def decode_notices(data: bytes) -> list[LayerNotice]:
    """Parse the notification of a one-sided write (NIXL notif): a LayerNotice or a LayerNotices batch.

    Raises msgspec.DecodeError/ValidationError on garbage.
    """
    msg = _notice_decoder.decode(data)
    return msg.notices if isinstance(msg, LayerNotices) else [msg]
