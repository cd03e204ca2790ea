"""The sender's data path (a mixin of KVSender): queued layers → staging ring → transport writes.

Runs on the sender's loop thread only. Order of one loop step: `_start_gathers` (queued layers into free
slots, pipeline.py), `_post_ready` (gathered layers of begun requests written: one write per receiver
for one-sided transports, carrying a LayerNotices batch; one per request-layer for two-sided ones),
`_complete` (finished writes free their slots; a failed one fails its request). When layers are queued
or in flight but none can move (`_can_take_layer`, `_can_post` say no), the step waits in `_nap_busy`
(GIL released, `TransferConfig.busy_wait_s` per nap) instead of stepping back to back. A direct request's
pieces of every layer are computed at add_request (runs.direct_layers) and turned into the transport's
own form once its Begin is answered (`_prepare`, SendTransport.prepare_layers: NIXL prepared
descriptor lists), so a post is an index list plus the transport call; those are released
(`_release_preps`) once the request is terminal with nothing in flight, or released. With a transport's
`write_per_request` (NIXL) the direct layers of each request go out as their own write (one prepared
list pair per write), the staged ones of all requests as one write per receiver. Each request's
`extra["inflight"]` counts its request-layers between gather (or, direct, leaving the queue) and
completion: its Stopped fence and release() wait for zero.

Direct path: a request whose source and destination blocks give few pieces (runs.joint_runs,
`extra["runs"]`, decided at add_request) is written straight from kv_buffer, no gather. The prefill
worker frees a request's source blocks as soon as its status is terminal, not when release() is
allowed, so a direct write still in flight then may read blocks already reused by another request.
That is safe: (1) DONE comes from the receiver after every layer landed, so every byte was read
before; (2) for ABORTED/FAILED the receiver never uses the request's blocks and frees them only after
the sender's Stopped fence, which _flush_stops sends only once no write of the request is in flight, or
after the sender is gone / its epoch changed (then every write to it was cancelled, sender.py
_fail_peer); garbage landing in such blocks is never read. (3) Nothing is posted after a request
became terminal: _post_ready checks the status under the lock, and every status change of the
sender runs on this loop thread, so it cannot change between that check and the post.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Any

import torch

from kvtransfer import messages as m
from kvtransfer.endpoint import RequestState
from kvtransfer.pipeline import Item, LayerOp, LayerPipeline
from kvtransfer.runs import make_tag, staged_pieces
from kvtransfer.staging import checksum, layer_checksum
from kvtransfer.transport import KV, STAGING, SendTransport
from kvtransfer.types import KVLayout, TransferConfig, TransferError, TransferStatus
from kvtransfer.wakeup import Waker, nap

S = TransferStatus


class SendPath:
    """Data-path methods of KVSender; the attributes below are KVSender's."""

    config: TransferConfig
    kv_buffer: torch.Tensor
    layout: KVLayout
    transport: SendTransport
    _pipe: LayerPipeline
    _lock: threading.Condition
    _requests: dict[str, RequestState]
    _queue: deque[tuple[str, int, torch.cuda.Event | None]]
    _preps: dict[str, list[object]]
    _events: Any
    _waker: Waker

    if TYPE_CHECKING:
        def _peer(self, address: str) -> Any: ...
        def _send(self, peer: Any, msg: m.Message) -> None: ...
        def _set(self, st: RequestState, status: TransferStatus, reason: str = "") -> None: ...

    def _can_take_layer(self) -> bool:
        """Whether the oldest queued request-layer can enter the pipeline now (or be dropped: its
        request ended); False with an empty queue."""
        if not self._queue:
            return False
        with self._lock:
            st = self._requests.get(self._queue[0][0])
        if st is None or st.status.is_terminal:
            return True
        return self._pipe.can_start(len(st.extra["src_ids"]), st.extra["runs"] is not None)

    def _can_post(self) -> bool:
        """Whether a request-layer not yet posted can be posted (or dropped) now: its request is
        terminal, or begun and its CUDA event completed (always, on CPU). Only the oldest begun one's
        event is queried (one query per look, not depth): events complete in the order send_layer
        recorded them, so a later one found complete a nap later loses at most that nap."""
        with self._lock:
            states = [(op, self._requests[op.request_id]) for op in self._pipe.ops if not op.posted]
        for op, st in states:
            if st.status.is_terminal:
                return True
            if st.extra["begun"]:
                return op.ready is None or bool(op.ready.query())
        return False

    def _nap_busy(self, socks: list[Any], cap_s: float) -> bool:
        """Wait with the GIL released while the data path only waits for send_layer events or write
        completions, which signal nothing: naps of `config.busy_wait_s` (wakeup.nap), and between two
        only those are looked at (completions handled here, by _complete), so each look costs the
        producer thread little GIL time. Returns True as soon as the waker or a socket in `socks` is
        readable (a command, a send_layer, a message: the caller reads them), False once an event
        completed, a write finished or `cap_s` seconds passed (housekeeping is due)."""
        end = time.monotonic() + cap_s
        self._mark("nap", "")
        while True:
            if nap(self._waker, socks, min(self.config.busy_wait_s, cap_s)):
                self._mark("nap_end", "")
                return True
            if self._can_post() or self._complete() or time.monotonic() >= end:
                self._mark("nap_end", "")
                return False

    def _start_gathers(self) -> None:
        """Move queued layers into the pipeline, in send_layer order: staged ones gathered into free
        staging slots, direct ones as they are (also before the request's Begin is answered: the
        gathers overlap the round trip, only the write waits for it)."""
        if not self._queue:
            return
        items: list[Item] = []
        states: list[RequestState] = []
        dropped: list[Any] = []
        with self._lock:  # once for the batch (a send_layers call queues every layer at once)
            while self._queue and len(items) < self._pipe.capacity:
                rid, layer, event = self._queue.popleft()
                st = self._requests.get(rid)
                if st is not None and not st.status.is_terminal:
                    items.append((rid, layer, st.extra["src"], event, st.extra["runs"] is not None))
                    states.append(st)
                elif event is not None:  # dropped: nothing waits on it
                    dropped.append(event)
        for event in dropped:
            if self._events is not None:
                self._events.give_back(event)
        started = self._pipe.start(items)
        for rid, layer, _src, event, _ in reversed(items[started:]):  # no slot yet (the ring must drain)
            self._queue.appendleft((rid, layer, event))
        with self._lock:
            for st in states[:started]:
                st.extra["inflight"] += 1

    def _post_ready(self) -> None:
        """Start the writes of gathered request-layers (gather event completed) of begun requests: one
        write per peer carrying all of them for one-sided transports, one per request-layer else."""
        groups: dict[str, list[tuple[LayerOp, RequestState]]] = {}
        ops: list[tuple[LayerOp, RequestState]] = []
        cancelled: set[str] = set()
        with self._lock:  # once for all ready ops
            for op in self._pipe.ready():
                st = self._requests[op.request_id]  # not releasable while in flight
                if st.status.is_terminal:  # aborted/failed after the gather: nothing more is written
                    if op.request_id not in cancelled:  # one cancel drops all of the request's ops
                        cancelled.add(op.request_id)
                        self._dropped(self._pipe.cancel(op.request_id, posted=False))
                    continue
                if st.extra["begun"]:  # else the receiver has not claimed the request yet
                    ops.append((op, st))
        for op, st in ops:
            if not self.transport.one_sided:
                key = f"{op.request_id}:{op.layer}"
            elif op.direct and self.transport.write_per_request:
                key = f"{st.handle.address}\0{op.request_id}"
            else:
                key = st.handle.address
            groups.setdefault(key, []).append((op, st))
        for batch in groups.values():
            self._post(batch)

    def _post(self, batch: list[tuple[LayerOp, RequestState]]) -> None:
        address = batch[0][1].handle.address
        self._mark("post:start", batch[0][0].request_id)
        notices: list[m.LayerNotice] = []
        parts: list[object] = []
        try:
            for op, st in batch:
                x = st.extra
                if op.direct:
                    parts.append((x["prep"] or self._prepare(st))[op.layer])
                else:
                    off = self._pipe.staging_offset(op)
                    ps = staged_pieces(st.handle.layout, len(x["src_ids"]), x["dst_runs"], op.layer)
                    parts.append(self.transport.prepare(address, [(STAGING, off + a, b, n)
                                                                  for a, b, n in ps]))
                notices.append(self._notice(op, st))
            if not self.transport.one_sided:
                self._send(self._peer(address), notices[0])
            notice = notices[0] if len(notices) == 1 else m.LayerNotices(notices)
            self._pipe.post([op for op, _ in batch], address, parts, m.encode(notice), notices[0].tag)
        except TransferError as exc:  # the ops are finished (or were never posted): fail their requests
            for op, _ in batch:
                self._pipe.discard(op)
                self._layer_done(op.request_id, op.layer, str(exc))

    def _prepare(self, st: RequestState) -> list[object]:
        """A direct request's every layer in the transport's own form (once, after its Begin was
        answered: the receiver's transport address is known then). Raises TransferError (unknown peer)."""
        pieces = [[(KV, s, d, n) for s, d, n in layer] for layer in st.extra["pieces"]]
        prep = self.transport.prepare_layers(st.handle.address, pieces)
        old = self._preps.pop(st.handle.request_id, None)
        if old is not None:
            self.transport.release_prepared(old)
        st.extra["prep"] = self._preps[st.handle.request_id] = prep
        return prep

    def _release_preps(self) -> None:
        """Free the prepared lists of requests released, or terminal with nothing in flight (nothing
        is posted for a terminal request, see the module docstring)."""
        if not self._preps:
            return
        with self._lock:
            done = []
            for rid, prep in self._preps.items():
                st = self._requests.get(rid)
                if st is None or st.extra["prep"] is not prep or (st.status.is_terminal
                                                                   and not st.extra["inflight"]):
                    done.append(rid)
                    if st is not None and st.extra["prep"] is prep:
                        st.extra["prep"] = None
        for rid in done:
            self.transport.release_prepared(self._preps.pop(rid))

    def _mark(self, what: str, request_id: str) -> None:
        if self._pipe.trace is not None:
            self._pipe.trace.append((time.perf_counter(), what, request_id, -1))

    def _notice(self, op: LayerOp, st: RequestState) -> m.LayerNotice:
        x = st.extra
        crc = None
        if self.config.checksum:  # debug setting: slow (index_select + host copy) is fine
            crc = (layer_checksum(self.kv_buffer, op.layer, tuple(x["src_ids"])) if op.direct
                   else checksum(self._pipe.staging(op)))
        return m.LayerNotice(st.handle.request_id, op.layer, make_tag(x["key"], op.layer), crc,
                             x["cuts"] if op.direct else ())

    def _dropped(self, ops: list[LayerOp]) -> None:
        """Account for ops dropped without completing (caller holds the lock)."""
        for op in ops:
            self._requests[op.request_id].extra["inflight"] -= 1

    def _complete(self) -> bool:
        """Handle finished writes; True if any finished."""
        done = self._pipe.poll()
        for op, error in done:
            self._layer_done(op.request_id, op.layer, error)
        return bool(done)

    def _layer_done(self, request_id: str, layer: int, error: str | None) -> None:
        with self._lock:
            st = self._requests[request_id]
            st.extra["inflight"] -= 1
            if error is not None and not st.status.is_terminal:
                self._set(st, S.FAILED, f"transfer of layer {layer} failed: {error}")
                self._stop_later(st, aborted=False)

    def _stop_later(self, st: RequestState, aborted: bool) -> None:
        """Send Stopped (we write nothing more) once no write of the request is in flight (lock held)."""
        st.extra["stop"] = aborted

    def _flush_stops(self) -> None:
        with self._lock:
            for st in self._requests.values():
                x = st.extra
                if x["stop"] is None or x["inflight"]:
                    continue
                if x["begun"]:  # only a begun request can have written anything
                    self._send(self._peer(st.handle.address), m.Stopped(st.handle.request_id, x["stop"],
                                                                        st.reason))
                x["stop"] = None
