"""ReceiverEndpoint: the decode worker's side; owns the destination blocks and decides when they are free.

The public surface and its contract are `api.KVReceiver`. The receiver binds one zmq ROUTER socket
(its control address, in every KVHandle it makes) and runs one loop thread (loop.py); its senders'
handshakes and liveness are senders.py.

Block lifetime: a request's blocks are releasable only when no write can still land in them: after
DONE, after the claiming sender said Stopped, when no sender claimed the request (Begin; a sender that
gives it up first says Withdraw), or when its deadline passed and its sender is gone (lost, or back
with a new epoch). A sender dropped while alive (e.g. its loop stalled past peer_timeout_s) is told
so: any message but Hello from a sender we do not know is answered with Rehandshake. Its dropped
requests stay FAILED and held until their deadline, whatever it says later: no Stopped of it is
trusted for them (its writes were cancelled, not completed).

Withdraw ends a request only if it is of this receiver's epoch, still PENDING and claimed by no
sender: no sender ever wrote into its blocks, so they are releasable at once; a claimed request ends
by Done, Stopped, Abort or its deadline.

One loop step: wait (an idle poll; naps with `transport.poll()` between them while a request is
TRANSFERRING, i.e. during its sender's prefill; nothing while a command waits or a two-sided transport
has receives posted), read every control message, liveness and deadlines right after, then what the
transport reports landed.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import zmq

from kvtransfer import wire
from kvtransfer.api import (
    KVHandle,
    ReceiverStats,
    RecvSnapshot,
    TransferConfig,
    TransferStatus,
)
from kvtransfer.compat import KVCompat, kv_compat, mismatches
from kvtransfer.loop import LoopThread
from kvtransfer.requests import RecvState, RequestTable
from kvtransfer.runs import layer_pieces
from kvtransfer.senders import SenderPeer, SenderPeers, accepted, notices_from
from kvtransfer.staging import layer_checksum, layout_of
from kvtransfer.transports.base import RecvTransport
from kvtransfer.wakeup import Waker, nap_until

S = TransferStatus
IDLE_POLL_MS = 10  # longest sleep of an idle loop, and the longest run of naps while due


@dataclass(frozen=True, slots=True)
class PostedReceive:
    """A two-sided receive of one request-layer, posted on a LayerNotice: its request and layer, the
    notice's checksum, and the zmq identity of the sender that announced it."""

    request_id: str
    layer: int
    checksum: int | None
    sender: bytes


