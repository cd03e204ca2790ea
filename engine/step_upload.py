"""One host-to-device copy of an eager step's integer inputs.

An eager step (a prefill, a mixed step, a decode without CUDA graphs) needs ``input_ids``,
``position_ids``, the logit rows and the attention metadata on the device: seven small arrays. Copied one
by one from pageable memory, each ``.to(device)`` is a synchronous ``cudaMemcpy`` through the driver's
staging buffer, and the GPU waits for all of them before the step's first kernel. ``StepUpload`` lays
the arrays out in one pinned byte buffer and sends it with one asynchronous copy; the device tensors are
views of the copied bytes (the same scheme as the decode graphs' ``StaticDecodeInputs`` and vLLM's
persistent input batch, ``vllm/v1/worker/gpu_input_batch.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

_ALIGN = 64  # bytes between arrays in the buffer: every dtype's view starts aligned
_TORCH_DTYPES = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32}


class StepUpload:
    """Copies a list of numpy arrays to ``device`` in one transfer.

    On CUDA two pinned staging buffers alternate; one is written again only after the CUDA event of its
    previous copy has completed, so a copy still in flight is never overwritten. A buffer grows (to the
    next power of two bytes) when a step needs more. On CPU the arrays are wrapped, not copied.

    Args:
        device: where the tensors go.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._cuda = device.type == "cuda"
        self._stages: list[torch.Tensor] = [torch.empty(0, dtype=torch.uint8) for _ in range(2)]
        self._events: list[torch.cuda.Event | None] = [None, None]
        self._turn = 0

    def __call__(self, arrays: Sequence[np.ndarray]) -> list[torch.Tensor]:
        """Tensors on ``device`` equal to ``arrays`` (same dtypes and shapes), in order.

        Args:
            arrays: int64 or int32 numpy arrays, any shape; the caller must not change them until the
                step has run (on CPU the tensors share their memory).

        Returns:
            One tensor per array; on CUDA views of one device byte buffer, ready in stream order (the
            copy is enqueued on the current stream before anything the caller enqueues next).

        Raises:
            ValueError: an array of another dtype.
        """
        for a in arrays:
            if a.dtype not in _TORCH_DTYPES:
                raise ValueError(f"StepUpload sends int64 and int32 arrays, not {a.dtype}")
        if not self._cuda:
            return [torch.from_numpy(np.ascontiguousarray(a)) for a in arrays]
        offsets, total = [], 0
        for a in arrays:
            offsets.append(total)
            total += -(-a.nbytes // _ALIGN) * _ALIGN
        self._turn ^= 1
        event = self._events[self._turn]
        if event is not None:
            event.synchronize()
        stage = self._stages[self._turn]
        if stage.numel() < total:
            stage = torch.empty(1 << max(total - 1, 1).bit_length(), dtype=torch.uint8, pin_memory=True)
            self._stages[self._turn] = stage
        raw = stage.numpy()
        for a, off in zip(arrays, offsets, strict=True):
            raw[off:off + a.nbytes] = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
        dev = torch.empty(max(total, 1), dtype=torch.uint8, device=self.device)
        dev[:total].copy_(stage[:total], non_blocking=True)
        if event is None:
            event = self._events[self._turn] = torch.cuda.Event()
        event.record()
        return [dev[off:off + a.nbytes].view(_TORCH_DTYPES[a.dtype]).view(a.shape)
                for a, off in zip(arrays, offsets, strict=True)]
