"""Posting a whole request's KV from the caller's thread (a mixin of KVSender): the hand-off fast path.

A `send_layers` hand-off of every layer of a request normally queues them for the sender loop, which
wakes, takes them up, and posts its pre-made write (send_path.py). On 2×H200 that hand-off cost ≈ 260
µs of the ≈ 1.75 ms a 4k-token request takes at 0.8 of a peer copy (docs/benchmarks/kv_transfer-h200.md,
stop 16): the loop thread wakes from its idle poll (on that VM a sleeping thread's first Python and CUDA
calls run many times slower), takes the 32 layers up one by one and only then calls NIXL's
`transfer()`. When the KV is already complete, nothing needs the loop: the caller posts the pre-made
write itself and only then wakes the loop, which learns of the write in flight while the data moves.

It does so only when all of this holds, and else queues the layers as before (returns False):

- the request is begun (Begin answered), direct, not terminal, and its whole write was pre-made
  (send_path._premake: one-sided transport, no checksum, max_inflight_layers >= num_layers);
- nothing is queued (FIFO with other hand-offs) and the pipeline has room for every layer;
- the caller's current stream on kv_buffer's device has no work pending (`torch.cuda.Stream.query`:
  every kernel it launched, the ones that stored this KV included, has completed), so no CUDA event
  needs to be waited for; on a CPU kv_buffer always;
- the data-path lock (`_data`) is free within STEP_WAIT_S: the loop holds it for every step and lets
  it go only while it waits (an idle poll or a nap), so a step in progress is never entered, only
  waited for (on 2×H200 a hand-off right after the Begin answer otherwise found the loop still in the
  step that read it, and queued). While a caller holds it no status can change: every status change
  of the sender runs on the loop thread inside a step. A loop that found it held when its wait ended
  waited for the post, however long (a starved caller thread): it reads its control socket again
  before its liveness check (send_wait._relock), or heartbeats left unread would count as silence.

Sources: the pre-made write is NIXL's `make_prepped_xfer` + `transfer()` (NIXL Python API, nixl_agent);
NIXL's UCX backend allows serialized calls from several threads (UCX thread mode SERIALIZED, which a
NIXL agent with one backend thread gets), and `_data` serializes them.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import TYPE_CHECKING, Any

import torch

from kvtransfer.api import KVLayout
from kvtransfer.endpoint import RequestState
from kvtransfer.pipeline import LayerPipeline

if TYPE_CHECKING:
    from kvtransfer.pipeline import LayerOp

STEP_WAIT_S = 1e-3  # longest wait (s) of a hand-off for the loop to end its step, before it queues


class PostNow:
    """Fast-path method of KVSender; the attributes below are KVSender's."""

    kv_buffer: torch.Tensor
    layout: KVLayout
    _pipe: LayerPipeline
    _lock: threading.Condition
    _data: threading.Lock
    _stop: threading.Event
    _requests: dict[str, RequestState]
    _queue: deque[Any]

    if TYPE_CHECKING:
        def _post(self, batch: list[tuple[LayerOp, RequestState]]) -> None: ...
        def _wake(self) -> None: ...
        def _mark(self, what: str, request_id: str) -> None: ...

    def _post_now(self, request_id: str) -> bool:
        """Post every layer of `request_id` (just marked sent by the hand-off) as its pre-made write, on
        this thread, if the module docstring's conditions hold; True if it did (or the post failed: the
        request is then FAILED by send_path._post, as on the loop), False if the caller must queue the
        layers. Raises nothing of its own."""
        ahead = self._requests.get(request_id)  # a look without the lock (checked again under it)
        if ahead is None or not ahead.extra.get("whole") or self._queue or not self._stream_idle():
            return False
        if not self._data.acquire(timeout=STEP_WAIT_S):  # a step this long: the loop takes them up
            return False
        try:
            if self._stop.is_set() or self._queue or self._pipe.capacity < self.layout.num_layers:
                return False
            with self._lock:
                st = self._requests.get(request_id)
                if (st is None or st.status.is_terminal or not st.extra["begun"]
                        or not st.extra.get("whole") or st.extra["runs"] is None):
                    return False
                st.extra["inflight"] += self.layout.num_layers
            src = st.extra["src"]
            n = self._pipe.start([(request_id, layer, src, None, True)
                                  for layer in range(self.layout.num_layers)])
            self._mark("handoff:now", request_id)
            self._post([(op, st) for op in self._pipe.ops[-n:]])
        finally:
            self._data.release()
        self._wake()  # the loop looks for the write's completion (and naps in its look-ahead)
        return True

    def _stream_idle(self) -> bool:
        """Whether every kernel the caller launched on its current stream of kv_buffer's device has
        completed (cudaStreamQuery); always True for a CPU kv_buffer."""
        if not self.kv_buffer.is_cuda:
            return True
        return bool(torch.cuda.current_stream(self.kv_buffer.device).query())
