"""The sender's data path: handed-off layers → staging ring or kv_buffer → transport writes → completion.

`hand_off` runs on the caller's (forward pass) thread; everything else on the sender's loop thread, in
this order within one step (sender.py): `start_gathers` (queued layers into the pipeline: staged ones
gathered into free staging slots, direct ones as they are), `post_ready` (ready layers of begun
requests written: one write per receiver carrying a LayerNotices batch for one-sided transports, one
per request-layer for two-sided ones; with a transport's `write_per_request` (NIXL) the direct layers
of each request go as their own write), `complete` (finished writes free their slots; a failed one
fails its request), `release_preps`. How the loop waits between steps is send_wait.py.

Hand-off: validate every layer first (a refused call queues and marks nothing), then under ONE lock
acquisition mark them handed off, record ONE CUDA event (from the pool, events.py; None on CPU) shared
by all of them, append them to the queue in ONE deque.extend (atomic in CPython: the loop sees all or
none, takes them up in one step and posts them as one write per receiver), and wake the loop at most
once, and only if it could take them up (`take_layers`: False while the pipeline is full).

Direct path: a request whose source and destination blocks give few pieces (runs.joint_runs, decided
at add_request) is written straight from kv_buffer, no gather; its pieces of every layer are computed
at add_request and turned into the transport's own form once its Begin is answered (`prepare`,
SendTransport.prepare_layers: NIXL prepared descriptor lists), so a post is an index list plus the
transport call; they are released (`release_preps`) once the request is terminal with nothing in
flight, or released. The prefill worker frees a request's source blocks as soon as its status is
terminal, not when release() is allowed, so a direct write still in flight may read blocks already
reused. That is safe: (1) DONE comes from the receiver after every layer landed, so every byte was
read before; (2) for ABORTED/FAILED the receiver never uses the request's blocks and frees them only
after the sender's Stopped fence, which goes out only once no write of the request is in flight, or
after the sender is gone / its epoch changed (then every write to it was cancelled,
send_control.fail_peer); garbage landing in such blocks is never read. (3) Nothing is posted after a
request became terminal: `post_ready` checks the status under the lock, and every status change of
the sender runs on the loop thread, which is the one posting.

"""

from __future__ import annotations

import itertools
import operator
import time
from collections import deque
from collections.abc import Callable, Sequence

import torch

from kvtransfer import wire
from kvtransfer.events import EventPool
from kvtransfer.loop import LoopThread
from kvtransfer.pipeline import Item, LayerOp, LayerPipeline
from kvtransfer.requests import RequestTable, SendState
from kvtransfer.runs import make_tag, staged_pieces
from kvtransfer.staging import checksum, layer_checksum
from kvtransfer.transports.base import KV, STAGING, SendTransport
from kvtransfer.types import KVLayout, TransferConfig, TransferError, TransferStatus

S = TransferStatus
QueuedLayer = tuple[str, int, "torch.cuda.Event | None"]  # (request_id, layer, event it waits for)


