"""SenderEndpoint: the prefill worker's side; writes a request's KV, layer by layer, into a receiver's blocks.

The public surface and its contract are `api.KVSender`. This class wires the sender's objects
together and runs its loop thread (loop.py):

- `requests` (requests.py): the lock and each request's `SendState`;
- `peers` (peers.py): the receivers, their sockets, handshakes and liveness;
- `path` (send_path.py): hand-off queue → pipeline (pipeline.py: staging ring, writes in flight) →
  transport (transports/) → completions;
- `control` (send_control.py): Begin, replies, fences, deadlines, what a lost peer does to requests;
- `waits` (send_wait.py): when the loop sleeps, and how long.

One loop step: wait for work (an idle poll, busy naps, or nothing when work is ready) and read every
control message, liveness and deadlines right after (a stall of this loop never counts as a peer's
silence), take queued layers up, post the ready ones, handle completions, send fences, free prepared
lists.
"""

from __future__ import annotations

import concurrent.futures as cf
import time
import zlib
from collections.abc import Callable, Sequence

import torch

from kvtransfer.compat import KVCompat, kv_compat
from kvtransfer.events import EventPool
from kvtransfer.head_map import HeadSlice, slice_pieces
from kvtransfer.lookahead import MIN_SAMPLE_NAPS, WriteRate
from kvtransfer.loop import LoopThread
from kvtransfer.peers import ReceiverPeers
from kvtransfer.pipeline import LayerPipeline
from kvtransfer.requests import RequestTable, SendPlan, SendState
from kvtransfer.runs import (
    JointRun,
    Piece,
    direct_layers,
    joint_runs,
    layer_pieces,
    merge_runs,
    shift_layers,
    source_cuts,
)
from kvtransfer.send_control import SendControl
from kvtransfer.send_path import SendPath
from kvtransfer.send_wait import SenderWait
from kvtransfer.staging import layout_of
from kvtransfer.stats import SenderStats, SendSnapshot
from kvtransfer.transports.base import SendTransport
from kvtransfer.types import KVHandle, TransferConfig, TransferError, TransferStatus
from kvtransfer.wakeup import Waker
from kvtransfer.wire import new_epoch

S = TransferStatus


