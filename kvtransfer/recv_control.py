"""The receiver's side of each request's exchange with its senders (loop thread only).

A request is claimed by the first sender whose Begin names it while it is PENDING (and this receiver's
epoch); only that sender's layers count (a LayerNotice on the control plane posts its receives on a
two-sided transport; a one-sided transport's notices arrive with the data, senders.accepted judges
them), and DONE, with Done to the sender, comes at the last layer. What else ends it: Stopped from its
sender (it writes nothing more), Withdraw (a PENDING request no sender claimed), the worker's abort
(receiver.py), its deadline (the claim deadline until Begin, then `timeout_s` from the Begin, moved
on by each landed layer; Abort to its sender), or its sender dropped (lost, restarted, or
drop_sender: FAILED and `gone`, blocks held until the deadline). `releasable` is the block-lifetime
rule of receiver.py. With config.fence_senders, a Hello whose (sender id, epoch) is not the pair the
worker last admitted for that id (an id never admitted: `unregistered_sender`; an admitted id with
another epoch, e.g. a restarted or impostor sender: `unnamed_sender_epoch`) is answered with a
HelloReply naming why, its transport metadata never reaches the transport, and it is counted and
logged once per sender id (an unknown one) or per sender id and epoch (a known one) (`fence`). A
known sender whose id was admitted since with another epoch is dropped at its next message (which is
answered with Rehandshake, and its Hello then refused).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvtransfer import wire
from kvtransfer.compat import KVCompat, mismatches
from kvtransfer.curve import Refusals
from kvtransfer.requests import RecvState, RequestTable
from kvtransfer.runs import layer_pieces
from kvtransfer.senders import SenderPeer, SenderPeers, accepted, notices_from
from kvtransfer.staging import layer_checksum
from kvtransfer.transports.base import RecvTransport
from kvtransfer.types import KVLayout, TransferConfig, TransferStatus

S = TransferStatus
UNREGISTERED_SENDER = "unregistered_sender"  # a Hello from a sender id not admitted (fence_senders)
UNNAMED_EPOCH = "unnamed_sender_epoch"  # a Hello from an admitted id with another epoch (fence_senders)


@dataclass(frozen=True, slots=True)
class PostedReceive:
    """A two-sided receive of one request-layer, posted on a LayerNotice: its request and layer, the
    notice's checksum, and the zmq identity of the sender that announced it."""

    request_id: str
    layer: int
    checksum: int | None
    sender: bytes


