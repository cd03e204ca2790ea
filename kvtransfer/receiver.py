"""ReceiverEndpoint: the decode worker's side; owns the destination blocks and decides when they are free.

The public surface and its contract are `api.KVReceiver`. The receiver binds one zmq ROUTER socket
(its control address, in every KVHandle it makes; a CURVE server with `config.curve`, curve.py: a
sender's Hello, and with it the transport metadata the receiver connects to, arrives only from a holder
of the fleet's key pair) and runs one loop thread (loop.py); the exchange of
each request with its sender is recv_control.py, the senders themselves (handshakes, liveness, which
notices to trust) senders.py.

Block lifetime: a request's blocks are releasable only when no write can still land in them: after
DONE, after the claiming sender said Stopped, when no sender claimed the request (Begin; a sender that
gives it up first says Withdraw), or when its deadline passed and its sender is gone (lost, or back
with a new epoch). A request's deadline is first its claim deadline (no Begin yet: the sender may still
be computing earlier prompts), then `handle.timeout_s` from its Begin or its last landed layer. A
sender dropped while alive (e.g. its loop stalled past peer_timeout_s) is told so: any message but
Hello from a sender we do not know is answered with Rehandshake. Its dropped requests stay FAILED and
held until their deadline, whatever it says later: no Stopped of it is trusted for them (its writes
were cancelled, not completed). Withdraw ends only a request no sender claimed: no write ever landed in
its blocks, so they are releasable at once.

One loop step: wait (an idle poll; naps with `transport.poll()` between them while a request is
TRANSFERRING, i.e. during its sender's prefill; nothing while a command waits or a two-sided transport
has receives posted), read every control message, liveness and deadlines right after, then what the
transport reports landed.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import zmq
from zmq.utils.monitor import parse_monitor_message

from kvtransfer import wire
from kvtransfer.compat import KVCompat, kv_compat
from kvtransfer.curve import MONITOR_EVENTS, FleetAuthenticator, Refusals, secure_server
from kvtransfer.loop import LoopThread
from kvtransfer.recv_control import RecvControl
from kvtransfer.requests import RecvState, RequestTable
from kvtransfer.runs import layer_pieces
from kvtransfer.senders import SenderPeers
from kvtransfer.staging import layout_of
from kvtransfer.stats import ReceiverStats, RecvSnapshot
from kvtransfer.transports.base import RecvTransport
from kvtransfer.types import KVHandle, TransferConfig, TransferStatus
from kvtransfer.wakeup import Waker, nap_until

S = TransferStatus
IDLE_POLL_MS = 10  # longest sleep of an idle loop, and the longest run of naps while due


class ReceiverEndpoint:
    """Receives requests' KV into `kv_buffer [num_layers, 2, num_blocks, block_size, H, D]` over
    `transport` (api.KVReceiver). Raises ValueError if kv_buffer is not a paged KV tensor with
    contiguous blocks."""

    def __init__(self, config: TransferConfig, kv_buffer: torch.Tensor, transport: RecvTransport) -> None:
        self.config = config
        self.kv_buffer = kv_buffer
        self.layout = layout_of(kv_buffer)
        self.compat: KVCompat = kv_compat(config.model_id, config.backend, self.layout, config.tp_size,
                                          config.tp_rank, total_kv_heads=config.total_kv_heads)
        self.epoch = wire.new_epoch()
        self.transport = transport
        self.address = ""
        label = f"KVReceiver {config.worker_id}"
        self._requests: RequestTable[RecvState] = RequestTable(label)
        self._loop = LoopThread(f"kv-receiver-{config.worker_id}", label, self._step, self._teardown,
                                self._crashed, Waker())
        self._senders = SenderPeers(config)
        self._admitted: dict[str, int] = {}  # sender id → the epoch admit_sender let in (fence_senders)
        self._control = RecvControl(config, self.epoch, self.compat, kv_buffer, self.layout, transport,
                                    self._requests, self._senders, self._send)
        self.refusals = Refusals(f"KV control socket of {config.worker_id}")
        self._control.fence = (self._admitted, self.refusals) if config.fence_senders else None

    def start(self) -> ReceiverEndpoint:
        """Bind the control socket and start the loop (api.KVReceiver.start)."""
        self._loop.start(self._bind)
        return self

    def _bind(self) -> None:
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._auth: FleetAuthenticator | None = None
        if self.config.curve is not None:  # only holders of the fleet's key pair complete a handshake
            self._auth = FleetAuthenticator(self._ctx, self.config.curve, self.refusals)
            secure_server(self._sock, self.config.curve)
        self._monitor = self._sock.get_monitor_socket(MONITOR_EVENTS)
        if self.config.port:
            self._sock.bind(f"tcp://{self.config.host}:{self.config.port}")
        else:
            self._sock.bind_to_random_port(f"tcp://{self.config.host}")
        self.address = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._poller = zmq.Poller()  # idle sleep: a message or a command (the waker) ends it
        self._poller.register(self._sock, zmq.POLLIN)
        self._poller.register(self._loop.waker.fd, zmq.POLLIN)

    # ---- the worker's surface (api.KVReceiver) -----------------------------------------------------
    def expect(self, request_id: str, block_ids: list[int], timeout_s: float | None = None,
               claim_timeout_s: float | None = None, *, num_cached_blocks: int = 0) -> KVHandle:
        """Register a request whose KV will land in `block_ids` (api.KVReceiver.expect)."""
        if not block_ids or len(set(block_ids)) != len(block_ids):
            raise ValueError(f"block_ids must be non-empty and distinct, got {block_ids[:8]}...")
        if num_cached_blocks < 0:
            raise ValueError(f"num_cached_blocks must be >= 0, got {num_cached_blocks}")
        layer_pieces(self.layout, tuple(block_ids), 0)  # range check
        timeout = timeout_s or self.config.timeout_s
        claim = timeout if claim_timeout_s is None else claim_timeout_s
        if timeout <= 0 or claim <= 0:
            raise ValueError(f"timeouts must be > 0 s, got timeout_s={timeout}, claim_timeout_s={claim}")
        handle = KVHandle(worker_id=self.config.worker_id, epoch=self.epoch, request_id=request_id,
                          block_ids=tuple(block_ids), layout=self.layout, address=self.address,
                          backend=self.config.backend, timeout_s=timeout, num_cached_blocks=num_cached_blocks)
        with self._requests.lock:
            self._requests.add(RecvState(handle, time.monotonic() + claim),
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
            return self._control.releasable(self._requests.get(request_id))

    def release(self, request_id: str) -> None:
        """Forget a releasable request (api.KVReceiver.release)."""
        with self._requests.lock:
            st = self._requests.get(request_id)
            if not self._control.releasable(st):
                raise RuntimeError(f"request {request_id!r} ({st.status.name}) may still be written")
            self._requests.remove(request_id)

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
                             receives_posted=len(self._control.posted))

    def drop_sender(self, sender_id: str, reason: str) -> None:
        """Drop every known sender called `sender_id` as if lost (api.KVReceiver.drop_sender)."""
        def run() -> None:
            for s in self._senders.named(sender_id):
                self._control.drop_sender(s, reason)
        self._loop.call(run)

    def set_trace(self, trace: list[tuple[float, str, str, int]] | None) -> None:
        """Record "notice" and "done_sent" events into `trace` (api.KVReceiver.set_trace)."""
        self._control.trace = trace

    def run_in_loop(self, fn: Callable[[], None]) -> None:
        """Run `fn` on the loop thread before its next step (api.KVReceiver.run_in_loop)."""
        self._loop.call(fn)

    def refused_handshakes(self) -> int:
        """Peers refused so far (api.KVReceiver.refused_handshakes)."""
        return self.refusals.total()

    def admit_sender(self, sender_id: str, epoch: int) -> None:
        """Let `sender_id` of `epoch` handshake (api.KVReceiver.admit_sender); one dict store, atomic under
        the GIL (the loop thread reads it)."""
        self._admitted[sender_id] = epoch

    # ---- the loop thread ----------------------------------------------------------------------------
    def _step(self) -> None:
        self._wait()
        # failed handshakes: counted (the ZAP thread counts unknown keys); EVENTS is cheaper than a poll
        while int(self._monitor.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
            event = parse_monitor_message(self._monitor.recv_multipart())
            self.refusals.on_monitor(event["event"], event["value"])
        while int(self._sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:  # every message queued now
            frames = self._sock.recv_multipart(zmq.NOBLOCK)  # [identity, message] from a DEALER
            msg = wire.decode_from(frames[-1], frames[0].hex()) if len(frames) == 2 else None
            if msg is not None:  # garbage (logged) or a malformed multipart: skipped, the loop lives on
                self._control.on_message(frames[0], msg)
        # liveness right after reading every pending message: a stall of this loop (a starved thread,
        # a slow transport call) must not count as the senders' silence (their heartbeats wait unread)
        self._control.housekeeping()
        self._control.poll_transport()

    def _wait(self) -> None:
        """Wait before a step unless a command is queued. Idle: the zmq poller, up to IDLE_POLL_MS. Due (a
        request TRANSFERRING, i.e. the sender's whole prefill): wakeup.nap_until, naps of busy_wait_s
        with the GIL released and `transport.poll()` (no fd signals it) between two, up to IDLE_POLL_MS:
        a landing is seen <= busy_wait_s (+ timer slack) late, a message, command or close() ends a nap
        at once. A two-sided transport with receives posted (ucx: rendezvous completes only inside
        progress calls) steps back to back while its data moves."""
        loop, waker = self._loop, self._loop.waker
        posted = self._control.posted
        if loop.has_commands() or (posted and not self.transport.one_sided):
            return
        with self._requests.lock:
            due = bool(posted) or any(st.status is S.TRANSFERRING for st in self._requests)
        waker.sleeping = True  # then look again: a command queued before this sent no byte
        if not loop.has_commands():
            if due:
                woke = nap_until(waker, [self._sock], self.config.busy_wait_s, IDLE_POLL_MS / 1e3,
                                 self._control.poll_transport)
            else:
                woke = bool(self._poller.poll(IDLE_POLL_MS))
            if woke:
                waker.drain()
        waker.sleeping = False

    def _send(self, identity: bytes, msg: wire.Message) -> None:
        self._sock.send_multipart([identity, wire.encode(msg)], zmq.NOBLOCK)

    def _crashed(self, exc: BaseException) -> None:
        with self._requests.lock:
            for st in self._requests:
                if not st.status.is_terminal:
                    self._requests.set_status(st, S.FAILED, f"endpoint loop crashed: {exc!r}")

    def _teardown(self) -> None:
        self.transport.close()
        self._sock.disable_monitor()
        self._monitor.close(0)
        self._sock.close(0)  # bound by start() before the loop thread ran
        if self._auth is not None:
            self._auth.stop()
        self._ctx.term()
        self._loop.waker.close()
