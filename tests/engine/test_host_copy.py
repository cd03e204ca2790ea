"""``engine.host_copy.host_to_device`` and the step inputs built with it: the values and dtypes on the CPU;
on a GPU, that preparing a step's inputs makes no copy from pageable memory (each such copy synchronizes
the stream, and the GPU idles while the host builds the next input)."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from engine.attention.metadata import build_attention_metadata
from engine.host_copy import host_to_device
from engine.model_runner import ModelRunner
from engine.step_batch import StepBatch

CUDA = torch.cuda.is_available()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_values_dtype_and_device(device: str) -> None:
    if device == "cuda" and not CUDA:
        pytest.skip("needs a CUDA device")
    dev = torch.device(device)
    cases: list[tuple[object, torch.dtype, list[object]]] = [
        (np.arange(5, dtype=np.int64) * 3, torch.int32, [0, 3, 6, 9, 12]),  # converted on the host
        (np.array([7, 8], dtype=np.int32), torch.int64, [7, 8]),
        ([1, 2, 3], torch.int64, [1, 2, 3]),
        ([[1, 2], [3, 4]], torch.int32, [[1, 2], [3, 4]]),
        ([0.5, -1.25], torch.float32, [0.5, -1.25]),
        ([], torch.int64, []),
    ]
    for values, dtype, expected in cases:
        out = host_to_device(values, dtype, dev)  # type: ignore[arg-type]
        assert out.dtype == dtype and out.device.type == device
        assert out.cpu().tolist() == expected


def _runner(device: str, block_size: int) -> ModelRunner:
    """A ``ModelRunner`` with only what ``_prepare_inputs`` reads (no model)."""
    fake = types.SimpleNamespace(device=torch.device(device),
                                 kv_cache=types.SimpleNamespace(block_size=block_size))
    return fake  # type: ignore[return-value]


def _mixed_batch() -> StepBatch:
    """Two decode rows, a 40-token chunk from position 16, a 3-token chunk from 0 that does not sample."""
    return StepBatch(token_ids=[[11], [12], list(range(100, 140)), [7, 8, 9]], starts=[5, 30, 16, 0],
                     block_tables=[[0], [1, 2], [3, 4, 5, 6], [7]], samples=[True, True, True, False],
                     prompt_rows=[50])


def test_step_inputs_of_a_mixed_batch() -> None:
    """Token ids packed in order, each row's position its sequence's start plus its offset, the sampling
    rows the last row of each sampling sequence, then the prompt rows."""
    batch = _mixed_batch()
    ids, positions, rows, meta = ModelRunner._prepare_inputs(_runner("cpu", 16), batch, None)
    assert ids.tolist() == [[11, 12, *range(100, 140), 7, 8, 9]]
    assert positions.tolist() == [[5, 30, *range(16, 56), 0, 1, 2]]
    assert ids.dtype == positions.dtype == rows.dtype == torch.int64
    assert rows.tolist() == [0, 1, 41, 50]
    assert meta.num_decodes == 2 and meta.max_query_len == 40 and meta.max_seq_len == 56
    assert meta.slot_mapping[:2].tolist() == [5, 2 * 16 + 14]  # position 30: block table [1, 2]'s 2


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_step_inputs_copy_from_pinned_memory_only() -> None:
    """On CUDA, ``_prepare_inputs`` and ``build_attention_metadata`` copy from pinned memory only: the
    profiler sees pinned host-to-device copies and no pageable one; the values are those of the CPU."""
    from torch.profiler import ProfilerActivity, profile

    batch = _mixed_batch()
    cpu = ModelRunner._prepare_inputs(_runner("cpu", 16), batch, None)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        gpu = ModelRunner._prepare_inputs(_runner("cuda", 16), batch, None)
        build_attention_metadata([[0, 1]], [3], [20], 16, "cuda")
        torch.cuda.synchronize()
    copies = [e.name for e in prof.events() if e.name.startswith("Memcpy HtoD")]
    assert copies and all("Pageable" not in name for name in copies), copies
    for a, b in zip(cpu[:3], gpu[:3], strict=True):
        assert torch.equal(a, b.cpu())
    assert torch.equal(cpu[3].slot_mapping, gpu[3].slot_mapping.cpu())
    assert torch.equal(cpu[3].block_tables, gpu[3].block_tables.cpu())