class SendPath:
    """The data path of one sender over `transport`, reading `kv_buffer [num_layers, 2, num_blocks,
    block_size, H, D]`. `pipe` holds the request-layers in flight; `requests`/`loop` are the sender's;
    `announce(address, notice)` sends a two-sided transport's LayerNotice on the control plane before
    its data; `events` hands out send_layer's CUDA events (None on CPU)."""

    def __init__(self, config: TransferConfig, kv_buffer: torch.Tensor, layout: KVLayout,
                 transport: SendTransport, pipe: LayerPipeline, requests: RequestTable[SendState],
                 loop: LoopThread, announce: Callable[[str, wire.LayerNotice], None],
                 events: EventPool | None) -> None:
        self.config, self.kv_buffer, self.layout, self.transport = config, kv_buffer, layout, transport
        self.pipe, self.requests, self.loop, self.events = pipe, requests, loop, events
        self._announce = announce
        self.queue: deque[QueuedLayer] = deque()
        # a hand-off may wake the loop; the loop clears it before it sleeps with a full pipeline
        self.take_layers = True
        self.preps: dict[str, list[object]] = {}  # request → transport.prepare_layers parts

    # ---- the caller's thread ----------------------------------------------------------------------
    def hand_off(self, request_id: str, layers: Sequence[int] | None) -> None:
        """Queue `layers` (None: every layer, 0..num_layers-1, in order) of the request for sending, in
        the given order. Raises, with nothing queued or marked: TypeError for a non-integer layer,
        ValueError for a layer out of range, given twice or already handed off, TransferError if the
        sender is not running, KeyError for an unknown request. An empty `layers` queues nothing (after
        the same checks of the request)."""
        n = self.layout.num_layers
        wanted = list(range(n)) if layers is None else [operator.index(x) for x in layers]
        for layer in wanted:
            if not 0 <= layer < n:
                raise ValueError(f"layer {layer} out of range [0, {n})")
        if len(set(wanted)) != len(wanted):
            raise ValueError(f"a layer is given twice in {wanted}")
        if not self.loop.running:
            raise TransferError(f"{self.loop.label} is not running (call start() first)")
        with self.requests.lock:
            st = self.requests.get(request_id)
            again = sorted(st.layers.intersection(wanted))
            if again:
                raise ValueError(f"layer(s) {again} of {request_id!r} already sent")
            st.layers.update(wanted)
            if wanted:  # progress: the backstop stays a heartbeat-timeout after the receiver's deadline
                backstop = time.monotonic() + st.handle.timeout_s + self.config.peer_timeout_s
                st.deadline = max(st.deadline, backstop)
        if not wanted:
            return
        # the writes (or gathers) must follow the caller's stream up to now: one event for all of them,
        # given back by each of its request-layers (EventPool counts the uses)
        self.mark("handoff:marked", request_id)
        event = self.events.record(len(wanted)) if self.events is not None else None
        self.mark("handoff:recorded", request_id)
        self.queue.extend([(request_id, layer, event) for layer in wanted])
        if self.take_layers:  # else the pipeline is full: the loop could not take them up now
            self.loop.waker.wake()

    # ---- the loop thread ---------------------------------------------------------------------------
    def start_gathers(self) -> None:
        """Move queued layers into the pipeline, in hand-off order: staged ones gathered into free
        staging slots, direct ones as they are (also before the request's Begin is answered: the
        gathers overlap the round trip, only the write waits for it)."""
        if not self.queue:
            return
        items: list[Item] = []
        states: list[SendState] = []
        dropped: list[torch.cuda.Event] = []
        room, last, st = self.pipe.capacity, None, None
        with self.requests.lock:  # once for the batch (a send_layers call queues every layer at once)
            while self.queue and len(items) < room:
                rid, layer, event = self.queue.popleft()
                if rid != last:  # a request's layers come in a row: look it up once per row
                    last, st = rid, self.requests.find(rid)
                    if st is not None and st.status.is_terminal:
                        st = None
                if st is not None:
                    items.append((rid, layer, st.plan.src, event, st.plan.direct))
                    states.append(st)
                elif event is not None:  # dropped: nothing waits on it
                    dropped.append(event)
        if self.events is not None:
            for event in dropped:
                self.events.give_back(event)
        started = self.pipe.start(items)
        for rid, layer, _src, event, _ in reversed(items[started:]):  # no slot yet (the ring must drain)
            self.queue.appendleft((rid, layer, event))
        with self.requests.lock:
            for _, row in itertools.groupby(states[:started], key=id):
                run = list(row)
                run[0].inflight += len(run)

    def post_ready(self) -> None:
        """Start the writes of ready request-layers (gather or send_layer event completed) of begun
        requests: one write per peer carrying all of them for one-sided transports, one per
        request-layer else; drop those of requests that became terminal."""
        groups: dict[object, list[tuple[LayerOp, SendState]]] = {}
        ops: list[tuple[LayerOp, SendState]] = []
        cancelled: set[str] = set()
        last, take, st = None, False, None
        with self.requests.lock:  # once for all ready ops
            for op in self.pipe.ready():
                if op.request_id != last:  # a request's ops come in a row: look it up once per row
                    last, st = op.request_id, self.requests.get(op.request_id)  # not releasable in flight
                    take = not st.status.is_terminal and st.begun  # else not claimed yet
                    # aborted/failed after the gather: nothing more is written; one cancel drops all
                    # of the request's ops
                    if st.status.is_terminal and op.request_id not in cancelled:
                        cancelled.add(op.request_id)
                        self.cancel(op.request_id)
                if take and st is not None:
                    ops.append((op, st))
        one_sided, per_request = self.transport.one_sided, self.transport.write_per_request
        for op, st in ops:
            if not one_sided:
                key: object = (op.request_id, op.layer)
            elif op.direct and per_request:
                key = (st.handle.address, op.request_id)
            else:
                key = st.handle.address
            groups.setdefault(key, []).append((op, st))
        for batch in groups.values():
            self._post(batch)

    def _post(self, batch: list[tuple[LayerOp, SendState]]) -> None:
        address = batch[0][1].handle.address
        self.mark("post:start", batch[0][0].request_id)
        notices: list[wire.LayerNotice] = []
        parts: list[object] = []
        try:
            for op, st in batch:
                if op.direct:
                    parts.append((st.prep or self.prepare(st))[op.layer])
                else:
                    off = self.pipe.staging_offset(op)
                    ps = staged_pieces(st.handle.layout, len(st.plan.src_ids), st.plan.dst_runs, op.layer)
                    staged = [(STAGING, off + a, b, n) for a, b, n in ps]
                    parts.append(self.transport.prepare(address, staged))
                notices.append(self._notice(op, st))
            if not self.transport.one_sided:
                self._announce(address, notices[0])
            self.pipe.post([op for op, _ in batch], address, parts, _encode(notices), notices[0].tag)
            posted_at = time.perf_counter()
            for _, st in batch:
                if st.first_posted_at is None:
                    st.first_posted_at = posted_at
        except TransferError as exc:  # the ops are finished (or were never posted): fail their requests
            for op, _ in batch:
                self.pipe.discard(op)
                self._layer_done(op.request_id, op.layer, str(exc))

    def prepare(self, st: SendState) -> list[object]:
        """A direct request's every layer in the transport's own form (once, after its Begin was
        answered: the receiver's transport address is known then). Raises TransferError (unknown peer)."""
        pieces = [[(KV, s, d, n) for s, d, n in layer] for layer in st.plan.pieces]
        prep = self.transport.prepare_layers(st.handle.address, pieces)
        old = self.preps.pop(st.request_id, None)
        if old is not None:
            self.transport.release_prepared(old)
        st.prep = self.preps[st.request_id] = prep
        return prep

    def release_preps(self) -> None:
        """Free the prepared lists of requests released, or terminal with nothing in flight (nothing
        is posted for a terminal request, see the module docstring)."""
        if not self.preps:
            return
        done = []
        with self.requests.lock:
            for rid, prep in self.preps.items():
                st = self.requests.find(rid)
                if st is None or st.prep is not prep or (st.status.is_terminal and not st.inflight):
                    done.append(rid)
                    if st is not None and st.prep is prep:
                        st.prep = None
        for rid in done:
            self.transport.release_prepared(self.preps.pop(rid))

    def _notice(self, op: LayerOp, st: SendState) -> wire.LayerNotice:
        crc = None
        if self.config.checksum:  # debug setting: slow (index_select + host copy) is fine
            crc = (layer_checksum(self.kv_buffer, op.layer, st.plan.src_ids) if op.direct
                   else checksum(self.pipe.staging(op)))
        return wire.LayerNotice(st.request_id, op.layer, make_tag(st.plan.key, op.layer), crc,
                                st.plan.cuts if op.direct else ())

    def cancel(self, request_id: str) -> None:
        """Drop the request's request-layers not yet posted (lock held); posted ones complete, fail, or
        are cancelled with their receiver (cancel_peer)."""
        self._dropped(self.pipe.cancel(request_id, posted=False))

    def cancel_peer(self, address: str) -> None:
        """Cancel every write posted to the receiver at `address` (lost or restarted; lock held)."""
        self._dropped(self.pipe.cancel_peer(address))

    def _dropped(self, ops: list[LayerOp]) -> None:
        for op in ops:
            self.requests.get(op.request_id).inflight -= 1

    def complete(self) -> bool:
        """Handle finished writes; True if any finished."""
        done = self.pipe.poll()
        for op, error in done:
            self._layer_done(op.request_id, op.layer, error)
        return bool(done)

    def _layer_done(self, request_id: str, layer: int, error: str | None) -> None:
        with self.requests.lock:
            st = self.requests.get(request_id)
            st.inflight -= 1
            if error is None:
                st.last_written_at = time.perf_counter()
            if error is not None and not st.status.is_terminal:
                self.requests.set_status(st, S.FAILED, f"transfer of layer {layer} failed: {error}")
                st.fence_later(aborted=False)

    def mark(self, what: str, request_id: str) -> None:
        """A trace event (set_trace: the pipeline's trace list) of the sender loop or hand-off; nothing
        while tracing is off."""
        trace = self.pipe.trace
        if trace is not None:
            trace.append((time.perf_counter(), what, request_id, -1))


def _encode(notices: list[wire.LayerNotice]) -> bytes:
    """The notification of a write carrying `notices`: one LayerNotice, or a LayerNotices batch."""
    return wire.encode(notices[0] if len(notices) == 1 else wire.LayerNotices(notices))
