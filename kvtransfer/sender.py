"""KVSender: the prefill worker's side; writes a request's KV, layer by layer, into a receiver's blocks.

This file holds the public API and the control plane (messages, fences, the loop); the handshake and
Begin are handshake.py, heartbeats and deadlines liveness.py, the hand-off of layers by send_layer(s)
handoff.py (a whole request's complete KV is posted by the caller itself: post_now.py), the data path
(staging ring, several request-layers in flight, batched writes) send_path.py + pipeline.py, the loop's
waits send_wait.py.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import time
import zlib
from collections import deque
from collections.abc import Sequence

import torch
import zmq

from kvtransfer import wire as m
from kvtransfer.api import KVHandle, SenderStats, SendSnapshot, TransferConfig, TransferError, TransferStatus
from kvtransfer.compat import peer_info
from kvtransfer.endpoint import Endpoint, RequestState
from kvtransfer.events import EventPool
from kvtransfer.handoff import LayerHandoff, QueuedLayer
from kvtransfer.handshake import Handshake
from kvtransfer.liveness import PeerLiveness, Receiver
from kvtransfer.lookahead import MIN_SAMPLE_NAPS, WriteRate
from kvtransfer.pipeline import LayerPipeline
from kvtransfer.runs import direct_layers, joint_runs, layer_pieces, merge_runs, source_cuts
from kvtransfer.send_path import SendPath
from kvtransfer.staging import layout_of
from kvtransfer.transports.base import SendTransport
from kvtransfer.wakeup import Waker

S = TransferStatus


class KVSender(LayerHandoff, Handshake, PeerLiveness, SendPath, Endpoint):
    """Sends KV from `kv_buffer [num_layers, 2, num_blocks, block_size, H, D]` (any dtype/device)."""

    def __init__(self, config: TransferConfig, kv_buffer: torch.Tensor, transport: SendTransport,
                 events: EventPool | None = None, rate: WriteRate | None = None) -> None:
        super().__init__(config)
        self.kv_buffer = kv_buffer
        self.layout = layout_of(kv_buffer)
        self.info = peer_info(config, self.layout)
        self.transport = transport
        self._ctx = zmq.Context()
        self._peers: dict[str, Receiver] = {}
        self._queue: deque[QueuedLayer] = deque()
        # the direct path needs kv_buffer registered (once) and addressable as one flat byte range
        self._direct = config.direct_max_pieces > 0 and kv_buffer.is_contiguous()
        if events is None and kv_buffer.is_cuda:
            events = EventPool(kv_buffer.device.index or 0)
        self._events = events
        self._pipe = LayerPipeline(kv_buffer, transport, config.max_inflight_layers, self._direct,
                                   self._events.give_back if self._events else None,
                                   rate or WriteRate(MIN_SAMPLE_NAPS * config.busy_wait_s))
        self._preps: dict[str, list[object]] = {}  # request → transport.prepare_layers parts (loop)
        self._next_beat = 0.0
        self._poller: zmq.Poller | None = None
        self._waker = Waker()  # send_layer and commands cut the loop's idle poll (or nap) short
        self._take_layers = True  # a send_layer may wake the loop (false: the pipeline is full)

    def start(self) -> KVSender:
        """Start the loop thread. Does nothing on a running sender; raises TransferError after close()
        (endpoint.py: one loop thread per endpoint)."""
        self._start_thread(f"kv-sender-{self.config.worker_id}")
        return self

    # ---- public API -----------------------------------------------------------------------------
    def connect(self, address: str, timeout: float = 5.0) -> None:
        """Handshake with the receiver at `address` (done implicitly by add_request too). Raises
        IncompatiblePeerError naming each mismatch, or TransferError if no answer in `timeout` s."""
        fut: cf.Future[None] = cf.Future()
        self._call(lambda: self._hello(address, fut))
        try:
            fut.result(timeout)
        except cf.TimeoutError:
            raise TransferError(f"no handshake answer from {address} within {timeout}s") from None

    def add_request(self, handle: KVHandle, block_ids: list[int]) -> None:
        """Start a transfer of this worker's `block_ids` (token order) into `handle`'s blocks.

        Raises ValueError on a duplicate request id, a block count different from the handle's or a
        block id out of range; TransferError if the sender is not running (nothing is kept then).
        """
        if len(block_ids) != len(handle.block_ids):
            raise ValueError(f"{len(block_ids)} source blocks for {len(handle.block_ids)} destination blocks")
        layer_pieces(self.layout, tuple(block_ids), 0)  # range check
        runs = joint_runs(block_ids, handle.block_ids)
        direct = self._direct and 2 * len(runs) <= self.config.direct_max_pieces  # else gather
        # direct: every layer's pieces now (block sizes must agree), so a post only concatenates lists
        pieces = direct_layers(self.layout, handle.layout, runs) if direct else []
        # the receiver owns the deadline; ours is a backstop a heartbeat-timeout later
        st = RequestState(handle, time.monotonic() + handle.timeout_s + self.config.peer_timeout_s)
        key = zlib.crc32(f"{self.config.worker_id}:{self.epoch}:{handle.request_id}".encode())
        st.extra.update(src=torch.tensor(block_ids, dtype=torch.int64, device=self.kv_buffer.device),
                        src_ids=list(block_ids), runs=runs if direct else None, pieces=pieces, prep=None,
                        cuts=source_cuts(block_ids) if direct else (),
                        dst_runs=merge_runs(handle.block_ids), begun=False, answered=False, key=key,
                        inflight=0, stop=None)
        with self._lock:
            if handle.request_id in self._requests:
                raise ValueError(f"request_id {handle.request_id!r} already added")
            self._requests[handle.request_id] = st
        try:
            self._call(lambda: self._begin(st))
        except TransferError:
            with self._lock:  # not running: forget the request again
                del self._requests[handle.request_id]
            raise

    def send_layer(self, request_id: str, layer: int) -> None:
        """Queue `layer` of the request: its KV must already be in kv_buffer (call after the layer's
        attention stored it). Runs on the caller's (forward pass) thread: a lock, one CUDA event (from a
        pool of reused ones, events.py) recorded on a GPU, one deque append, and a wake-up byte only
        if the loop sleeps or naps with room in its pipeline (_poll_peers). Raises KeyError for an
        unknown request, ValueError for a bad layer, TransferError if the sender is not running."""
        self._hand_off(request_id, (layer,))

    def send_layers(self, request_id: str, layers: Sequence[int] | None = None) -> None:
        """Queue several layers of the request at once (None: every layer, in order), e.g. a whole
        prompt's KV already in kv_buffer: the contract of send_layer for each, but ONE lock, ONE CUDA
        event on a GPU (recorded on the caller's current stream, shared by all of them), one wake-up of
        the loop, which then takes them up in one step and posts them as one write per receiver
        (handoff.py). Everything is checked before anything is queued or marked: raises KeyError for an
        unknown request, ValueError for a layer out of range, given twice or already sent, TypeError for
        a non-integer layer, TransferError if the sender is not running."""
        self._hand_off(request_id, layers)

    def abort(self, request_id: str) -> None:
        """Stop sending the request: ABORTED here, the receiver is told (Stopped) once its in-flight
        writes, if any, have completed, or (Withdraw) once it answered our Hello if the request's Begin
        never went out. Raises KeyError for an unknown request."""
        self.status(request_id)

        def run() -> None:
            with self._lock:
                st = self._requests.get(request_id)
                if st is None or st.status.is_terminal:
                    return
                self._set(st, S.ABORTED, "aborted by sender")
                self._stop_later(st, aborted=True)
        self._call(run)

    def release(self, request_id: str) -> None:
        """Forget a terminal request (its source blocks may be freed). Raises RuntimeError while it is
        active, has request-layers in flight, a Stopped fence or Withdraw still to send or a Begin
        unanswered (the receiver would otherwise never learn that nothing more comes); KeyError if
        unknown."""
        with self._lock:
            st = self._get(request_id)
            x = st.extra
            busy = ("still " + st.status.name if not st.status.is_terminal else
                    f"{x['inflight']} layers in flight" if x["inflight"] else
                    "Stopped fence or Withdraw not sent yet" if x["stop"] is not None else
                    "Begin not answered yet" if x.get("begin_sent") and not x["answered"] else "")
            if busy:
                raise RuntimeError(f"request {request_id!r} cannot be released: {busy}")
            del self._requests[request_id]

    def check_no_leaks(self, timeout: float = 2.0) -> None:
        """Raise AssertionError if a request is still tracked, a staging slot is still in use, or, once
        the loop had `timeout` s to drop the queued layers and free the prepared lists of released
        requests, a layer is still queued, a send_layer(s) event not given back to the pool or the
        transport still holds prepared descriptor lists."""
        super().check_no_leaks()
        assert self._pipe.ring.in_use == 0, f"{self._pipe.ring.in_use} staging slots still in use"
        end = time.monotonic() + timeout
        while (self._preps or self._queue) and self._thread is not None and time.monotonic() < end:
            time.sleep(0.005)
        assert not self._preps, f"prepared descriptor lists still held for {sorted(self._preps)}"
        assert not self._queue, f"{len(self._queue)} layers still queued"
        held = self._events.held if self._events is not None else 0
        assert held == 0, f"{held} send_layer events not given back to the pool"

    def snapshot(self, request_id: str) -> SendSnapshot:
        """A copy of the request's state (see SendSnapshot); raises KeyError if unknown."""
        with self._lock:
            st = self._get(request_id)
            x = st.extra
            return SendSnapshot(status=st.status, reason=st.reason, layers=frozenset(st.layers),
                                direct=x["runs"] is not None, key=x["key"], cuts=x["cuts"],
                                begin_sent=bool(x.get("begin_sent")), answered=x["answered"],
                                begun=x["begun"], inflight=x["inflight"], fence_pending=x["stop"] is not None,
                                prepared=x["prep"] is not None)

    def stats(self) -> SenderStats:
        """The data path and peers now (see SenderStats)."""
        ops = list(self._pipe.ops)
        return SenderStats(loop=self._loop_stats(self._waker), queued=len(self._queue), in_pipeline=len(ops),
                           writing=sum(op.posted for op in ops), writes=len(self._pipe._writes),
                           lone_write=self._pipe.lone_write(), staging_slots_in_use=self._pipe.ring.in_use,
                           posted=dict(self._pipe.posted), prepared=len(self._preps),
                           events_held=self._events.held if self._events is not None else 0,
                           receivers={a: p.epoch for a, p in list(self._peers.items())})

    def set_trace(self, trace: list[tuple[float, str, str, int]] | None) -> None:
        """Append (time.perf_counter() s, what, request_id, layer or count) events of the data path and
        of the DONE round trip to `trace` (None: off). Cheap (one append per event) but for benchmarks:
        the list grows without bound. Events: gather/post/done per request-layer (pipeline.py),
        post:build/descs/init/transfer per write (transport), done_msg/DONE per request (here)."""
        self._pipe.trace = trace
        self.transport.trace = trace

    # ---- control plane --------------------------------------------------------------------------
    def _peer(self, address: str) -> Receiver:
        peer = self._peers.get(address)
        if peer is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.IDENTITY, f"{self.config.worker_id}:{self.epoch}".encode())
            sock.connect(address)
            peer = self._peers[address] = Receiver(address, sock, last_seen=time.monotonic())
            self._poller = None
        return peer

    def _send(self, peer: Receiver, msg: m.Message) -> None:
        with contextlib.suppress(zmq.Again):  # peer unreachable: heartbeats/deadlines report it
            peer.sock.send(m.encode(msg), zmq.NOBLOCK)

    def _on_message(self, peer: Receiver, msg: m.Message) -> None:
        peer.last_seen = time.monotonic()
        if isinstance(msg, m.HelloReply):
            self._on_hello_reply(peer, msg)
            return
        if isinstance(msg, m.Rehandshake):
            self._on_rehandshake(peer, msg)
            return
        rid = getattr(msg, "request_id", None)
        with self._lock:
            st = self._requests.get(rid) if rid is not None else None
            if st is None or st.handle.address != peer.address:  # not a request of this receiver
                return
            if isinstance(msg, m.BeginReply):
                st.extra["begun"], st.extra["answered"] = msg.ok, True
                self._set(st, S.TRANSFERRING if msg.ok else S.FAILED, msg.reason)
                if msg.ok and st.extra["pieces"] and st.extra["prep"] is None and not st.status.is_terminal:
                    with contextlib.suppress(TransferError):  # else _post prepares it, and fails it
                        self._prepare(st)
            elif isinstance(msg, m.Done):
                self._mark("done_msg", st.handle.request_id)
                self._set(st, S.DONE)
                self._mark("DONE", st.handle.request_id)
            elif isinstance(msg, m.Abort):
                self._set(st, S.ABORTED, "aborted by receiver")
            elif isinstance(msg, m.Fail):
                self._set(st, S.FAILED, f"receiver failed it: {msg.reason}")
            late_begin = isinstance(msg, m.BeginReply) and msg.ok and st.status in (S.ABORTED, S.FAILED)
            if isinstance(msg, m.Fail | m.Abort) or late_begin:
                # a request aborted while its Begin was in flight still needs its Stopped fence
                self._stop_later(st, aborted=st.status is S.ABORTED)

    # ---- loop ---------------------------------------------------------------------------------
    def _step(self) -> None:
        self._mark("step", "")
        self._poll_peers()
        self._mark("step:polled", "")
        # liveness right after reading every pending message: a stall of this loop (a long write, a
        # starved thread) must not count as the peers' silence (their heartbeats wait unread)
        self._housekeeping()
        self._start_gathers()
        self._mark("step:taken", "")
        self._post_ready()
        self._complete()
        self._flush_stops()
        self._release_preps()

    def _wake(self) -> None:
        self._waker.wake()

    def _teardown(self) -> None:
        self.transport.close()
        for p in self._peers.values():
            p.sock.close(0)
        self._ctx.term()
        self._waker.close()
