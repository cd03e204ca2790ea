"""Time GPU work as a decode step runs it: captured once in a CUDA graph, then replayed (not a test).

Method as PyTorch's "CUDA Graphs" notes (https://pytorch.org/docs/stable/notes/cuda.html#cuda-graphs):
capture, one replay to warm up, then ``replays`` replays between two timing events, so Python launch cost
is not counted.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def replay_seconds(work: Callable[[], object], replays: int) -> float:
    """Seconds per replay of ``work()`` captured in one CUDA graph on the current device (``work`` must
    have run once outside the capture: Triton compiles, cuBLAS loads its kernels). Raises ValueError for
    ``replays`` < 1, and whatever CUDA raises if ``work`` is not capturable."""
    if replays < 1:
        raise ValueError(f"replays must be >= 1, got {replays}")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        work()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / replays
