"""The row-wise argmax kernels (engine/ops/argmax.py) against ``torch.argmax``: equal indices for every
dtype, vocabulary sizes around the chunk width, ties within and across chunks, infinities and NaN. On
CPU through Triton's interpreter; compiled on a GPU."""

from __future__ import annotations

import pytest
import torch

from engine.ops.argmax import CHUNK, argmax_rows, argmax_rows_kernel, argmax_rows_reference, takes_kernel

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab", [1, 7, CHUNK, CHUNK + 1, 2 * CHUNK + 517])
@pytest.mark.parametrize("rows", [1, 3])  # one row: the batch-1 decode launch (PDL on a GPU)
def test_random_rows_match_torch(dtype, vocab, rows):
    gen = torch.Generator().manual_seed(vocab)
    logits = (torch.randn(rows, vocab, generator=gen) * 4).to(dtype).to(DEVICE)
    got = argmax_rows_kernel(logits)
    assert got.dtype == torch.int64 and got.shape == (rows,)
    assert torch.equal(got, argmax_rows_reference(logits))


def test_ties_nan_and_infinities_pick_what_torch_picks():
    v = 3 * CHUNK + 5
    rows = torch.zeros(9, v)
    rows[0] = 1.0  # all equal: index 0
    rows[1, [CHUNK + 3, 2, 3 * CHUNK + 1]] = 5.0  # the same maximum in three chunks: the lowest index
    rows[2, [CHUNK + 9, 2 * CHUNK]] = 7.0  # tie across two later chunks
    rows[3] = float("-inf")  # every entry -inf: index 0
    rows[4, [CHUNK + 4, 3 * CHUNK + 2]] = float("inf")
    rows[5, 2 * CHUNK + 1] = float("nan")  # NaN beats any number, +inf included
    rows[5, 4] = float("inf")
    rows[6, [3 * CHUNK + 4, CHUNK + 11]] = float("nan")  # the first NaN
    rows[7, v - 1] = 3.0  # the very last entry, in the partial chunk
    rows[8, CHUNK - 1] = -1.0  # a negative row with its maximum at the end of the first chunk
    rows[8] -= 2.0
    rows[8, CHUNK - 1] = -1.5
    want = [0, 2, CHUNK + 9, 0, CHUNK + 4, 2 * CHUNK + 1, CHUNK + 11, v - 1, CHUNK - 1]
    for dtype in (torch.float32, torch.bfloat16):
        logits = rows.to(dtype).to(DEVICE)
        assert argmax_rows_reference(logits).tolist() == want  # what torch does, written out
        assert argmax_rows_kernel(logits).tolist() == want


def test_a_view_with_a_row_stride_and_an_empty_batch():
    wide = torch.randn(4, 3 * CHUNK, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    view = wide[:, : 2 * CHUNK + 3]  # rows 3 * CHUNK apart
    assert torch.equal(argmax_rows_kernel(view), view.argmax(dim=-1))
    assert argmax_rows_kernel(wide[:0]).shape == (0,)


def test_argmax_rows_takes_the_kernel_only_where_it_runs(monkeypatch):
    """CUDA tensors it can run go to the kernels; a strided last dim, float64, too many rows, a CPU tensor
    or the interpreter go to torch (checked on stand-ins for CUDA tensors: only their metadata is read)."""
    class Cuda:
        def __init__(self, shape=(2, 1000), stride=(1000, 1), dtype=torch.bfloat16):
            self.shape, self._stride, self.dtype, self.is_cuda = shape, stride, dtype, True

        def dim(self):
            return len(self.shape)

        def stride(self, i):
            return self._stride[i]

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert takes_kernel(Cuda()) and takes_kernel(Cuda(dtype=torch.float16))
    assert takes_kernel(Cuda((1, 7), (7, 1)))
    assert not takes_kernel(Cuda(stride=(1, 2)))
    assert not takes_kernel(Cuda(dtype=torch.float64))
    assert not takes_kernel(Cuda((70000, 10), (10, 1)))
    assert not takes_kernel(Cuda((5,), (1,)))
    assert not takes_kernel(torch.zeros(2, 3))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not takes_kernel(Cuda())
    logits = torch.randn(2, 1000, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    assert torch.equal(argmax_rows(logits), logits.argmax(dim=-1))


@pytest.mark.parametrize("bad,why", [
    (torch.zeros(5), "must be \\[B, V\\]"),
    (torch.zeros(4, 3).T, "contiguous last dim"),
    (torch.zeros(2, 3, dtype=torch.int64), "float32, bfloat16 or float16"),
    (torch.zeros(2, 3, dtype=torch.float64), "float32, bfloat16 or float16"),
    (torch.zeros(65536, 1), "at most 65535 rows"),
    (torch.zeros(2, 0), "1 <= V"),
])
def test_bad_inputs_are_refused(bad, why):
    with pytest.raises(ValueError, match=why):
        argmax_rows_kernel(bad)
