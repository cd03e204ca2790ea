"""StepUpload: an eager step's integer arrays reach the device equal, in one copy (CUDA) or wrapped
(CPU); a staging buffer is not overwritten while its copy may be in flight."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.step_upload import StepUpload


def _arrays(seed: int, tokens: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 1 << 40, tokens, dtype=np.int64),
            rng.integers(0, 1 << 30, 3, dtype=np.int32),           # an odd byte count: 12
            np.zeros(0, dtype=np.int64),                           # empty (no sample rows)
            rng.integers(0, 1 << 30, (5, 7), dtype=np.int32)]      # a block table


def _check(upload: StepUpload, arrays: list[np.ndarray], got: list[torch.Tensor]) -> None:
    assert len(got) == len(arrays)
    for a, t in zip(arrays, got, strict=True):
        assert t.device.type == upload.device.type
        assert t.dtype == {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32}[a.dtype]
        assert tuple(t.shape) == a.shape
        assert np.array_equal(t.cpu().numpy(), a)


def test_cpu_arrays_arrive_equal() -> None:
    upload = StepUpload(torch.device("cpu"))
    arrays = _arrays(0, 100)
    _check(upload, arrays, upload(arrays))


def test_other_dtypes_are_refused() -> None:
    with pytest.raises(ValueError, match="float32"):
        StepUpload(torch.device("cpu"))([np.zeros(3, dtype=np.float32)])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_uploads_in_flight_keep_their_values() -> None:
    """Several uploads enqueued behind a long kernel (the copies wait for it): each keeps its own values,
    through a buffer growth and the alternation of the two staging buffers."""
    upload = StepUpload(torch.device("cuda"))
    sent: list[tuple[list[np.ndarray], list[torch.Tensor]]] = []
    busy = torch.randn(4096, 4096, device="cuda")
    for i, tokens in enumerate((10, 8192, 50, 8192, 3)):
        for _ in range(4):
            busy = busy @ busy / 64.0  # keeps the stream busy while the host writes the next stage
        arrays = _arrays(i, tokens)
        sent.append((arrays, upload(arrays)))
    torch.cuda.synchronize()
    for arrays, got in sent:
        _check(upload, arrays, got)
