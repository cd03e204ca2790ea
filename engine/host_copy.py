"""Host-to-device copies of a step's index arrays (token ids, positions, slot_mapping, block_table, the
sampler's per-row values) that never wait for the kernels already queued.

A copy from pageable host memory to the device synchronizes the stream before it starts (CUDA runtime,
"API synchronization behavior": https://docs.nvidia.com/cuda/cuda-runtime-api/api-sync-behavior.html):
each ``tensor.to("cuda")`` of a freshly built array would wait until the GPU has run everything queued
before it. ``host_to_device`` stages the values in pinned memory instead (torch's caching host allocator,
which does not hand a pinned block out again before the copies reading it have completed) and copies
asynchronously, so the host keeps launching while the GPU works. Off CUDA it is a plain conversion.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def host_to_device(values: np.ndarray | Sequence[int] | Sequence[float] | Sequence[Sequence[int]],
                   dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``values`` as a ``dtype`` tensor on ``device``.

    Args:
        values: a numpy array or (nested) Python sequence of numbers, any shape torch.tensor accepts.
        dtype: the result's dtype (an array of another dtype is converted on the host).
        device: where the tensor goes; on CUDA through pinned memory and an asynchronous copy, which
            the caller's later kernels on the current stream are ordered after.

    Returns:
        A tensor of ``values``' shape. On the CPU it may share memory with a numpy ``values`` of the same
        dtype; the caller must not modify the array afterwards.

    Raises:
        TypeError / ValueError: from ``torch.tensor`` or ``torch.from_numpy`` for values they refuse.
    """
    cuda = device.type == "cuda"
    if not isinstance(values, np.ndarray):
        host = torch.tensor(values, dtype=dtype, pin_memory=cuda)
    else:
        host = torch.from_numpy(values)
        if host.dtype != dtype:
            host = host.to(dtype)
        if cuda:
            host = host.pin_memory()
    return host.to(device, non_blocking=True) if cuda else host.to(device)