class SenderEndpoint:
    """Sends KV from `kv_buffer [num_layers, 2, num_blocks, block_size, H, D]` (any dtype/device) over
    `transport` (api.KVSender). Seams: `events` (send_layer's CUDA event pool; default: a pool on a
    CUDA kv_buffer, none on CPU) and `rate` (the write-rate estimate of the busy nap, lookahead.py).
    Raises ValueError if kv_buffer is not a paged KV tensor with contiguous blocks."""

    def __init__(self, config: TransferConfig, kv_buffer: torch.Tensor, transport: SendTransport,
                 events: EventPool | None = None, rate: WriteRate | None = None) -> None:
        self.config = config
        self.kv_buffer = kv_buffer
        self.layout = layout_of(kv_buffer)
        self.compat: KVCompat = kv_compat(config.model_id, config.backend, self.layout, config.tp_size,
                                          config.tp_rank, total_kv_heads=config.total_kv_heads)
        self.epoch = config.sender_epoch or new_epoch()
        self.transport = transport
        if events is None and kv_buffer.is_cuda:
            events = EventPool(kv_buffer.device.index or 0)
        self._events = events
        # the direct path needs kv_buffer registered (once) and addressable as one flat byte range
        self._direct = config.direct_max_pieces > 0 and kv_buffer.is_contiguous()
        label = f"KVSender {config.worker_id}"
        waker = Waker()  # send_layer and commands cut the loop's idle poll (or nap) short
        self._requests: RequestTable[SendState] = RequestTable(label)
        self._loop = LoopThread(f"kv-sender-{config.worker_id}", label, self._step, self._teardown,
                                self._crashed, waker)
        self._peers = ReceiverPeers(config, self.epoch, self.compat, transport, waker.fd)
        pipe = LayerPipeline(kv_buffer, transport, config.max_inflight_layers, self._direct,
                             events.give_back if events is not None else None,
                             rate or WriteRate(MIN_SAMPLE_NAPS * config.busy_wait_s))
        self._path = SendPath(config, kv_buffer, self.layout, transport, pipe, self._requests, self._loop,
                              lambda address, notice: self._peers.send(self._peers.get(address), notice),
                              events)
        self._control = SendControl(config, self._requests, self._peers, self._path)
        self._waits = SenderWait(config, self._path, self._loop, self._peers)

    def start(self) -> SenderEndpoint:
        """Start the loop thread (api.KVSender.start)."""
        self._loop.start()
        return self

    # ---- the worker's surface (api.KVSender) -------------------------------------------------------
    def connect(self, address: str, timeout: float = 5.0) -> None:
        """Handshake with the receiver at `address` (api.KVSender.connect)."""
        fut: cf.Future[None] = cf.Future()
        self._loop.call(lambda: self._control.connect(address, fut))
        try:
            fut.result(timeout)
        except cf.TimeoutError:
            raise TransferError(f"no handshake answer from {address} within {timeout}s") from None

    def add_request(self, handle: KVHandle, block_ids: list[int], heads: HeadSlice | None = None) -> None:
        """Start a transfer of `block_ids` into `handle`'s blocks (api.KVSender.add_request); with `heads`,
        only that head slice of this rank's blocks into the handle's rank (head_map.py)."""
        if len(block_ids) != len(handle.block_ids):
            raise ValueError(f"{len(block_ids)} source blocks for {len(handle.block_ids)} destination blocks")
        src, dst = self.layout, handle.layout
        # one KV head of one block must be the same bytes on both sides (with heads=, a rank's block
        # holds a share of the receiver's heads): e.g. an fp8 sender and a bf16 receiver never copy
        src_head, dst_head = src.block_bytes // src.num_kv_heads, dst.block_bytes // dst.num_kv_heads
        if src.dtype != dst.dtype or src_head != dst_head:
            raise ValueError(f"the receiver's KV blocks do not fit: dtype {src.dtype!r} != {dst.dtype!r}, "
                             f"bytes per KV head of a block {src_head} != {dst_head}")
        layer_pieces(self.layout, tuple(block_ids), 0)  # range check
        runs = joint_runs(block_ids, handle.block_ids)
        if heads is None and handle.layout.num_kv_heads != self.layout.num_kv_heads:
            raise ValueError(f"the destination holds {handle.layout.num_kv_heads} KV heads per block, this "
                             f"sender {self.layout.num_kv_heads}: pass heads= (head_map.head_slices)")
        direct = heads is not None or (self._direct and 2 * len(runs) <= self.config.direct_max_pieces)
        pieces: list[list[Piece]] = []  # direct: every layer's pieces now, so a post only concatenates
        if heads is not None:
            pieces = self._slice_layers(handle, heads, runs)
        elif direct:  # (block sizes must agree)
            pieces = direct_layers(self.layout, handle.layout, runs)
        plan = SendPlan(
            src=torch.tensor(block_ids, dtype=torch.int64, device=self.kv_buffer.device),
            src_ids=tuple(block_ids), runs=runs if direct else None, pieces=pieces,
            cuts=source_cuts(block_ids) if direct else (), dst_runs=merge_runs(handle.block_ids),
            key=zlib.crc32(f"{self.config.worker_id}:{self.epoch}:{handle.request_id}".encode()))
        # the receiver owns the deadline; ours is a backstop a heartbeat-timeout later
        st = SendState(handle, time.monotonic() + handle.timeout_s + self.config.peer_timeout_s, plan=plan)
        with self._requests.lock:
            self._requests.add(st, f"request_id {handle.request_id!r} already added")
        try:
            self._loop.call(lambda: self._control.begin(st))
        except TransferError:
            with self._requests.lock:  # not running: forget the request again
                self._requests.remove(handle.request_id)
            raise

    def _slice_layers(self, handle: KVHandle, heads: HeadSlice, runs: list[JointRun]) -> list[list[Piece]]:
        """Every layer's pieces of head slice `heads` (always the direct path: a slice is a byte range of
        each token, written straight from kv_buffer). Raises ValueError naming what cannot write it."""
        if heads.src_rank != self.config.tp_rank:
            raise ValueError(f"head slice of source rank {heads.src_rank} given to tensor parallel rank "
                             f"{self.config.tp_rank}'s sender")
        if not self._direct:
            raise ValueError("head slices are written straight from kv_buffer: it must be contiguous and "
                             "direct_max_pieces > 0")
        if not self.transport.one_sided:
            raise ValueError(f"transfer backend {self.config.backend!r} is two-sided: its receiver expects "
                             "whole blocks, not head slices")
        if self.config.checksum:
            raise ValueError("checksum covers whole blocks: it cannot check head slices (set checksum=False)")
        first = slice_pieces(self.layout, handle.layout, heads, runs, 0)
        return shift_layers(first, self.layout.num_layers, self.layout.layer_stride_bytes,
                            handle.layout.layer_stride_bytes)

    def send_layer(self, request_id: str, layer: int) -> None:
        """Queue `layer` of the request (api.KVSender.send_layer)."""
        self._path.hand_off(request_id, (layer,))

    def send_layers(self, request_id: str, layers: Sequence[int] | None = None) -> None:
        """Queue several layers of the request at once (api.KVSender.send_layers)."""
        self._path.hand_off(request_id, layers)

    def abort(self, request_id: str) -> None:
        """Stop sending the request (api.KVSender.abort)."""
        self._requests.status(request_id)  # KeyError if unknown
        self._loop.call(lambda: self._control.abort(request_id))

    def status(self, request_id: str) -> TransferStatus:
        """The request's status (api.KVSender.status)."""
        return self._requests.status(request_id)

    def reason(self, request_id: str) -> str:
        """Why the request FAILED or was ABORTED (api.KVSender.reason)."""
        return self._requests.reason(request_id)

    def wait(self, request_id: str, timeout: float) -> TransferStatus:
        """Block until the request is terminal or `timeout` s pass (api.KVSender.wait)."""
        return self._requests.wait(request_id, timeout)

    def release(self, request_id: str) -> None:
        """Forget a settled request (api.KVSender.release)."""
        with self._requests.lock:
            st = self._requests.get(request_id)
            busy = ("still " + st.status.name if not st.status.is_terminal else
                    f"{st.inflight} layers in flight" if st.inflight else
                    "Stopped fence or Withdraw not sent yet" if st.fence is not None else
                    "Begin not answered yet" if st.begin_sent and not st.answered else "")
            if busy:
                raise RuntimeError(f"request {request_id!r} cannot be released: {busy}")
            self._requests.remove(request_id)

    def pending(self) -> list[str]:
        """Request ids not yet released (api.KVSender.pending)."""
        return self._requests.pending()

    def close(self, timeout: float = 5.0) -> None:
        """Stop the loop and release sockets and transport (api.KVSender.close)."""
        self._loop.close(timeout)

    def check_no_leaks(self, timeout: float = 2.0) -> None:
        """Raise AssertionError if anything is still held (api.KVSender.check_no_leaks)."""
        self._requests.check_no_leaks()
        pipe = self._path.pipe
        assert pipe.ring.in_use == 0, f"{pipe.ring.in_use} staging slots still in use"
        end = time.monotonic() + timeout
        while (self._path.preps or self._path.queue) and self._loop.running and time.monotonic() < end:
            time.sleep(0.005)
        assert not self._path.preps, f"prepared descriptor lists still held for {sorted(self._path.preps)}"
        assert not self._path.queue, f"{len(self._path.queue)} layers still queued"
        held = self._events.held if self._events is not None else 0
        assert held == 0, f"{held} send_layer events not given back to the pool"

    # ---- observation (api.KVSender) -----------------------------------------------------------------
    def ended_at(self, request_id: str) -> float | None:
        """When the request became terminal (api.KVSender.ended_at)."""
        return self._requests.ended_at(request_id)

    def wire_seconds(self, request_id: str) -> float | None:
        """The request's writes' time on the transport (api.KVSender.wire_seconds)."""
        with self._requests.lock:
            st = self._requests.get(request_id)
            if st.first_posted_at is None or st.last_written_at is None:
                return None
            return max(st.last_written_at - st.first_posted_at, 0.0)

    def wait_until(self, pred: Callable[[], bool], timeout: float) -> bool:
        """Block until `pred()` holds under the sender's lock (api.KVSender.wait_until)."""
        return self._requests.wait_until(pred, timeout)

    def snapshot(self, request_id: str) -> SendSnapshot:
        """A copy of the request's state (api.KVSender.snapshot)."""
        with self._requests.lock:
            st = self._requests.get(request_id)
            return SendSnapshot(status=st.status, reason=st.reason, layers=frozenset(st.layers),
                                direct=st.plan.direct, key=st.plan.key, cuts=st.plan.cuts,
                                begin_sent=st.begin_sent, answered=st.answered, begun=st.begun,
                                inflight=st.inflight, fence_pending=st.fence is not None,
                                prepared=st.prep is not None)

    def stats(self) -> SenderStats:
        """The data path and peers now (api.KVSender.stats)."""
        pipe = self._path.pipe
        ops = list(pipe.ops)
        return SenderStats(loop=self._loop.stats(), queued=len(self._path.queue), in_pipeline=len(ops),
                           writing=sum(op.posted for op in ops), writes=pipe.writes_in_flight,
                           lone_write=pipe.lone_write(), staging_slots_in_use=pipe.ring.in_use,
                           posted=dict(pipe.posted), prepared=len(self._path.preps),
                           events_held=self._events.held if self._events is not None else 0,
                           receivers=self._peers.epochs())

    def set_trace(self, trace: list[tuple[float, str, str, int]] | None) -> None:
        """Record the data path's events into `trace` (api.KVSender.set_trace)."""
        self._path.pipe.trace = trace
        self.transport.trace = trace

    def run_in_loop(self, fn: Callable[[], None]) -> None:
        """Run `fn` on the loop thread before its next step (api.KVSender.run_in_loop)."""
        self._loop.call(fn)

    # ---- the loop thread ----------------------------------------------------------------------------
    def _step(self) -> None:
        path = self._path
        path.mark("step", "")
        self._waits.wait_and_read(self._control.on_message)
        path.mark("step:polled", "")
        # liveness right after reading every pending message: a stall of this loop (a long write, a
        # starved thread) must not count as the peers' silence (their heartbeats wait unread)
        self._control.housekeeping()
        path.start_gathers()
        path.mark("step:taken", "")
        path.post_ready()
        path.complete()
        self._control.flush_fences()
        path.release_preps()

    def _crashed(self, exc: BaseException) -> None:
        with self._requests.lock:
            for st in self._requests:
                if not st.status.is_terminal:
                    self._requests.set_status(st, S.FAILED, f"endpoint loop crashed: {exc!r}")

    def _teardown(self) -> None:
        self.transport.close()
        self._peers.close()
        self._loop.waker.close()
