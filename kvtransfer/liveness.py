"""Receiver liveness on the sender (a mixin of KVSender): heartbeats, lost or restarted receivers,
unanswered handshakes and request deadlines. Runs on the sender's loop thread only.

A receiver is lost when silent (no message, heartbeats included) for `peer_timeout_s` seconds, or when
it leaves a Hello unanswered for 2 × `peer_timeout_s`; it restarted when a HelloReply carries a new
epoch. Liveness is checked right after the loop drained its sockets (sender.py `_step`; the receiver
does the same), so a stall of our own loop is never counted as the peer's silence. When a receiver is
lost or restarted, every request bound to it fails, and EVERY write posted to it is cancelled (NIXL
release_xfer_handle), also those of requests already terminal: a WRITE to a SIGKILLed decode worker
may never complete nor fail, and would otherwise hold its staging slot and keep its requests "in
flight" (unreleasable) forever.
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import zmq

from kvtransfer import wire as m
from kvtransfer.api import TransferConfig, TransferError, TransferStatus
from kvtransfer.endpoint import RequestState
from kvtransfer.pipeline import LayerOp, LayerPipeline
from kvtransfer.transports.base import SendTransport

S = TransferStatus


@dataclass
class Receiver:
    """The sender's view of one receiver (control endpoint `address`). Times: time.monotonic() s."""

    address: str
    sock: zmq.Socket
    epoch: int = 0  # 0 = handshake not (yet) answered
    last_seen: float = 0.0
    hello_at: float = 0.0  # when the unanswered Hello went out (0 = none pending)
    hello_since: float = 0.0  # when the first of the unanswered Hellos went out
    waiters: list[cf.Future[None]] = field(default_factory=list)


class PeerLiveness:
    """Liveness methods of KVSender; the attributes below are KVSender's."""

    config: TransferConfig
    epoch: int
    transport: SendTransport
    _pipe: LayerPipeline
    _lock: threading.Condition
    _requests: dict[str, RequestState]
    _peers: dict[str, Receiver]
    _next_beat: float

    if TYPE_CHECKING:
        def _send(self, peer: Receiver, msg: m.Message) -> None: ...
        def _set(self, st: RequestState, status: TransferStatus, reason: str = "") -> None: ...
        def _dropped(self, ops: list[LayerOp]) -> None: ...
        def _stop_later(self, st: RequestState, aborted: bool) -> None: ...

    def _fail_peer(self, peer: Receiver, reason: str, only_epoch: int = 0) -> None:
        """Fail the peer's requests (of incarnation `only_epoch` if given) and cancel every write posted
        to it (the peer is gone or restarted: all of them went to the dead incarnation); call before
        transport.remove_peer."""
        with self._lock:
            for st in self._requests.values():
                if st.handle.address != peer.address or (only_epoch and st.handle.epoch != only_epoch):
                    continue
                st.extra["answered"] = True  # no Begin answer will come from a dead incarnation
                if not st.status.is_terminal:
                    self._set(st, S.FAILED, reason)
                self._dropped(self._pipe.cancel(st.handle.request_id, posted=False))
            self._dropped(self._pipe.cancel_peer(peer.address))

    def _housekeeping(self) -> None:
        now = time.monotonic()
        for p in self._peers.values():
            if p.epoch and now - p.last_seen > self.config.peer_timeout_s:
                self._fail_peer(p, f"receiver at {p.address} lost (no heartbeat for "
                                   f"{self.config.peer_timeout_s}s)")
                self.transport.remove_peer(p.address)
                p.epoch = 0
            elif p.hello_at and now - p.hello_since > 2 * self.config.peer_timeout_s:
                # e.g. a decode worker that died before (or after) we first reached it: fail its
                # requests now instead of holding their blocks until the deadline
                why = (f"receiver at {p.address} did not answer the handshake for "
                       f"{2 * self.config.peer_timeout_s}s")
                self._fail_peer(p, why)
                for fut in p.waiters:
                    fut.set_exception(TransferError(why))
                p.waiters.clear()
                p.hello_at = p.hello_since = 0.0
        if now >= self._next_beat:
            self._next_beat = now + self.config.heartbeat_interval_s
            for p in self._peers.values():
                if p.epoch:
                    self._send(p, m.KeepAlive(self.epoch))
        self._deadlines(now)

    def _deadlines(self, now: float) -> None:
        with self._lock:
            for st in self._requests.values():
                if not st.status.is_terminal and now > st.deadline:
                    self._set(st, S.FAILED, f"deadline of {st.handle.timeout_s}s passed")
                    # posted writes may carry other requests' layers too: they complete, fail, or are
                    # cancelled when their receiver is declared lost
                    self._dropped(self._pipe.cancel(st.handle.request_id, posted=False))
                    self._stop_later(st, aborted=False)
