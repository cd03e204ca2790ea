"""The sender's data path: several request-layers in flight at once, none waiting on the one before.

A request-layer goes through three stages, each started by the sender loop without blocking:

1. gather: its K and V blocks are copied into a free slot of the staging ring (staging.py). On a GPU
   the copy runs on a side CUDA stream, after an event recorded on the caller's stream when
   send_layer() was called (so it reads the layer's KV only once attention has stored it), and
   records its own event; on CPU it is synchronous.
2. post: once the gather event has completed, the transport write is started (SendTransport.post);
   the loop never calls synchronize().
3. complete: the loop tests posted writes; a completed one frees its slot.

`depth` (TransferConfig.max_inflight_layers) bounds the request-layers between stages 1 and 3. Before
this file the sender gathered, synchronized and wrote one request-layer at a time (GPU 2×H200: nixl
0.14 of a peer copy at 4k tokens, see docs/benchmarks/kv_transfer-h200.md).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from kvtransfer.runs import Piece
from kvtransfer.staging import StagingRing, gather_layer
from kvtransfer.transport import SendTransport
from kvtransfer.types import TransferError


@dataclass
class LayerOp:
    """One request-layer in flight. `ready`: CUDA event of its gather (None on CPU: already done);
    `handle`: the transport's handle once posted."""

    request_id: str
    layer: int
    slot: int
    n_blocks: int
    ready: torch.cuda.Event | None = None
    handle: object = None
    posted: bool = False


class LayerPipeline:
    """Staging ring and in-flight request-layers of one sender; used by the sender loop thread only.

    kv_buffer: `[num_layers, 2, num_blocks, block_size, H, D]`, the sender's paged KV (any dtype/device).
    Raises ValueError if depth < 1.
    """

    def __init__(self, kv_buffer: torch.Tensor, transport: SendTransport, depth: int) -> None:
        self.kv_buffer = kv_buffer
        self.transport = transport
        self.ring = StagingRing(kv_buffer, depth, transport.set_staging)
        self.ops: list[LayerOp] = []
        # set to a list to record (time.perf_counter() s, "gather"|"post"|"done", request_id, layer)
        self.trace: list[tuple[float, str, str, int]] | None = None
        self._stream = torch.cuda.Stream(kv_buffer.device) if kv_buffer.is_cuda else None

    def inflight(self, request_id: str | None = None) -> int:
        """Request-layers gathered or being written (of one request, or of all)."""
        return sum(1 for op in self.ops if request_id is None or op.request_id == request_id)

    def start(self, items: list[tuple[str, int, torch.Tensor, torch.cuda.Event | None]]) -> int:
        """Gather each (request_id, layer, src, after) into a free slot, in order, until none is free.

        src: the request's source block ids, int64 [n] in token order, on kv_buffer's device. after:
        event the gather must wait for (the caller's stream at send_layer time), or None. On a GPU the
        gathers of one call share one side-stream context and one completion event. Returns how many
        items were started (a prefix of `items`).
        """
        ops: list[LayerOp] = []
        for request_id, layer, src, _after in items:
            slot = self.ring.acquire(int(src.numel()))
            if slot is None:
                break
            ops.append(LayerOp(request_id, layer, slot, int(src.numel())))
        if self._stream is None:
            for op, (_, _, src, _) in zip(ops, items, strict=False):
                gather_layer(self.kv_buffer, op.layer, src, self.ring.view(op.slot, op.n_blocks))
        elif ops:
            with torch.cuda.stream(self._stream):
                for op, (_, _, src, after) in zip(ops, items, strict=False):
                    if after is not None:
                        self._stream.wait_event(after)
                    gather_layer(self.kv_buffer, op.layer, src, self.ring.view(op.slot, op.n_blocks))
                ready = torch.cuda.Event()
                ready.record(self._stream)
            for op in ops:
                op.ready = ready
        for op in ops:
            self.ops.append(op)
            self._note("gather", op)
        return len(ops)

    def ready(self) -> list[LayerOp]:
        """Gathered, not yet posted request-layers, oldest first."""
        return [op for op in self.ops if not op.posted and (op.ready is None or op.ready.query())]

    def staging(self, op: LayerOp) -> torch.Tensor:
        """The gathered `[2, n, block_size, H, D]` staging view of `op` (complete once in ready())."""
        return self.ring.view(op.slot, op.n_blocks)

    def post(self, ops: list[LayerOp], peer: str, pieces: list[list[Piece]], notice: bytes, tag: int) -> None:
        """Start one write of several gathered ops to the same peer (one transport call, one notice:
        the per-write cost, ~160 µs of NIXL calls per request-layer on an H200 host, is paid once).
        `pieces[i]` are op i's pieces with staging offsets relative to its slot.

        Raises TransferError (the ops are then finished and their slots freed) if it cannot start.
        """
        flat = [(self.ring.offset(op.slot) + s, d, n) for op, ps in zip(ops, pieces, strict=True)
                for s, d, n in ps]
        try:
            handle = self.transport.post(peer, flat, notice, tag)
        except TransferError:
            for op in ops:
                self._finish(op)
            raise
        for op in ops:
            op.handle, op.posted = handle, True
            self._note("post", op)

    def poll(self) -> list[tuple[LayerOp, str | None]]:
        """Progress and test posted writes; return the ops that finished, each with an error or None."""
        batches = self._batches([op for op in self.ops if op.posted])
        if batches:
            self.transport.progress()
        done: list[tuple[LayerOp, str | None]] = []
        for ops in batches:
            error = None
            try:
                if not self.transport.test(ops[0].handle):
                    continue
            except TransferError as exc:
                error = str(exc)
            for op in ops:
                done.append((op, error))
                self._note("done", op)
                self._finish(op)
        return done

    def cancel(self, request_id: str, posted: bool) -> list[LayerOp]:
        """Drop a request's ops not yet posted, and with `posted` also its posted writes, cancelled with
        every op sharing their write (only for a peer that is gone); returns every op dropped.

        A gather still running on the side stream is waited for first (its slot may be reused next)."""
        mine = [op for op in self.ops if op.request_id == request_id]
        dropped = [op for op in mine if not op.posted]
        for op in dropped:
            if op.ready is not None:
                op.ready.synchronize()
            self._finish(op)
        if posted:
            handles = {id(op.handle) for op in mine if op.posted}
            for ops in self._batches([op for op in self.ops if op.posted and id(op.handle) in handles]):
                self.transport.cancel(ops[0].handle)
                for op in ops:
                    self._finish(op)
                dropped += ops
        return dropped

    @staticmethod
    def _batches(ops: list[LayerOp]) -> list[list[LayerOp]]:
        """Posted ops grouped by the write (handle) they share, oldest first."""
        groups: dict[int, list[LayerOp]] = {}
        for op in ops:
            groups.setdefault(id(op.handle), []).append(op)
        return list(groups.values())

    def _note(self, what: str, op: LayerOp) -> None:
        if self.trace is not None:
            self.trace.append((time.perf_counter(), what, op.request_id, op.layer))

    def _finish(self, op: LayerOp) -> None:
        self.ops.remove(op)
        self.ring.release(op.slot)
