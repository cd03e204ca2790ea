"""The receiver's liveness checks (a mixin of KVReceiver, run on its loop thread after each read of the
control socket): senders silent for `peer_timeout_s` are dropped (their requests FAILED and marked
gone: held until their deadline), heartbeats go out every `heartbeat_interval_s`, and requests past
their deadline fail with an Abort to their sender. A dropped sender's reason is kept (at most
FORGOTTEN_MAX) for the Rehandshake that answers its next message.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvtransfer import wire as m
from kvtransfer.api import TransferStatus
from kvtransfer.endpoint import Endpoint
from kvtransfer.transports.base import RecvTransport

S = TransferStatus
FORGOTTEN_MAX = 1024  # dropped senders whose drop reason is kept for their Rehandshake


@dataclass
class _Sender:
    identity: bytes
    sender_id: str
    epoch: int
    last_seen: float


class SenderLiveness(Endpoint):
    """Liveness methods of KVReceiver (its base; the endpoint's state is Endpoint's, the attributes
    below are KVReceiver's)."""

    transport: RecvTransport
    _senders: dict[bytes, _Sender]
    _forgotten: dict[bytes, str]
    _posted: dict[int, tuple[str, int, int | None, bytes]]
    _next_beat: float

    if TYPE_CHECKING:
        def _send(self, identity: bytes, msg: m.Message) -> None: ...

    def _housekeeping(self) -> None:
        now = time.monotonic()
        for s in list(self._senders.values()):
            if now - s.last_seen > self.config.peer_timeout_s:
                self._drop_sender(s, f"sender {s.sender_id} lost (no heartbeat for "
                                     f"{self.config.peer_timeout_s}s)")
        if now >= self._next_beat:
            self._next_beat = now + self.config.heartbeat_interval_s
            for s in self._senders.values():
                self._send(s.identity, m.KeepAlive(self.epoch))
        with self._lock:
            for rid, st in self._requests.items():
                if not st.status.is_terminal and now > st.deadline:
                    self._set(st, S.FAILED, f"deadline of {st.handle.timeout_s}s passed")
                    if st.extra["sender"] is not None:
                        self._send(st.extra["sender"], m.Abort(rid))
            self._lock.notify_all()

    def _drop_sender(self, s: _Sender, reason: str) -> None:
        del self._senders[s.identity]
        self._forgotten[s.identity] = reason
        while len(self._forgotten) > FORGOTTEN_MAX:  # senders that never came back (oldest first)
            del self._forgotten[next(iter(self._forgotten))]
        self.transport.remove_peer(s.identity.hex())
        self._posted = {k: v for k, v in self._posted.items() if v[3] != s.identity}
        with self._lock:
            for st in self._requests.values():
                if st.extra["sender"] == s.identity:
                    st.extra["gone"] = True
                    self._set(st, S.FAILED, reason)
            self._lock.notify_all()