class ReceiverEndpoint:
    """Receives requests' KV into `kv_buffer [num_layers, 2, num_blocks, block_size, H, D]` over
    `transport` (api.KVReceiver). Raises ValueError if kv_buffer is not a paged KV tensor with
    contiguous blocks."""

    def __init__(self, config: TransferConfig, kv_buffer: torch.Tensor, transport: RecvTransport) -> None:
        self.config = config
        self.kv_buffer = kv_buffer
        self.layout = layout_of(kv_buffer)
        self.compat: KVCompat = kv_compat(config.model_id, config.backend, self.layout, config.tp_size,
                                          config.tp_rank)
        self.epoch = wire.new_epoch()
        self.transport = transport
        self.address = ""
        label = f"KVReceiver {config.worker_id}"
        self._requests: RequestTable[RecvState] = RequestTable(label)
        self._loop = LoopThread(f"kv-receiver-{config.worker_id}", label, self._step, self._teardown,
                                self._crashed, Waker())
        self._senders = SenderPeers(config)
        self._posted: dict[int, PostedReceive] = {}
        self._keys = itertools.count(1)
        self._trace: list[tuple[float, str, str, int]] | None = None

    def start(self) -> ReceiverEndpoint:
        """Bind the control socket and start the loop (api.KVReceiver.start)."""
        self._loop.start(self._bind)
        return self

    def _bind(self) -> None:
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        if self.config.port:
            self._sock.bind(f"tcp://{self.config.host}:{self.config.port}")
        else:
            self._sock.bind_to_random_port(f"tcp://{self.config.host}")
        self.address = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._poller = zmq.Poller()  # idle sleep: a message or a command (the waker) ends it
        self._poller.register(self._sock, zmq.POLLIN)
        self._poller.register(self._loop.waker.fd, zmq.POLLIN)

    # ---- the worker's surface (api.KVReceiver) -----------------------------------------------------
    def expect(self, request_id: str, block_ids: list[int], timeout_s: float | None = None) -> KVHandle:
        """Register a request whose KV will land in `block_ids` (api.KVReceiver.expect)."""
        if not block_ids or len(set(block_ids)) != len(block_ids):
            raise ValueError(f"block_ids must be non-empty and distinct, got {block_ids[:8]}...")
        layer_pieces(self.layout, tuple(block_ids), 0)  # range check
        timeout = timeout_s or self.config.timeout_s
        handle = KVHandle(worker_id=self.config.worker_id, epoch=self.epoch, request_id=request_id,
                          block_ids=tuple(block_ids), layout=self.layout, address=self.address,
                          backend=self.config.backend, timeout_s=timeout)
        with self._requests.lock:
            self._requests.add(RecvState(handle, time.monotonic() + timeout),
                               f"request_id {request_id!r} already expected")
        return handle

    def abort(self, request_id: str) -> None:
        """ABORTED now, the sender is told (api.KVReceiver.abort)."""
        with self._requests.lock:
            st = self._requests.get(request_id)
            if st.status.is_terminal:
                return
            self._requests.set_status(st, S.ABORTED, "aborted by receiver")
            sender = st.sender
        if sender is not None:
            self._loop.call(lambda: self._send(sender, wire.Abort(request_id)))

    def status(self, request_id: str) -> TransferStatus:
        """The request's status (api.KVReceiver.status)."""
        return self._requests.status(request_id)

    def reason(self, request_id: str) -> str:
        """Why the request FAILED or was ABORTED (api.KVReceiver.reason)."""
        return self._requests.reason(request_id)

    def wait(self, request_id: str, timeout: float) -> TransferStatus:
        """Block until the request is terminal or `timeout` s pass (api.KVReceiver.wait)."""
        return self._requests.wait(request_id, timeout)

    def releasable(self, request_id: str) -> bool:
        """Whether no write can still land in the request's blocks (api.KVReceiver.releasable)."""
        with self._requests.lock:
            return self._releasable(self._requests.get(request_id))

    def release(self, request_id: str) -> None:
        """Forget a releasable request (api.KVReceiver.release)."""
        with self._requests.lock:
            st = self._requests.get(request_id)
            if not self._releasable(st):
                raise RuntimeError(f"request {request_id!r} ({st.status.name}) may still be written")
            self._requests.remove(request_id)

    def _releasable(self, st: RecvState) -> bool:
        if not st.status.is_terminal or any(p.request_id == st.request_id for p in self._posted.values()):
            return False
        return st.sender is None or st.stopped or (st.gone and time.monotonic() > st.deadline)

    def pending(self) -> list[str]:
        """Request ids not yet released (api.KVReceiver.pending)."""
        return self._requests.pending()

    def close(self, timeout: float = 5.0) -> None:
        """Stop the loop and release socket and transport (api.KVReceiver.close)."""
        self._loop.close(timeout)

    def check_no_leaks(self) -> None:
        """Raise AssertionError if a request is still tracked (api.KVReceiver.check_no_leaks)."""
        self._requests.check_no_leaks()

    # ---- observation and operation (api.KVReceiver) ------------------------------------------------
    def ended_at(self, request_id: str) -> float | None:
        """When the request became terminal (api.KVReceiver.ended_at)."""
        return self._requests.ended_at(request_id)

    def wait_until(self, pred: Callable[[], bool], timeout: float) -> bool:
        """Block until `pred()` holds under the receiver's lock (api.KVReceiver.wait_until)."""
        return self._requests.wait_until(pred, timeout)

    def snapshot(self, request_id: str) -> RecvSnapshot:
        """A copy of the request's state (api.KVReceiver.snapshot)."""
        with self._requests.lock:
            st = self._requests.get(request_id)
            return RecvSnapshot(status=st.status, reason=st.reason, layers=frozenset(st.layers),
                                claimed=st.sender is not None, stopped=st.stopped, sender_gone=st.gone)

    def stats(self) -> ReceiverStats:
        """The receiver now (api.KVReceiver.stats)."""
        return ReceiverStats(loop=self._loop.stats(), senders=self._senders.ids(),
                             receives_posted=len(self._posted))

    def drop_sender(self, sender_id: str, reason: str) -> None:
        """Drop every known sender called `sender_id` as if lost (api.KVReceiver.drop_sender)."""
        def run() -> None:
            for s in self._senders.named(sender_id):
                self._drop_sender(s, reason)
        self._loop.call(run)

    def set_trace(self, trace: list[tuple[float, str, str, int]] | None) -> None:
        """Record "notice" and "done_sent" events into `trace` (api.KVReceiver.set_trace)."""
        self._trace = trace

    def run_in_loop(self, fn: Callable[[], None]) -> None:
        """Run `fn` on the loop thread before its next step (api.KVReceiver.run_in_loop)."""
        self._loop.call(fn)

    # ---- the loop thread ----------------------------------------------------------------------------
    def _step(self) -> None:
        self._wait()
        while int(self._sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:  # every message queued now
            frames = self._sock.recv_multipart(zmq.NOBLOCK)  # [identity, message] from a DEALER
            msg = wire.decode_from(frames[-1], frames[0].hex()) if len(frames) == 2 else None
            if msg is not None:  # garbage (logged) or a malformed multipart: skipped, the loop lives on
                self._on_message(frames[0], msg)
        # liveness right after reading every pending message: a stall of this loop (a starved thread,
        # a slow transport call) must not count as the senders' silence (their heartbeats wait unread)
        self._housekeeping()
        self._poll_transport()

    def _wait(self) -> None:
        """Wait before a step unless a command is queued. Idle: the zmq poller, up to IDLE_POLL_MS. Due (a
        request TRANSFERRING, i.e. the sender's whole prefill): wakeup.nap_until, naps of busy_wait_s
        with the GIL released and `transport.poll()` (no fd signals it) between two, up to IDLE_POLL_MS:
        a landing is seen <= busy_wait_s (+ timer slack) late, a message, command or close() ends a nap
        at once. A two-sided transport with receives posted (ucx: rendezvous completes only inside
        progress calls) steps back to back while its data moves."""
        loop, waker = self._loop, self._loop.waker
        if loop.has_commands() or (self._posted and not self.transport.one_sided):
            return
        with self._requests.lock:
            due = bool(self._posted) or any(st.status is S.TRANSFERRING for st in self._requests)
        waker.sleeping = True  # then look again: a command queued before this sent no byte
        if not loop.has_commands():
            if due:
                woke = nap_until(waker, [self._sock], self.config.busy_wait_s, IDLE_POLL_MS / 1e3,
                                 self._poll_transport)
            else:
                woke = bool(self._poller.poll(IDLE_POLL_MS))
            if woke:
                waker.drain()
        waker.sleeping = False

    def _poll_transport(self) -> bool:
        """Handle what the transport reports landed (one-sided notices, two-sided keys), all of them
        under one lock acquisition (a request's notices may arrive as one LayerNotices batch); True if
        any. A notice that does not decode, names a layer out of range or a request its peer did not
        claim is logged and ignored (senders.py)."""
        notices, keys = self.transport.poll()
        got = [(peer, n) for peer, raw in notices for n in notices_from(peer, raw)]  # garbage: skipped
        if got and self._trace is not None:
            now = time.perf_counter()
            self._trace.extend((now, "notice", n.request_id, n.layer) for _, n in got)
        landed = [(p.request_id, p.layer, p.checksum) for p in map(self._posted.pop, keys)]
        if got or landed:
            with self._requests.lock:  # a notice from a peer that did not claim its request: ignored
                num_layers = self.layout.num_layers
                landed += [(n.request_id, n.layer, n.checksum) for peer, n in got
                           if accepted(peer, n, self._requests.find(n.request_id), num_layers)]
                for request_id, layer, checksum in landed:
                    self._landed(request_id, layer, checksum)
        return bool(got or landed)

    def _send(self, identity: bytes, msg: wire.Message) -> None:
        self._sock.send_multipart([identity, wire.encode(msg)], zmq.NOBLOCK)

    def _on_message(self, identity: bytes, msg: wire.Message) -> None:
        known = self._senders.seen(identity) is not None
        if isinstance(msg, wire.Hello):
            self._on_hello(identity, msg)
        elif not known:  # we dropped it (or restarted) while it lives on: tell it to Hello again
            self._send(identity, wire.Rehandshake(self.config.worker_id, self.epoch,
                                                  self._senders.why_unknown(identity)))
        elif isinstance(msg, wire.Begin):
            self._send(identity, self._on_begin(identity, msg))
        elif isinstance(msg, wire.LayerNotice):
            self._on_notice(identity, msg)
        elif isinstance(msg, wire.Withdraw):
            self._on_withdraw(msg)
        elif isinstance(msg, wire.Stopped):
            self._on_stopped(identity, msg)

    def _on_hello(self, identity: bytes, hello: wire.Hello) -> None:
        bad = mismatches(hello.info, self.compat)  # the sender's values first
        if not bad:
            for old in self._senders.restarted(hello):
                self._drop_sender(old, f"sender {hello.sender_id} restarted (new epoch)")
            if not self._senders.known(identity):
                self.transport.add_peer(identity.hex(), hello.transport)
                self._senders.add(identity, hello)
        self._send(identity, wire.HelloReply(self.config.worker_id, self.epoch, bad,
                                             b"" if bad else self.transport.metadata()))

    def _on_begin(self, identity: bytes, msg: wire.Begin) -> wire.BeginReply:
        if msg.receiver_epoch != self.epoch:
            return wire.BeginReply(msg.request_id, False, f"stale epoch {msg.receiver_epoch} != {self.epoch}")
        with self._requests.lock:
            st = self._requests.find(msg.request_id)
            if st is not None and st.sender == identity and st.status is S.TRANSFERRING:
                return wire.BeginReply(msg.request_id, True)  # duplicate Begin
            if st is None or st.status is not S.PENDING:
                why = "unknown request" if st is None else f"request is {st.status.name}"
                return wire.BeginReply(msg.request_id, False, why)
            st.sender = identity
            self._requests.set_status(st, S.TRANSFERRING)
        return wire.BeginReply(msg.request_id, True)

    def _on_notice(self, identity: bytes, n: wire.LayerNotice) -> None:
        """A two-sided LayerNotice: post the receives of its pieces (ignored, with a warning, on a
        one-sided transport, for a layer or cuts out of range, or from a sender that did not claim it)."""
        if self.transport.one_sided:  # its notices travel with the data: never one on the control plane
            wire.log.warning("ignored a notice for %r from %s: the transport is one-sided", n.request_id,
                             identity.hex())
            return
        with self._requests.lock:
            st = self._requests.find(n.request_id)
            if st is None or st.sender != identity or st.gone:
                return
            try:
                pieces = layer_pieces(self.layout, st.handle.block_ids, n.layer, n.cuts)
            except (ValueError, IndexError) as exc:  # a bad layer or cuts: never posted nor landed
                wire.log.warning("ignored a notice for %r from %s: %s", n.request_id, identity.hex(), exc)
                return
        key = next(self._keys)
        self._posted[key] = PostedReceive(n.request_id, n.layer, n.checksum, identity)
        self.transport.post(identity.hex(), key, [(dst, size) for _, dst, size in pieces], n.tag)

    def _on_withdraw(self, msg: wire.Withdraw) -> None:
        """End the PENDING, unclaimed request `msg.request_id` of this epoch: ABORTED ("aborted by
        sender before Begin") or FAILED (with the sender's reason). Anything else: ignored."""
        if msg.receiver_epoch != self.epoch:
            return  # meant for another incarnation of this receiver
        with self._requests.lock:
            st = self._requests.find(msg.request_id)
            if st is None or st.status is not S.PENDING or st.sender is not None:
                return
            self._requests.set_status(st, S.ABORTED if msg.aborted else S.FAILED,
                                      "aborted by sender before Begin" if msg.aborted
                                      else f"sender gave up before Begin: {msg.reason}")

    def _on_stopped(self, identity: bytes, msg: wire.Stopped) -> None:
        """The claiming sender writes nothing more: ABORTED or FAILED, and its blocks releasable (not
        for a sender dropped since it claimed the request: see the module docstring)."""
        with self._requests.lock:
            st = self._requests.find(msg.request_id)
            if st is not None and st.sender == identity and not st.gone:
                st.stopped = True
                why = "aborted by sender" if msg.aborted else f"sender stopped: {msg.reason}"
                self._requests.set_status(st, S.ABORTED if msg.aborted else S.FAILED, why)
                self._requests.lock.notify_all()

    def _landed(self, request_id: str, layer: int, checksum: int | None) -> None:
        """One request-layer landed (lock held): DONE and Done sent at its last layer."""
        st = self._requests.find(request_id)
        if st is None or st.status.is_terminal or st.sender is None:
            self._requests.lock.notify_all()
            return
        if self.config.checksum and checksum is not None:
            got = layer_checksum(self.kv_buffer, layer, st.handle.block_ids)
            if got != checksum:
                self._requests.set_status(st, S.FAILED,
                                          f"checksum mismatch in layer {layer}: {got:#x} != {checksum:#x}")
                self._send(st.sender, wire.Fail(request_id, st.reason))
                return
        st.layers.add(layer)
        if len(st.layers) == self.layout.num_layers:
            st.stopped = True
            self._requests.set_status(st, S.DONE)
            if self._trace is not None:
                self._trace.append((time.perf_counter(), "done_sent", request_id, -1))
            self._send(st.sender, wire.Done(request_id))

    def _housekeeping(self) -> None:
        """Drop lost senders, send our KeepAlives, fail requests past their deadline (Abort to their
        sender)."""
        now = time.monotonic()
        for sender, why in self._senders.lost(now):
            self._drop_sender(sender, why)
        for identity in self._senders.due_beats(now):
            self._send(identity, wire.KeepAlive(self.epoch))
        with self._requests.lock:
            for st in self._requests:
                if not st.status.is_terminal and now > st.deadline:
                    self._requests.set_status(st, S.FAILED, f"deadline of {st.handle.timeout_s}s passed")
                    if st.sender is not None:
                        self._send(st.sender, wire.Abort(st.request_id))
            self._requests.lock.notify_all()

    def _drop_sender(self, sender: SenderPeer, reason: str) -> None:
        """Forget `sender`: its transport connection and posted receives go, its requests FAILED and
        gone (held until their deadline)."""
        self._senders.forget(sender, reason)
        self.transport.remove_peer(sender.identity.hex())
        self._posted = {k: v for k, v in self._posted.items() if v.sender != sender.identity}
        with self._requests.lock:
            for st in self._requests:
                if st.sender == sender.identity:
                    st.gone = True
                    self._requests.set_status(st, S.FAILED, reason)
            self._requests.lock.notify_all()

    def _crashed(self, exc: BaseException) -> None:
        with self._requests.lock:
            for st in self._requests:
                if not st.status.is_terminal:
                    self._requests.set_status(st, S.FAILED, f"endpoint loop crashed: {exc!r}")

    def _teardown(self) -> None:
        self.transport.close()
        self._sock.close(0)  # bound by start() before the loop thread ran
        self._ctx.term()
        self._loop.waker.close()
