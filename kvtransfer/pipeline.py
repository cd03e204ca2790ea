"""The sender's data path: several request-layers in flight at once, none waiting on the one before.

A request-layer goes through three stages, each started by the sender loop without blocking:

1. gather (staged request-layers only): its K and V blocks are copied into a free slot of the
   staging ring (staging.py). On a GPU the copy runs on a side CUDA stream, after an event
   recorded on the caller's stream when send_layer() was called (so it reads the layer's KV only
   once attention has stored it), and records its own event; on CPU it is synchronous.
2. post: once the gather event has completed, the transport write is started (SendTransport.post);
   the loop never calls synchronize().
3. complete: the loop tests posted writes; a completed one frees its slot.

A direct request-layer (its source blocks form few runs, send_path.py) skips stage 1: it is written
straight from kv_buffer once the event recorded at send_layer() has completed (on CPU at once), and
holds no slot. `depth` (TransferConfig.max_inflight_layers) bounds all request-layers between stage 1
(or send_layer, for direct ones) and stage 3.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvtransfer.lookahead import WriteRate
from kvtransfer.staging import StagingRing, gather_layer
from kvtransfer.transports.base import SendTransport
from kvtransfer.types import TransferError


@dataclass(slots=True)
class LayerOp:
    """One request-layer in flight. `slot`: its staging slot, -1 for a direct one; `ready`: CUDA event
    of its gather, or of send_layer for a direct one (None on CPU: ready at once); `handle`/`peer`: the
    transport's handle and the receiver once posted."""

    request_id: str
    layer: int
    slot: int
    n_blocks: int
    ready: torch.cuda.Event | None = None
    handle: object = None
    posted: bool = False
    peer: str = ""

    @property
    def direct(self) -> bool:
        """Written straight from kv_buffer (no staging slot)."""
        return self.slot < 0


Item = tuple[str, int, torch.Tensor, "torch.cuda.Event | None", bool]  # (rid, layer, src, after, direct)


@dataclass(slots=True)
class _Write:
    """One posted transport write: its ops, size, post time (time.monotonic() s), expected duration (s,
    from the rate estimate; None without one) and whether no other write was in flight during it."""

    handle: object
    ops: list[LayerOp]
    nbytes: int
    posted_at: float
    expected: float | None
    alone: bool


