"""``engine.models.loader.resolve_device``: the device a worker places its model on, and the one-line error
for a device that is not there (CUDA state patched, so the same cases run with and without a GPU)."""

from __future__ import annotations

import pytest
import torch

from engine.models.loader import resolve_device


@pytest.mark.parametrize(("device", "visible", "want"), [
    ("cpu", 0, "cpu"), ("auto", 0, "cpu"), ("auto", 1, "cuda"), ("cuda", 1, "cuda"), ("cuda:1", 2, "cuda:1"),
    ("tpu", 1, "device must be auto, cpu, cuda or cuda:N, got 'tpu'"),
    ("cuda:x", 1, "device must be auto, cpu, cuda or cuda:N, got 'cuda:x'"),
    ("cuda", 0, "device 'cuda': no CUDA device is visible"),
    ("cuda:2", 2, r"device 'cuda:2': 2 CUDA device\(s\) visible, cuda:0..cuda:1"),
])
def test_resolve_device_names_a_device_that_is_not_there(device: str, visible: int, want: str,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker given ``--device cuda`` on a machine without CUDA died with a traceback (``Torch not
    compiled with CUDA enabled``); now its start-up error is this one line (workers/boot.py)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: visible > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
    if want.startswith("device"):
        with pytest.raises(ValueError, match=want):
            resolve_device(device)
    else:
        assert resolve_device(device) == torch.device(want)
