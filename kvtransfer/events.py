"""Reusable CUDA events for KVSender.send_layer / send_layers (the forward pass thread's hand-off cost).

send_layer records an event on the caller's current stream so that the write of a layer starts only
after its attention stored the KV; send_layers records ONE event for all the layers it hands off.
Creating a `torch.cuda.Event` per call costs a cudaEventCreate (and a destroy when it is collected) on
the forward pass thread; the pool hands out events that the sender loop gave back once nothing waits on
them any more: a direct layer's event after its write completed or was dropped, a staged layer's after
its gather was queued behind it (cudaStreamWaitEvent waits for the record current at the time of the
call, so a later re-record is safe: CUDA Runtime API, cudaStreamWaitEvent / cudaEventRecord).

An event shared by several queued request-layers is handed out with `uses` = their number and goes
back to the free list only at the last of their give-backs. Taking (record) runs on the caller's thread,
giving back on the loop thread; each is a few single deque/dict operations on entries the other thread
does not touch at that moment (an event is either held or free), atomic in CPython: no lock.
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
        self._uses: dict[int, int] = {}  # id(event) → give-backs still due, for events handed out
        self._limit = limit
        self.created = 0  # events made so far (tests, stats)

    def record(self, uses: int = 1) -> Any:
        """An event recorded now on the device's current stream (any thread), to be given back `uses`
        times (once per queued request-layer that waits on it). Raises ValueError if uses < 1."""
        if uses < 1:
            raise ValueError(f"uses must be >= 1, got {uses}")
        try:
            event = self._free.pop()
        except IndexError:
            event = self._factory()
            self.created += 1
        event.record(self._stream(self.device))
        self._uses[id(event)] = uses
        return event

    def give_back(self, event: Any) -> None:
        """One user of `event` no longer waits on it (sender loop thread); at its last user it becomes
        reusable. None is ignored. Raises ValueError for an event given back more often than
        record() handed it out (it could otherwise be re-recorded while a layer still waits on it)."""
        if event is None:
            return
        key = id(event)
        left = self._uses.get(key, 0) - 1
        if left < 0:
            raise ValueError("event given back more often than it was handed out")
        if left:
            self._uses[key] = left
            return
        del self._uses[key]
        if len(self._free) < self._limit:
            self._free.append(event)

    @property
    def free(self) -> int:
        """Events ready for reuse."""
        return len(self._free)

    @property
    def held(self) -> int:
        """Events handed out and not yet given back by every user (leak checks)."""
        return len(self._uses)
