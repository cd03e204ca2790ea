"""The sender's data path (a mixin of KVSender): queued layers → staging ring → transport writes.

Runs on the sender's loop thread only. Order of one loop step: `_start_gathers` (queued layers into free
slots, pipeline.py), `_post_ready` (gathered layers of begun requests written: one write per receiver
for one-sided transports, carrying a LayerNotices batch; one per request-layer for two-sided ones),
`_complete` (finished writes free their slots; a failed one fails its request). When layers are queued
or in flight but none can move, the step waits (send_wait.py, GIL released) instead of stepping back to
back. A direct request's pieces of every layer are computed at add_request (runs.direct_layers) and
turned into the transport's own form once its Begin is answered (`_prepare`, SendTransport.prepare_layers:
NIXL prepared descriptor lists), so a post is an index list plus the transport call; without checksums
the transport may also make the write of all its layers then (`_premake`, NIXL: its xfer handle with
every notice), so that a batch of exactly all its layers in order (a send_layers hand-off) is one
transfer() with nothing built (`_whole`); any other post leaves it unused. Both are released
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
became terminal: _post_ready (and post_now.py's hand-off) checks the status under the lock, and every
status change of the sender runs inside a loop step, which holds the data lock (`_data`) that the post
also holds, so it cannot change between that check and the post.
"""

from __future__ import annotations

import itertools
import threading
from collections import deque
from typing import TYPE_CHECKING, Any

import torch

from kvtransfer import wire as m
from kvtransfer.api import KVLayout, TransferConfig, TransferError, TransferStatus
from kvtransfer.endpoint import RequestState
from kvtransfer.pipeline import Item, LayerOp, LayerPipeline
from kvtransfer.runs import make_tag, staged_pieces
from kvtransfer.send_wait import SendWait
from kvtransfer.staging import checksum, layer_checksum
from kvtransfer.transports.base import KV, STAGING, SendTransport

S = TransferStatus


class SendPath(SendWait):
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

    if TYPE_CHECKING:
        def _peer(self, address: str) -> Any: ...
        def _send(self, peer: Any, msg: m.Message) -> None: ...
        def _set(self, st: RequestState, status: TransferStatus, reason: str = "") -> None: ...
        def _withdraw(self, st: RequestState, aborted: bool) -> bool: ...

    def _start_gathers(self) -> None:
        """Move queued layers into the pipeline, in send_layer order: staged ones gathered into free
        staging slots, direct ones as they are (also before the request's Begin is answered: the
        gathers overlap the round trip, only the write waits for it)."""
        if not self._queue:
            return
        items: list[Item] = []
        states: list[RequestState] = []
        dropped: list[Any] = []
        room, last, st = self._pipe.capacity, None, None
        with self._lock:  # once for the batch (a send_layers call queues every layer at once)
            while self._queue and len(items) < room:
                rid, layer, event = self._queue.popleft()
                if rid != last:  # a request's layers come in a row: look it up once per row
                    last, st = rid, self._requests.get(rid)
                    if st is not None and st.status.is_terminal:
                        st = None
                if st is not None:
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
            for _, row in itertools.groupby(states[:started], key=id):
                run = list(row)
                run[0].extra["inflight"] += len(run)

    def _post_ready(self) -> None:
        """Start the writes of gathered request-layers (gather event completed) of begun requests: one
        write per peer carrying all of them for one-sided transports, one per request-layer else."""
        groups: dict[object, list[tuple[LayerOp, RequestState]]] = {}
        ops: list[tuple[LayerOp, RequestState]] = []
        cancelled: set[str] = set()
        last, take = None, False
        with self._lock:  # once for all ready ops
            for op in self._pipe.ready():
                if op.request_id != last:  # a request's ops come in a row: look it up once per row
                    last, st = op.request_id, self._requests[op.request_id]  # not releasable in flight
                    take = not st.status.is_terminal and st.extra["begun"]  # else not claimed yet
                    # aborted/failed after the gather: nothing more is written; one cancel drops all
                    # of the request's ops
                    if st.status.is_terminal and op.request_id not in cancelled:
                        cancelled.add(op.request_id)
                        self._dropped(self._pipe.cancel(op.request_id, posted=False))
                if take:
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
            self._pipe.post([op for op, _ in batch], address, parts, _encode(notices), notices[0].tag)
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
        """Send Stopped (we write nothing more) once no write of the request is in flight, or Withdraw
        if its Begin never went out (lock held)."""
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
                elif not x.get("begin_sent") and not self._withdraw(st, x["stop"]):
                    continue  # never begun: its Withdraw waits for the receiver's HelloReply
                # (a Begin in flight: its answer decides, sender.py _on_message)
                x["stop"] = None


def _encode(notices: list[m.LayerNotice]) -> bytes:
    """The notification of a write carrying `notices`: one LayerNotice, or a LayerNotices batch."""
    return m.encode(notices[0] if len(notices) == 1 else m.LayerNotices(notices))