class RecvControl:
    """Messages, landings, deadlines and dropped senders of one receiver's requests (`requests`), for a
    receiver of `epoch` with `kv_buffer` of `layout` over `transport`; `send(identity, msg)` answers a
    sender. `trace`: a list for benchmark events (set_trace), or None."""

    def __init__(self, config: TransferConfig, epoch: int, compat: KVCompat, kv_buffer: torch.Tensor,
                 layout: KVLayout, transport: RecvTransport, requests: RequestTable[RecvState],
                 senders: SenderPeers, send: Callable[[bytes, wire.Message], None]) -> None:
        self.config, self.epoch, self.compat = config, epoch, compat
        self.kv_buffer, self.layout, self.transport = kv_buffer, layout, transport
        self.requests, self.senders, self._send = requests, senders, send
        self.posted: dict[int, PostedReceive] = {}
        self._keys = itertools.count(1)
        self.trace: list[tuple[float, str, str, int]] | None = None
        # config.fence_senders: (admitted sender id → epoch, where to count a refused Hello); None: no fence
        self.fence: tuple[dict[str, int], Refusals] | None = None

    def releasable(self, st: RecvState) -> bool:
        """Whether no write can still land in `st`'s blocks (lock held; receiver.py)."""
        if not st.status.is_terminal or any(p.request_id == st.request_id for p in self.posted.values()):
            return False
        return st.sender is None or st.stopped or (st.gone and time.monotonic() > st.deadline)

    def poll_transport(self) -> bool:
        """Handle what the transport reports landed (one-sided notices, two-sided keys), all of them
        under one lock acquisition (a request's notices may arrive as one LayerNotices batch); True if
        any. A notice that does not decode, names a layer out of range or a request its peer did not
        claim is logged and ignored (senders.py)."""
        notices, keys = self.transport.poll()
        got = [(peer, n) for peer, raw in notices for n in notices_from(peer, raw)]  # garbage: skipped
        if got and self.trace is not None:
            now = time.perf_counter()
            self.trace.extend((now, "notice", n.request_id, n.layer) for _, n in got)
        landed = [(p.request_id, p.layer, p.checksum) for p in map(self.posted.pop, keys)]
        if got or landed:
            with self.requests.lock:  # a notice from a peer that did not claim its request: ignored
                num_layers = self.layout.num_layers
                landed += [(n.request_id, n.layer, n.checksum) for peer, n in got
                           if accepted(peer, n, self.requests.find(n.request_id), num_layers)]
                for request_id, layer, checksum in landed:
                    self._landed(request_id, layer, checksum)
        return bool(got or landed)

    def on_message(self, identity: bytes, msg: wire.Message) -> None:
        sender = self.senders.seen(identity)
        named = None if sender is None or self.fence is None else self.fence[0].get(sender.sender_id)
        if sender is not None and self.fence is not None and named != sender.epoch:
            # a known sender whose id the worker has since admitted with another epoch: superseded
            self.drop_sender(sender, f"sender {sender.sender_id} epoch {sender.epoch} superseded: its "
                                     f"gateway named epoch {named}")
            sender = None
        known = sender is not None
        if isinstance(msg, wire.Hello):
            self._on_hello(identity, msg)
        elif not known:  # we dropped it (or restarted) while it lives on: tell it to Hello again
            self._send(identity, wire.Rehandshake(self.config.worker_id, self.epoch,
                                                  self.senders.why_unknown(identity)))
        elif isinstance(msg, wire.Begin):
            self._send(identity, self._on_begin(identity, msg))
        elif isinstance(msg, wire.LayerNotice):
            self._on_notice(identity, msg)
        elif isinstance(msg, wire.Withdraw):
            self._on_withdraw(msg)
        elif isinstance(msg, wire.Stopped):
            self._on_stopped(identity, msg)

    def _on_hello(self, identity: bytes, hello: wire.Hello) -> None:
        refused = self._fenced(hello)
        if refused:
            self._send(identity, wire.HelloReply(self.config.worker_id, self.epoch, [refused], b""))
            return
        bad = mismatches(hello.info, self.compat)  # the sender's values first
        if not bad:
            for old in self.senders.restarted(hello):
                self.drop_sender(old, f"sender {hello.sender_id} restarted (new epoch)")
            if not self.senders.known(identity):
                try:
                    self.transport.add_peer(identity.hex(), hello.transport)
                except Exception as exc:  # any transport's parse or connect failure: the sender is unusable
                    bad = [f"transport metadata unusable: {type(exc).__name__}: {exc}"]
                    wire.log.warning("KV sender %s refused: %s", hello.sender_id, bad[0])
                else:
                    self.senders.add(identity, hello)
        self._send(identity, wire.HelloReply(self.config.worker_id, self.epoch, bad,
                                             b"" if bad else self.transport.metadata()))

    def _fenced(self, hello: wire.Hello) -> str:
        """Why the fence refuses `hello` (counted; see the module docstring), "" if it passes or there is
        no fence."""
        if self.fence is None:
            return ""
        admitted, refusals = self.fence
        want = admitted.get(hello.sender_id)
        if want == hello.epoch:
            return ""
        if want is None:
            refusals.refused(UNREGISTERED_SENDER, hello.sender_id)
            return (f"sender {hello.sender_id!r} was not named to this receiver by its gateway (not a "
                    f"registered prefill worker)")
        refusals.refused(UNNAMED_EPOCH, f"{hello.sender_id} epoch {hello.epoch}")
        return (f"sender {hello.sender_id!r} epoch {hello.epoch} is not the incarnation its gateway named "
                f"to this receiver (epoch {want}): restarted without registering again, or not that worker")

    def _on_begin(self, identity: bytes, msg: wire.Begin) -> wire.BeginReply:
        if msg.receiver_epoch != self.epoch:
            return wire.BeginReply(msg.request_id, False, f"stale epoch {msg.receiver_epoch} != {self.epoch}")
        with self.requests.lock:
            st = self.requests.find(msg.request_id)
            if st is not None and st.sender == identity and st.status is S.TRANSFERRING:
                return wire.BeginReply(msg.request_id, True)  # duplicate Begin
            if st is None or st.status is not S.PENDING:
                why = "unknown request" if st is None else f"request is {st.status.name}"
                return wire.BeginReply(msg.request_id, False, why)
            st.sender = identity
            st.deadline = time.monotonic() + st.handle.timeout_s  # the transfer's own time starts now
            self.requests.set_status(st, S.TRANSFERRING)
        return wire.BeginReply(msg.request_id, True)

    def _on_notice(self, identity: bytes, n: wire.LayerNotice) -> None:
        """A two-sided LayerNotice: post the receives of its pieces (ignored, with a warning, on a
        one-sided transport, for a layer or cuts out of range, or from a sender that did not claim it)."""
        if self.transport.one_sided:  # its notices travel with the data: never one on the control plane
            wire.log.warning("ignored a notice for %r from %s: the transport is one-sided", n.request_id,
                             identity.hex())
            return
        with self.requests.lock:
            st = self.requests.find(n.request_id)
            if st is None or st.sender != identity or st.gone:
                return
            try:
                pieces = layer_pieces(self.layout, st.handle.block_ids, n.layer, n.cuts)
            except (ValueError, IndexError) as exc:  # a bad layer or cuts: never posted nor landed
                wire.log.warning("ignored a notice for %r from %s: %s", n.request_id, identity.hex(), exc)
                return
        key = next(self._keys)
        self.posted[key] = PostedReceive(n.request_id, n.layer, n.checksum, identity)
        self.transport.post(identity.hex(), key, [(dst, size) for _, dst, size in pieces], n.tag)

    def _on_withdraw(self, msg: wire.Withdraw) -> None:
        """End the PENDING, unclaimed request `msg.request_id` of this epoch: ABORTED ("aborted by
        sender before Begin") or FAILED (with the sender's reason). Anything else: ignored."""
        if msg.receiver_epoch != self.epoch:
            return  # meant for another incarnation of this receiver
        with self.requests.lock:
            st = self.requests.find(msg.request_id)
            if st is None or st.status is not S.PENDING or st.sender is not None:
                return
            self.requests.set_status(st, S.ABORTED if msg.aborted else S.FAILED,
                                      "aborted by sender before Begin" if msg.aborted
                                      else f"sender gave up before Begin: {msg.reason}")

    def _on_stopped(self, identity: bytes, msg: wire.Stopped) -> None:
        """The claiming sender writes nothing more: ABORTED or FAILED, and its blocks releasable (not
        for a sender dropped since it claimed the request: see the module docstring)."""
        with self.requests.lock:
            st = self.requests.find(msg.request_id)
            if st is not None and st.sender == identity and not st.gone:
                st.stopped = True
                why = "aborted by sender" if msg.aborted else f"sender stopped: {msg.reason}"
                self.requests.set_status(st, S.ABORTED if msg.aborted else S.FAILED, why)
                self.requests.lock.notify_all()

    def _landed(self, request_id: str, layer: int, checksum: int | None) -> None:
        """One request-layer landed (lock held): DONE and Done sent at its last layer."""
        st = self.requests.find(request_id)
        if st is None or st.status.is_terminal or st.sender is None:
            self.requests.lock.notify_all()
            return
        if self.config.checksum and checksum is not None:
            got = layer_checksum(self.kv_buffer, layer, st.handle.block_ids)
            if got != checksum:
                self.requests.set_status(st, S.FAILED,
                                          f"checksum mismatch in layer {layer}: {got:#x} != {checksum:#x}")
                self._send(st.sender, wire.Fail(request_id, st.reason))
                return
        st.layers.add(layer)
        st.deadline = max(st.deadline, time.monotonic() + st.handle.timeout_s)  # progress extends it
        if len(st.layers) == self.layout.num_layers:
            st.stopped = True
            self.requests.set_status(st, S.DONE)
            if self.trace is not None:
                self.trace.append((time.perf_counter(), "done_sent", request_id, -1))
            self._send(st.sender, wire.Done(request_id))

    def housekeeping(self) -> None:
        """Drop lost senders, send our KeepAlives, fail requests past their deadline (Abort to their
        sender)."""
        now = time.monotonic()
        for sender, why in self.senders.lost(now):
            self.drop_sender(sender, why)
        for identity in self.senders.due_beats(now):
            self._send(identity, wire.KeepAlive(self.epoch))
        with self.requests.lock:
            for st in self.requests:
                if not st.status.is_terminal and now > st.deadline:
                    why = (f"deadline passed: no layer landed within {st.handle.timeout_s}s of the Begin or "
                           f"the last layer" if st.sender is not None
                           else "deadline passed before any sender began the transfer")
                    self.requests.set_status(st, S.FAILED, why)
                    if st.sender is not None:
                        self._send(st.sender, wire.Abort(st.request_id))
            self.requests.lock.notify_all()

    def drop_sender(self, sender: SenderPeer, reason: str) -> None:
        """Forget `sender`: its transport connection and posted receives go, its requests FAILED and
        gone (held until their deadline)."""
        self.senders.forget(sender, reason)
        self.transport.remove_peer(sender.identity.hex())
        self.posted = {k: v for k, v in self.posted.items() if v.sender != sender.identity}
        with self.requests.lock:
            for st in self.requests:
                if st.sender == sender.identity:
                    st.gone = True
                    self.requests.set_status(st, S.FAILED, reason)
            self.requests.lock.notify_all()
