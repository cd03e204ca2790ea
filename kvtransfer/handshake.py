"""The sender's handshake with receivers (a mixin of KVSender): Hello/HelloReply (compatibility, transport
metadata, epochs) and the per-request Begin. Runs on the sender's loop thread only.

A request's Begin goes out once its receiver's handshake (of the handle's epoch) is answered; a
HelloReply with a new epoch means the receiver restarted: the old incarnation's requests fail and every
write posted to it is cancelled (liveness.py) before the transport connects to the new one. A
Rehandshake (the receiver answering a message of ours it cannot place: it dropped us, or restarted)
fails at once every request begun there, cancels every write posted to it and says Hello again;
PENDING requests of its current epoch get their Begin after the new handshake. A request made terminal
before its Begin went out (e.g. aborted while the handshake was pending) is withdrawn (`_withdraw`,
messages.Withdraw) once that receiver knows us, so it frees the request's blocks at once.
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
import time
from typing import TYPE_CHECKING

from kvtransfer import wire as m
from kvtransfer.api import IncompatiblePeerError, TransferConfig, TransferStatus
from kvtransfer.endpoint import RequestState
from kvtransfer.liveness import Receiver
from kvtransfer.pipeline import LayerOp, LayerPipeline
from kvtransfer.transports.base import SendTransport

S = TransferStatus


class Handshake:
    """Handshake methods of KVSender; the attributes below are KVSender's."""

    config: TransferConfig
    epoch: int
    info: m.PeerInfo
    transport: SendTransport
    _lock: threading.Condition
    _requests: dict[str, RequestState]
    _peers: dict[str, Receiver]
    _pipe: LayerPipeline

    if TYPE_CHECKING:
        def _peer(self, address: str) -> Receiver: ...
        def _send(self, peer: Receiver, msg: m.Message) -> None: ...
        def _set(self, st: RequestState, status: TransferStatus, reason: str = "") -> None: ...
        def _fail_peer(self, peer: Receiver, reason: str, only_epoch: int = 0) -> None: ...
        def _dropped(self, ops: list[LayerOp]) -> None: ...

    def _hello(self, address: str, fut: cf.Future[None] | None = None) -> None:
        peer = self._peer(address)
        if fut is not None:
            peer.waiters.append(fut)
        now = time.monotonic()
        if peer.hello_at and now - peer.hello_at < self.config.heartbeat_interval_s * 5:
            return  # one Hello in flight is enough
        if not peer.hello_at:
            peer.hello_since = now
        peer.last_seen = peer.hello_at = now
        self._send(peer, m.Hello(self.config.worker_id, self.epoch, self.info, self.transport.metadata()))

    def _begin(self, st: RequestState) -> None:
        peer = self._peer(st.handle.address)
        if peer.epoch == st.handle.epoch:
            st.extra["begin_sent"] = True
            self._send(peer, m.Begin(st.handle.request_id, peer.epoch))
        else:
            self._hello(st.handle.address)  # new or restarted receiver: (re)handshake first

    def _withdraw(self, st: RequestState, aborted: bool) -> bool:
        """Tell the receiver that the terminal request `st`, whose Begin never went out, will never be
        claimed nor written (messages.Withdraw; lock held). True when done: sent, or nothing to tell
        (the receiver incarnation its handle names is gone, or never answered our Hello); False while
        our handshake with that receiver is pending: the loop calls again after its answer."""
        peer = self._peers.get(st.handle.address)
        if peer is None:
            return True
        if peer.epoch == st.handle.epoch:
            self._send(peer, m.Withdraw(st.handle.request_id, peer.epoch, aborted, st.reason))
            return True
        return not (peer.epoch == 0 and peer.hello_at)

    def _on_hello_reply(self, peer: Receiver, r: m.HelloReply) -> None:
        err = IncompatiblePeerError(f"{r.receiver_id}@{peer.address}", r.mismatches) if r.mismatches else None
        if err is None:
            if peer.epoch and peer.epoch != r.epoch:
                self._fail_peer(peer, f"receiver {r.receiver_id} restarted", only_epoch=peer.epoch)
                self.transport.remove_peer(peer.address)
            if peer.epoch != r.epoch:
                self.transport.add_peer(peer.address, r.transport)
            peer.epoch = r.epoch
        peer.hello_at = 0.0
        for fut in peer.waiters:
            fut.set_exception(err) if err else fut.set_result(None)
        peer.waiters.clear()
        with self._lock:
            waiting = [st for st in self._requests.values() if st.handle.address == peer.address
                       and st.status is S.PENDING and not st.extra.get("begin_sent")]
            for st in waiting:
                if err is not None:
                    self._set(st, S.FAILED, str(err))
                elif st.handle.epoch != r.epoch:
                    self._set(st, S.FAILED, f"stale handle: epoch {st.handle.epoch} != receiver's {r.epoch}")
                else:
                    st.extra["begin_sent"] = True
                    self._send(peer, m.Begin(st.handle.request_id, r.epoch))

    def _on_rehandshake(self, peer: Receiver, r: m.Rehandshake) -> None:
        """The receiver at `peer` does not know us (messages.Rehandshake): it voided every write of ours
        (its requests FAILED, their blocks held until their deadline), so fail each request bound to it
        except those of its current epoch whose Begin is unanswered (refused unread, or never sent: none
        of ours claimed there): a PENDING one's Begin goes out again once the new Hello is answered, a
        terminal one's Withdraw then. Cancel every write posted to it, drop its transport state and
        Hello. Stopped fences still to send are dropped: the receiver no longer waits for them."""
        if not peer.epoch:
            return  # answers a message sent before our Hello (or we had given this receiver up already)
        why = (f"receiver {r.receiver_id} at {peer.address} restarted" if r.epoch != peer.epoch else
               f"receiver {r.receiver_id} at {peer.address} dropped this sender: {r.reason}")
        with self._lock:
            for st in self._requests.values():
                if st.handle.address != peer.address:
                    continue
                if st.handle.epoch == r.epoch and not st.extra["answered"]:  # not claimed there
                    st.extra["begin_sent"] = False
                    if st.status is S.PENDING:
                        continue
                    st.extra["stop"] = st.status is S.ABORTED  # terminal: withdrawn after the Hello
                else:
                    st.extra["answered"], st.extra["stop"] = True, None
                    stale = f"stale handle: epoch {st.handle.epoch} != receiver's {r.epoch} ({why})"
                    self._set(st, S.FAILED, stale if st.status is S.PENDING else why)  # PENDING: never begun
                self._dropped(self._pipe.cancel(st.handle.request_id, posted=False))
            self._dropped(self._pipe.cancel_peer(peer.address))
        self.transport.remove_peer(peer.address)
        peer.epoch = 0
        self._hello(peer.address)
