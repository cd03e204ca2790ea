"""KVReceiver: the decode worker's side; owns the destination blocks and decides when they are free.

A block is released only when no write can still land in it: after DONE, after the sender said
Stopped, when no sender claimed the request (Begin; a sender that gives it up first says Withdraw,
recv_withdraw.py), or when the deadline passed and the sender is gone (heartbeats lost, or it came
back with a new epoch). A sender dropped while alive (its loop stalled past peer_timeout_s) is told
so: any message but Hello from a sender we do not know is answered with messages.Rehandshake; its
dropped requests stay FAILED and held until their deadline, whatever it says later (no Stopped of it
is trusted for them: its writes were cancelled, not completed).
"""

from __future__ import annotations

import itertools
import time

import torch
import zmq

from kvtransfer import wire as m
from kvtransfer.api import KVHandle, ReceiverStats, RecvSnapshot, TransferConfig, TransferStatus
from kvtransfer.compat import mismatches, peer_info
from kvtransfer.endpoint import RequestState
from kvtransfer.recv_liveness import SenderLiveness, _Sender
from kvtransfer.recv_notices import accepted, decode_from
from kvtransfer.recv_withdraw import WithdrawReceiver
from kvtransfer.runs import layer_pieces
from kvtransfer.staging import layer_checksum, layout_of
from kvtransfer.transports.base import RecvTransport
from kvtransfer.wakeup import Waker, nap_until

S = TransferStatus
IDLE_POLL_MS = 10  # longest sleep of an idle loop, and the longest run of naps while due


