"""Reusable CUDA events for KVSender.send_layer (the forward pass thread's per-layer cost).

send_layer records an event on the caller's current stream so that the write of a layer starts only
after its attention stored the KV. Creating a `torch.cuda.Event` per call costs a cudaEventCreate (and
a destroy when it is collected) on the forward pass thread; the pool hands out events that the sender
loop gave back once nothing waits on them any more: a direct layer's event after its write was posted
or dropped, a staged layer's after its gather was queued behind it (cudaStreamWaitEvent waits for the
record current at the time of the call, so a later re-record is safe: CUDA Runtime API,
cudaStreamWaitEvent / cudaEventRecord). Taking and giving back are single deque operations (atomic in
CPython), so the two threads need no lock.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import torch


class EventPool:
    """Events recorded on the current stream of CUDA device `device` (an index), reused.

    factory/current_stream: how to make an event and find the stream to record on (tests pass fakes);
    limit: events kept for reuse at most (more are left to the garbage collector). Raises ValueError
    if limit < 0.
    """

    def __init__(self, device: int, factory: Callable[[], Any] | None = None,
                 current_stream: Callable[[int], Any] | None = None, limit: int = 256) -> None:
        if limit < 0:
            raise ValueError(f"limit must be >= 0, got {limit}")
        self.device = device
        self._factory = factory or torch.cuda.Event
        self._stream = current_stream or torch.cuda.current_stream
        self._free: deque[Any] = deque()
        self._limit = limit
        self.created = 0  # events made so far (tests, stats)

    def record(self) -> Any:
        """An event recorded now on the device's current stream (any thread)."""
        try:
            event = self._free.pop()
        except IndexError:
            event = self._factory()
            self.created += 1
        event.record(self._stream(self.device))
        return event

    def give_back(self, event: Any) -> None:
        """Return an event nothing waits on any more (sender loop thread); None is ignored."""
        if event is not None and len(self._free) < self._limit:
            self._free.append(event)

    @property
    def free(self) -> int:
        """Events ready for reuse."""
        return len(self._free)
