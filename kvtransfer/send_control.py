"""The sender's side of each request's exchange with its receiver (loop thread only).

A request is claimed before anything is written: its Begin goes out once the receiver incarnation its
handle names answered our Hello (peers.py), and only a BeginReply that accepts it lets its layers be
posted. What ends it here: Done (DONE: every layer landed), Fail or Abort from the receiver, our own
abort, a failed write, its deadline (a backstop a peer timeout after the receiver's), or its receiver
lost, restarted, or telling us it forgot us (Rehandshake).

Fences: once a request ended, the receiver must learn that nothing more will land in its blocks. A
begun request gets Stopped once none of its writes is in flight; one whose Begin never went out gets
Withdraw once that receiver knows us (then it frees the blocks at once instead of at its deadline); a
request whose Begin is in flight waits for the answer, which decides. `flush_fences` sends them.

Peer events (peers.py says which): a lost or restarted receiver fails every request bound to it (of
the old incarnation) and cancels EVERY write posted to it, also those of requests already terminal: a
WRITE to a SIGKILLed decode worker may never complete nor fail, and would otherwise hold its staging
slot and keep its requests "in flight" (unreleasable) forever. A Rehandshake (the receiver dropped us
while we lived, or restarted) fails at once every request begun there, cancels every write posted to
it and says Hello again; PENDING requests of its current epoch get their Begin after the new
handshake, terminal never-claimed ones their Withdraw.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import time

from kvtransfer import wire
from kvtransfer.peers import ReceiverPeer, ReceiverPeers
from kvtransfer.requests import RequestTable, SendState
from kvtransfer.send_path import SendPath
from kvtransfer.types import IncompatiblePeerError, TransferConfig, TransferError, TransferStatus

S = TransferStatus


class SendControl:
    """Begin, replies, fences and peer events of one sender's requests (`requests`, written by `path`,
    sent to `peers`)."""

    def __init__(self, config: TransferConfig, requests: RequestTable[SendState], peers: ReceiverPeers,
                 path: SendPath) -> None:
        self.config, self.requests, self.peers, self.path = config, requests, peers, path

    def connect(self, address: str, waiter: cf.Future[None]) -> None:
        """Say Hello to `address`; `waiter` gets its answer (None, or IncompatiblePeerError)."""
        self.peers.hello(address, waiter)

    def begin(self, st: SendState) -> None:
        """Claim a newly added request: Begin now if its receiver incarnation answered our Hello, else
        Hello first (a new or restarted receiver) and Begin after the answer."""
        peer = self.peers.get(st.handle.address)
        if peer.epoch == st.handle.epoch:
            st.begin_sent = True
            self.peers.send(peer, wire.Begin(st.request_id, peer.epoch))
        else:
            self.peers.hello(st.handle.address)

    def abort(self, request_id: str) -> None:
        """ABORTED here, then fenced (see the module docstring); nothing for a terminal or unknown one."""
        with self.requests.lock:
            st = self.requests.find(request_id)
            if st is None or st.status.is_terminal:
                return
            self.requests.set_status(st, S.ABORTED, "aborted by sender")
            st.fence_later(aborted=True)

    def on_message(self, peer: ReceiverPeer, msg: wire.Message) -> None:
        """Handle one message from the receiver at `peer` (peers.read)."""
        if isinstance(msg, wire.HelloReply):
            self._on_hello_reply(peer, msg)
            return
        if isinstance(msg, wire.Rehandshake):
            self._on_rehandshake(peer, msg)
            return
        rid = getattr(msg, "request_id", None)
        with self.requests.lock:
            st = self.requests.find(rid)
            if st is None or st.handle.address != peer.address:  # not a request of this receiver
                return
            if isinstance(msg, wire.BeginReply):
                st.begun, st.answered = msg.ok, True
                self.requests.set_status(st, S.TRANSFERRING if msg.ok else S.FAILED, msg.reason)
                if msg.ok and st.plan.pieces and st.prep is None and not st.status.is_terminal:
                    with contextlib.suppress(TransferError):  # else the first post prepares it, and fails it
                        self.path.prepare(st)
            elif isinstance(msg, wire.Done):
                self.path.mark("done_msg", st.request_id)
                self.requests.set_status(st, S.DONE)
                self.path.mark("DONE", st.request_id)
            elif isinstance(msg, wire.Abort):
                self.requests.set_status(st, S.ABORTED, "aborted by receiver")
            elif isinstance(msg, wire.Fail):
                self.requests.set_status(st, S.FAILED, f"receiver failed it: {msg.reason}")
            late_begin = isinstance(msg, wire.BeginReply) and msg.ok and st.status in (S.ABORTED, S.FAILED)
            if isinstance(msg, wire.Fail | wire.Abort) or late_begin:
                # a request aborted while its Begin was in flight still needs its Stopped fence
                st.fence_later(aborted=st.status is S.ABORTED)

    def _on_hello_reply(self, peer: ReceiverPeer, r: wire.HelloReply) -> None:
        err = (IncompatiblePeerError(f"{r.receiver_id}@{peer.address} (sender != receiver)", r.mismatches)
               if r.mismatches else None)
        if err is None and peer.epoch and peer.epoch != r.epoch:
            self.fail_peer(peer, f"receiver {r.receiver_id} restarted", only_epoch=peer.epoch)
        err = self.peers.answered(peer, r, err)
        with self.requests.lock:
            waiting = [st for st in self.requests if st.handle.address == peer.address
                       and st.status is S.PENDING and not st.begin_sent]
            for st in waiting:
                if err is not None:
                    self.requests.set_status(st, S.FAILED, str(err))
                elif st.handle.epoch != r.epoch:
                    self.requests.set_status(st, S.FAILED,
                                             f"stale handle: epoch {st.handle.epoch} != receiver's {r.epoch}")
                else:
                    st.begin_sent = True
                    self.peers.send(peer, wire.Begin(st.request_id, r.epoch))

    def _on_rehandshake(self, peer: ReceiverPeer, r: wire.Rehandshake) -> None:
        """The receiver at `peer` does not know us: it voided every write of ours (its requests FAILED,
        their blocks held until their deadline), so fail each request bound to it except those of its
        current epoch whose Begin is unanswered (refused unread, or never sent: none of ours claimed
        there): a PENDING one's Begin goes out again once the new Hello is answered, a terminal one's
        Withdraw then. Cancel every write posted to it, drop its transport state and Hello. Stopped
        fences still to send are dropped: the receiver no longer waits for them."""
        if not peer.epoch:
            return  # answers a message sent before our Hello (or we had given this receiver up already)
        why = (f"receiver {r.receiver_id} at {peer.address} restarted" if r.epoch != peer.epoch else
               f"receiver {r.receiver_id} at {peer.address} dropped this sender: {r.reason}")
        with self.requests.lock:
            for st in self.requests:
                if st.handle.address != peer.address:
                    continue
                if st.handle.epoch == r.epoch and not st.answered:  # not claimed there
                    st.begin_sent = False
                    if st.status is S.PENDING:
                        continue
                    st.fence = st.status is S.ABORTED  # terminal: withdrawn after the Hello
                else:
                    st.answered, st.fence = True, None
                    stale = f"stale handle: epoch {st.handle.epoch} != receiver's {r.epoch} ({why})"
                    self.requests.set_status(st, S.FAILED, stale if st.status is S.PENDING else why)
                self.path.cancel(st.request_id)
            self.path.cancel_peer(peer.address)
        self.peers.forget(peer)
        self.peers.hello(peer.address)

    def fail_peer(self, peer: ReceiverPeer, reason: str, only_epoch: int = 0) -> None:
        """Fail the peer's requests (of incarnation `only_epoch` if given) and cancel every write posted
        to it (the peer is gone or restarted: all of them went to the dead incarnation); call before
        its transport connection is dropped."""
        with self.requests.lock:
            for st in self.requests:
                if st.handle.address != peer.address or (only_epoch and st.handle.epoch != only_epoch):
                    continue
                st.answered = True  # no Begin answer will come from a dead incarnation
                if not st.status.is_terminal:
                    self.requests.set_status(st, S.FAILED, reason)
                self.path.cancel(st.request_id)
            self.path.cancel_peer(peer.address)

    def housekeeping(self) -> None:
        """Lost receivers (their requests failed), our KeepAlives, request deadlines. Call right after
        the sockets were drained (peers.py)."""
        now = time.monotonic()
        for peer, why, unanswered in self.peers.lost(now):
            self.fail_peer(peer, why)
            if unanswered:
                self.peers.give_up_hello(peer, why)
            else:
                self.peers.forget(peer)
        self.peers.beat(now)
        with self.requests.lock:
            for st in self.requests:
                if not st.status.is_terminal and now > st.deadline:
                    self.requests.set_status(st, S.FAILED, f"deadline of {st.handle.timeout_s}s passed")
                    # posted writes may carry other requests' layers too: they complete, fail, or are
                    # cancelled when their receiver is declared lost
                    self.path.cancel(st.request_id)
                    st.fence_later(aborted=False)

    def flush_fences(self) -> None:
        """Send the Stopped or Withdraw of each ended request that can have it now."""
        with self.requests.lock:
            for st in self.requests:
                if st.fence is None or st.inflight:
                    continue
                if st.begun:  # only a begun request can have written anything
                    self.peers.send(self.peers.get(st.handle.address),
                                    wire.Stopped(st.request_id, st.fence, st.reason))
                elif not st.begin_sent and not self._withdraw(st, st.fence):
                    continue  # never begun: its Withdraw waits for the receiver's HelloReply
                # (a Begin in flight: its answer decides, on_message)
                st.fence = None

    def _withdraw(self, st: SendState, aborted: bool) -> bool:
        """Tell the receiver that the terminal request `st`, whose Begin never went out, will never be
        claimed nor written (lock held). True when done: sent, or nothing to tell (the receiver
        incarnation its handle names is gone, or never answered our Hello); False while our handshake
        with that receiver is pending: called again after its answer."""
        peer = self.peers.find(st.handle.address)
        if peer is None:
            return True
        if peer.epoch == st.handle.epoch:
            self.peers.send(peer, wire.Withdraw(st.request_id, peer.epoch, aborted, st.reason))
            return True
        return not (peer.epoch == 0 and peer.hello_at)