class LayerPipeline:
    """Staging ring and in-flight request-layers of one sender; used by the sender loop thread only.

    kv_buffer: `[num_layers, 2, num_blocks, block_size, H, D]`, the sender's paged KV (any dtype/device).
    direct: register kv_buffer with the transport (once, here) for direct writes. recycle: called once per
    request-layer with its send_layer(s) event when that request-layer no longer waits on it (an event
    shared by several is called for as often: events.EventPool.give_back counts). rate: the transport's
    rate estimate (lookahead.py), fed by every write that completes alone (default: a new one).
    Raises ValueError if depth < 1.
    """

    def __init__(self, kv_buffer: torch.Tensor, transport: SendTransport, depth: int,
                 direct: bool = False, recycle: Callable[[torch.cuda.Event], None] | None = None,
                 rate: WriteRate | None = None) -> None:
        self.kv_buffer = kv_buffer
        self.transport = transport
        self.depth = depth
        self.ring = StagingRing(kv_buffer, depth, transport.set_staging)
        if direct:
            transport.register_kv(kv_buffer)
        self.ops: list[LayerOp] = []
        self.unposted = 0  # ops in self.ops not posted yet
        self.posted = {"staged": 0, "direct": 0}  # request-layers posted so far, by path
        self.rate = rate if rate is not None else WriteRate()
        self._writes: list[_Write] = []  # posted writes in flight, oldest first
        self._op_bytes = 2 * kv_buffer[0, 0, 0].numel() * kv_buffer.element_size()  # K + V of one block
        # set to a list to record (time.perf_counter() s, "gather"|"post"|"done", request_id, layer)
        self.trace: list[tuple[float, str, str, int]] | None = None
        self._stream = torch.cuda.Stream(kv_buffer.device) if kv_buffer.is_cuda else None
        self._recycle = recycle

    def inflight(self, request_id: str | None = None) -> int:
        """Request-layers gathered or being written (of one request, or of all)."""
        return sum(1 for op in self.ops if request_id is None or op.request_id == request_id)

    @property
    def writes_in_flight(self) -> int:
        """Transport writes posted and not yet complete."""
        return len(self._writes)

    @property
    def capacity(self) -> int:
        """Request-layers that may still enter the pipeline (depth minus those in flight)."""
        return self.depth - len(self.ops)

    def can_start(self, n_blocks: int, direct: bool) -> bool:
        """Whether start() would take a request-layer of `n_blocks` blocks now: capacity left and, for a
        staged one, a staging slot it fits in (or an empty ring that may grow)."""
        if self.capacity <= 0:
            return False
        ring = self.ring
        return direct or (ring.free_slots > 0 and (ring.bytes_for(n_blocks) <= ring.slot_bytes
                                                    or ring.in_use == 0))

    def start(self, items: list[Item]) -> int:
        """Start each (request_id, layer, src, after, direct) in order while capacity (and, for staged
        ones, a free slot) lasts: a staged one is gathered into a slot, a direct one just waits for
        `after`. src: the request's source block ids, int64 [n] in token order, on kv_buffer's device.
        after: the caller's stream event at send_layer time, or None (CPU). On a GPU the gathers of one
        call share one side-stream context and one completion event. Returns how many items were
        started (a prefix of `items`).
        """
        ops, last, n = [], None, 0
        for request_id, layer, src, after, direct in items[:self.capacity]:
            if src is not last:  # one tensor per request: its layers come in a row
                last, n = src, int(src.numel())
            slot = -1 if direct else self.ring.acquire(n)
            if slot is None:
                break
            ops.append(LayerOp(request_id, layer, slot, n, after if direct else None))
        gathers = [(op, item[2], item[3]) for op, item in zip(ops, items, strict=False) if not op.direct]
        if self._stream is None:
            for op, src, after in gathers:
                gather_layer(self.kv_buffer, op.layer, src, self.ring.view(op.slot, op.n_blocks))
                if after is not None and self._recycle is not None:  # synchronous: nothing waits on it
                    self._recycle(after)
        elif gathers:
            with torch.cuda.stream(self._stream):
                for op, src, after in gathers:
                    if after is not None:
                        self._stream.wait_event(after)
                        if self._recycle is not None:  # the wait holds the record it saw: reusable
                            self._recycle(after)
                    gather_layer(self.kv_buffer, op.layer, src, self.ring.view(op.slot, op.n_blocks))
                ready = torch.cuda.Event()
                ready.record(self._stream)
            for op, _, _ in gathers:
                op.ready = ready
        self.ops += ops
        self.unposted += len(ops)
        if self.trace is not None:
            for op in ops:
                self._note("gather", op)
        return len(ops)

    def ready(self) -> list[LayerOp]:
        """Gathered, not yet posted request-layers, oldest first. An event shared by several ops (one
        send_layers call, or one start()'s gathers) is queried once per call, not once per op."""
        done: dict[int, bool] = {}
        out: list[LayerOp] = []
        for op in self.ops:
            if op.posted:
                continue
            event = op.ready
            if event is not None:
                ok = done.get(id(event))
                if ok is None:
                    ok = done[id(event)] = bool(event.query())
                if not ok:
                    continue
            out.append(op)
        return out

    def staging(self, op: LayerOp) -> torch.Tensor:
        """The gathered `[2, n, block_size, H, D]` staging view of `op` (complete once in ready())."""
        return self.ring.view(op.slot, op.n_blocks)

    def post(self, ops: list[LayerOp], peer: str, parts: list[object], notice: bytes,
             tag: int) -> None:
        """Start one write of several ready ops to the same peer (one transport call, one notice: the
        transport's per-write cost is paid once, not once per request-layer).
        `parts[i]`: op i's pieces as `transport.prepare` returned them (staged ones with source offsets
        from `staging_offset`).

        Raises TransferError (the ops are then finished and their slots freed) if it cannot start.
        """
        try:
            handle = self.transport.post_prepared(peer, parts, notice, tag)
        except TransferError:
            self._finish(*ops)
            raise
        nbytes = self._op_bytes * sum(op.n_blocks for op in ops)
        for w in self._writes:  # they now share the transport: none of them predicts or teaches the rate
            w.alone = False
        self._writes.append(_Write(handle, ops, nbytes, time.monotonic(), self.rate.predict(nbytes),
                                   not self._writes))
        for op in ops:
            op.handle, op.posted, op.peer = handle, True, peer
            self.posted["direct" if op.direct else "staged"] += 1
        self.unposted -= len(ops)
        if self.trace is not None:
            for op in ops:
                self._note("post", op)

    def lone_write(self) -> tuple[float, float] | None:
        """(posted_at monotonic s, expected s) of the one write in flight if it had the transport to itself,
        was predicted, and no op waits to be posted (nothing else to wait for); else None (nap_length)."""
        if len(self._writes) != 1 or self.unposted:
            return None
        w = self._writes[0]
        return None if w.expected is None or not w.alone else (w.posted_at, w.expected)

    def discard(self, op: LayerOp) -> None:
        """Drop an op that will not be posted (its write could not be prepared); frees its slot."""
        if any(o is op for o in self.ops):
            self._finish(op)

    def staging_offset(self, op: LayerOp) -> int:
        """Byte offset of a staged op's slot in the staging ring (its pieces' source base)."""
        return self.ring.offset(op.slot)

    def poll(self) -> list[tuple[LayerOp, str | None]]:
        """Progress and test posted writes; return the ops that finished, each with an error or None. A
        write that completed alone teaches `rate` its bytes / (seconds from post to this look)."""
        if not self._writes:
            return []
        self.transport.progress()
        done: list[tuple[LayerOp, str | None]] = []
        for w in list(self._writes):
            error = None
            try:
                if not self.transport.test(w.handle):
                    continue
                if w.alone:
                    self.rate.observe(w.nbytes, time.monotonic() - w.posted_at)
            except TransferError as exc:
                error = str(exc)
            for op in w.ops:
                done.append((op, error))
                self._note("done", op)
            self._finish(*w.ops)  # one pass over self.ops per write, not per request-layer
        return done

    def cancel(self, request_id: str, posted: bool) -> list[LayerOp]:
        """Drop a request's ops not yet posted, and with `posted` also its posted writes, cancelled with
        every op sharing their write (only for a peer that is gone); returns every op dropped.

        A gather still running on the side stream is waited for first (its slot may be reused next)."""
        dropped = [op for op in self.ops if op.request_id == request_id and not op.posted]
        for op in dropped:
            if op.ready is not None and not op.direct:
                op.ready.synchronize()
            self._finish(op)
        if posted:
            dropped += self._cancel_posted(lambda w: any(op.request_id == request_id for op in w.ops))
        return dropped

    def cancel_peer(self, peer: str) -> list[LayerOp]:
        """Cancel every posted write to `peer` (declared lost or restarted), whatever the state of the
        requests it carries (terminal ones too: a WRITE to a SIGKILLed process may never complete nor
        fail), and free their slots; returns the ops dropped."""
        return self._cancel_posted(lambda w: w.ops[0].peer == peer)

    def _cancel_posted(self, which: Callable[[_Write], bool]) -> list[LayerOp]:
        dropped: list[LayerOp] = []
        for w in [w for w in self._writes if which(w)]:
            self.transport.cancel(w.handle)
            self._finish(*w.ops)
            dropped += w.ops
        return dropped

    def _note(self, what: str, op: LayerOp) -> None:
        if self.trace is not None:
            self.trace.append((time.perf_counter(), what, op.request_id, op.layer))

    def _finish(self, *ops: LayerOp) -> None:
        """Drop `ops` (all of a write's ops together, or unposted ones): frees slots, gives events back."""
        gone = {id(op) for op in ops}
        self.ops = [o for o in self.ops if id(o) not in gone]
        if ops[0].posted:
            self._writes = [w for w in self._writes if w.handle is not ops[0].handle]
        else:
            self.unposted -= len(ops)
        for op in ops:
            if not op.direct:
                self.ring.release(op.slot)
            elif op.ready is not None and self._recycle is not None:  # send_layer's event: nothing waits
                self._recycle(op.ready)
                op.ready = None