class KVReceiver(WithdrawReceiver, SenderLiveness):
    """Receives requests' KV into `kv_buffer [num_layers, 2, num_blocks, block_size, H, D]`.

    Raises ValueError if kv_buffer is not a paged KV tensor with contiguous blocks.
    """

    def __init__(self, config: TransferConfig, kv_buffer: torch.Tensor, transport: RecvTransport) -> None:
        super().__init__(config)
        self.kv_buffer = kv_buffer
        self.layout = layout_of(kv_buffer)
        self.info = peer_info(config, self.layout)
        self.transport = transport
        self.address = ""
        self._senders: dict[bytes, _Sender] = {}
        self._forgotten: dict[bytes, str] = {}  # dropped sender identity → why (for its Rehandshake)
        self._posted: dict[int, tuple[str, int, int | None, bytes]] = {}
        self._keys = itertools.count(1)
        self._next_beat = 0.0
        self._trace: list[tuple[float, str, str, int]] | None = None
        self._waker = Waker()  # commands and close() cut the loop's idle poll (or nap) short

    def set_trace(self, trace: list[tuple[float, str, str, int]] | None) -> None:
        """Append (time.perf_counter() s, what, request_id, layer) events to `trace` (None: off):
        "notice" when a layer's notice was read (with the data), "done_sent" when Done is handed to
        zmq for the sender. For benchmarks (the list grows without bound)."""
        self._trace = trace

    def start(self) -> KVReceiver:
        """Bind the control socket (config.host, config.port; 0 = free port) and start the loop. Does
        nothing on a running receiver; raises TransferError after close(), zmq.ZMQError if the bind
        fails (endpoint.py: one loop thread per endpoint)."""
        self._start_thread(f"kv-receiver-{self.config.worker_id}", self._bind)
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
        self._poller.register(self._waker.fd, zmq.POLLIN)

    # ---- public API -----------------------------------------------------------------------------
    def expect(self, request_id: str, block_ids: list[int], timeout_s: float | None = None) -> KVHandle:
        """Register a request whose KV will land in `block_ids` (token order); returns its KVHandle.

        Raises ValueError on a duplicate request id, empty or out-of-range block ids.
        """
        if not block_ids or len(set(block_ids)) != len(block_ids):
            raise ValueError(f"block_ids must be non-empty and distinct, got {block_ids[:8]}...")
        layer_pieces(self.layout, tuple(block_ids), 0)  # range check
        timeout = timeout_s or self.config.timeout_s
        handle = KVHandle(worker_id=self.config.worker_id, epoch=self.epoch, request_id=request_id,
                          block_ids=tuple(block_ids), layout=self.layout, address=self.address,
                          backend=self.config.backend, timeout_s=timeout)
        with self._lock:
            if request_id in self._requests:
                raise ValueError(f"request_id {request_id!r} already expected")
            self._requests[request_id] = RequestState(handle, time.monotonic() + timeout,
                                                      extra={"sender": None, "stopped": False,
                                                             "gone": False})
        return handle

    def abort(self, request_id: str) -> None:
        """Abort: status ABORTED now, the sender is told to stop; blocks stay held until releasable()."""
        with self._lock:
            st = self._get(request_id)
            if st.status.is_terminal:
                return
            self._set(st, S.ABORTED, "aborted by receiver")
            sender = st.extra["sender"]
        if sender is not None:
            self._call(lambda: self._send(sender, m.Abort(request_id)))

    def releasable(self, request_id: str) -> bool:
        """True when no write can still land in the request's blocks (see module docstring)."""
        with self._lock:
            return self._releasable(self._get(request_id))

    def release(self, request_id: str) -> None:
        """Forget a finished request so its blocks can be freed; raises RuntimeError if not releasable()."""
        with self._lock:
            st = self._get(request_id)
            if not self._releasable(st):
                raise RuntimeError(f"request {request_id!r} ({st.status.name}) may still be written")
            del self._requests[request_id]

    def snapshot(self, request_id: str) -> RecvSnapshot:
        """A copy of the request's state (see RecvSnapshot); raises KeyError if unknown."""
        with self._lock:
            st = self._get(request_id)
            x = st.extra
            return RecvSnapshot(status=st.status, reason=st.reason, layers=frozenset(st.layers),
                                claimed=x["sender"] is not None, stopped=x["stopped"], sender_gone=x["gone"])

    def stats(self) -> ReceiverStats:
        """The receiver now (see ReceiverStats)."""
        return ReceiverStats(loop=self._loop_stats(self._waker),
                             senders=tuple(s.sender_id for s in list(self._senders.values())),
                             receives_posted=len(self._posted))

    def drop_sender(self, sender_id: str, reason: str) -> None:
        """Drop every known sender called `sender_id` as if it were lost (on the loop thread, soon): its
        requests FAILED with `reason`, their blocks held until their deadline; its next message is
        answered with Rehandshake. For operators and tests. Raises TransferError if not running."""
        def run() -> None:
            for s in [s for s in self._senders.values() if s.sender_id == sender_id]:
                self._drop_sender(s, reason)
        self._call(run)

    def _releasable(self, st: RequestState) -> bool:
        if not st.status.is_terminal or any(p[0] == st.handle.request_id for p in self._posted.values()):
            return False
        x = st.extra
        return bool(x["sender"] is None or x["stopped"] or (x["gone"] and time.monotonic() > st.deadline))

    # ---- loop ---------------------------------------------------------------------------------
    def _step(self) -> None:
        self._wait()
        while int(self._sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:  # every message queued now
            frames = self._sock.recv_multipart(zmq.NOBLOCK)  # [identity, message] from a DEALER
            msg = m.decode_from(frames[-1], frames[0].hex()) if len(frames) == 2 else None
            if msg is not None:  # garbage (logged) or a malformed multipart: skipped, the loop lives on
                self._on_message(frames[0], msg)
        # liveness right after reading every pending message: a stall of this loop (a starved thread,
        # a slow transport call) must not count as the senders' silence (their heartbeats wait unread)
        self._housekeeping()
        self._poll_transport()

    def _wait(self) -> None:
        """Wait before a step unless a command is queued. Idle: the zmq poller, up to IDLE_POLL_MS. Due (a
        request TRANSFERRING, i.e. the sender's whole prefill; issue #3/#8): wakeup.nap_until, naps of
        busy_wait_s with the GIL released and `transport.poll()` (no fd signals it) between two, up to
        IDLE_POLL_MS: a landing is seen <= busy_wait_s (+ timer slack) late, a message, command or
        close() ends a nap at once. A two-sided transport with receives posted (ucx: rendezvous
        completes only inside progress calls) steps back to back, as before, while its data moves."""
        if not self._commands.empty() or (self._posted and not self.transport.one_sided):
            return
        with self._lock:
            due = bool(self._posted) or any(st.status is S.TRANSFERRING for st in self._requests.values())
        self._waker.sleeping = True  # then look again: a command queued before this sent no byte
        if self._commands.empty():
            if due:
                woke = nap_until(self._waker, [self._sock], self.config.busy_wait_s, IDLE_POLL_MS / 1e3,
                                 self._poll_transport)
            else:
                woke = bool(self._poller.poll(IDLE_POLL_MS))
            if woke:
                self._waker.drain()
        self._waker.sleeping = False

    def _poll_transport(self) -> bool:
        """Handle what the transport reports landed (one-sided notices, two-sided keys), all of them
        under one lock acquisition (a request's 32 notices arrive as one LayerNotices batch); True if
        any. A notice that does not decode, names a layer out of range or a request its peer did not
        claim is logged and ignored (recv_notices.py)."""
        notices, keys = self.transport.poll()
        got = [(peer, n) for peer, raw in notices for n in decode_from(peer, raw)]  # garbage: skipped
        if got and self._trace is not None:
            now = time.perf_counter()
            self._trace.extend((now, "notice", n.request_id, n.layer) for _, n in got)
        landed = [self._posted.pop(key)[:3] for key in keys]
        if got or landed:
            with self._lock:  # a notice from a peer that did not claim its request, or a bad layer: ignored
                num_layers = self.layout.num_layers
                landed += [(n.request_id, n.layer, n.checksum) for peer, n in got
                           if accepted(peer, n, self._requests.get(n.request_id), num_layers)]
                for request_id, layer, checksum in landed:
                    self._landed(request_id, layer, checksum)
        return bool(got or landed)

    def _wake(self) -> None:
        self._waker.wake()

    def _send(self, identity: bytes, msg: m.Message) -> None:
        self._sock.send_multipart([identity, m.encode(msg)], zmq.NOBLOCK)

    def _on_message(self, identity: bytes, msg: m.Message) -> None:
        sender = self._senders.get(identity)
        if sender is not None:
            sender.last_seen = time.monotonic()
        if isinstance(msg, m.Hello):
            self._on_hello(identity, msg)
        elif sender is None:  # we dropped it (or restarted) while it lives on: tell it to Hello again
            why = self._forgotten.get(identity, "no handshake with this sender (receiver restarted?)")
            self._send(identity, m.Rehandshake(self.config.worker_id, self.epoch, why))
        elif isinstance(msg, m.Begin):
            self._send(identity, self._on_begin(identity, msg))
        elif isinstance(msg, m.LayerNotice):
            self._on_notice(identity, msg)
        elif isinstance(msg, m.Withdraw):
            self._on_withdraw(msg)
        elif isinstance(msg, m.Stopped):
            with self._lock:
                st = self._requests.get(msg.request_id)
                if st is not None and st.extra["sender"] == identity and not st.extra["gone"]:
                    st.extra["stopped"] = True
                    self._set(st, S.ABORTED if msg.aborted else S.FAILED,
                              "aborted by sender" if msg.aborted else f"sender stopped: {msg.reason}")
                    self._lock.notify_all()

    def _on_hello(self, identity: bytes, hello: m.Hello) -> None:
        bad = mismatches(self.info, hello.info)
        if not bad:
            for old in [s for s in self._senders.values() if s.sender_id == hello.sender_id
                        and s.epoch != hello.epoch]:
                self._drop_sender(old, f"sender {hello.sender_id} restarted (new epoch)")
            self._forgotten.pop(identity, None)
            if identity not in self._senders:
                self.transport.add_peer(identity.hex(), hello.transport)
                self._senders[identity] = _Sender(identity, hello.sender_id, hello.epoch, time.monotonic())
        self._send(identity, m.HelloReply(self.config.worker_id, self.epoch, bad,
                                          b"" if bad else self.transport.metadata()))

    def _on_begin(self, identity: bytes, msg: m.Begin) -> m.BeginReply:
        if msg.receiver_epoch != self.epoch:
            return m.BeginReply(msg.request_id, False, f"stale epoch {msg.receiver_epoch} != {self.epoch}")
        with self._lock:
            st = self._requests.get(msg.request_id)
            if st is not None and st.extra["sender"] == identity and st.status is S.TRANSFERRING:
                return m.BeginReply(msg.request_id, True)  # duplicate Begin
            if st is None or st.status is not S.PENDING:
                why = "unknown request" if st is None else f"request is {st.status.name}"
                return m.BeginReply(msg.request_id, False, why)
            st.extra["sender"] = identity
            self._set(st, S.TRANSFERRING)
        return m.BeginReply(msg.request_id, True)

    def _on_notice(self, identity: bytes, n: m.LayerNotice) -> None:
        if self.transport.one_sided:  # its notices travel with the data: never one on the control plane
            m.log.warning("ignored a notice for %r from %s: the transport is one-sided", n.request_id,
                          identity.hex())
            return
        with self._lock:
            st = self._requests.get(n.request_id)
            if st is None or st.extra["sender"] != identity or st.extra["gone"]:
                return
            try:
                pieces = layer_pieces(self.layout, st.handle.block_ids, n.layer, n.cuts)
            except (ValueError, IndexError) as exc:  # a bad layer or cuts: never posted nor landed
                m.log.warning("ignored a notice for %r from %s: %s", n.request_id, identity.hex(), exc)
                return
        key = next(self._keys)
        self._posted[key] = (n.request_id, n.layer, n.checksum, identity)
        self.transport.post(identity.hex(), key, [(dst, size) for _, dst, size in pieces], n.tag)

    def _landed(self, request_id: str, layer: int, checksum: int | None) -> None:
        """One request-layer landed (caller holds the lock): DONE and Done sent at its last layer."""
        st = self._requests.get(request_id)
        if st is None or st.status.is_terminal:
            self._lock.notify_all()
            return
        sender = st.extra["sender"]
        if self.config.checksum and checksum is not None:
            got = layer_checksum(self.kv_buffer, layer, st.handle.block_ids)
            if got != checksum:
                self._set(st, S.FAILED, f"checksum mismatch in layer {layer}: {got:#x} != {checksum:#x}")
                self._send(sender, m.Fail(request_id, st.reason))
                return
        st.layers.add(layer)
        if len(st.layers) == self.layout.num_layers:
            st.extra["stopped"] = True
            self._set(st, S.DONE)
            if self._trace is not None:
                self._trace.append((time.perf_counter(), "done_sent", request_id, -1))
            self._send(sender, m.Done(request_id))

    def _teardown(self) -> None:
        self.transport.close()
        self._sock.close(0)
        self._ctx.term()
        self._waker.close()
