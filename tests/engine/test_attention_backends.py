"""AttentionMetadata building, get_backend, and the torch/triton backends against a float64 softmax and
against each other (mixed decode + prefill batches, cached prefixes, chunked prefill, GQA). On CPU the
Triton backend runs through the interpreter over a subset of the shape grid (tests/engine/grid.py)."""

from __future__ import annotations

import itertools

import pytest
import torch

from engine.attention.backend import get_backend
from engine.attention.metadata import build_attention_metadata
from engine.attention.torch_backend import TorchAttentionBackend
from engine.attention.triton_backend import TritonAttentionBackend
from engine.kv_cache import KVCachePool
from tests.engine.grid import grid
from tests.engine.test_kernels import (
    DEVICE,
    TOL,
    assert_no_stray_writes,
    gpu_only,
    make_batch,
    naive_attention,
)

BACKENDS = [TorchAttentionBackend(), TritonAttentionBackend()]
MIXED = [(6, 1), (7, 1), (8, 1), (25, 1), (0, 9), (4, 12), (8, 8), (3, 1)]  # 4 decodes, then prefills


# ------------------------------------------------------------------------------------------- metadata
def test_build_attention_metadata_values() -> None:
    meta = build_attention_metadata([[4, 2], [7], [1, 3, 5]], [5, 0, 6], [1, 3, 4], block_size=4)
    # seq 0: pos 5 -> block 2 offset 1; seq 1: pos 0..2 in block 7; seq 2: pos 6..9 -> blocks 3,3,5,5
    assert meta.slot_mapping.tolist() == [9, 28, 29, 30, 14, 15, 20, 21]
    assert meta.slot_mapping.dtype == torch.int64
    assert meta.query_start_loc.tolist() == [0, 1, 4, 8] and meta.query_start_loc.dtype == torch.int32
    assert meta.seq_lens.tolist() == [6, 3, 10] and meta.seq_lens.dtype == torch.int32
    assert meta.block_tables.tolist() == [[4, 2, 0], [7, 0, 0], [1, 3, 5]]
    assert meta.block_tables.dtype == torch.int32
    assert (meta.num_decodes, meta.num_decode_tokens, meta.max_query_len, meta.max_seq_len) == (1, 1, 4, 10)
    assert (meta.num_seqs, meta.num_tokens) == (3, 8)


def test_num_decodes_counts_only_the_leading_single_token_queries() -> None:
    meta = build_attention_metadata([[0], [1], [2], [3]], [3, 2, 0, 1], [1, 1, 3, 1], block_size=4)
    assert meta.num_decodes == 2


@pytest.mark.parametrize(
    "tables,computed,qlens,match",
    [
        ([], [], [], "at least one"),
        ([[0]], [0, 1], [1], "length mismatch"),
        ([[0]], [0], [0], "query length"),
        ([[0]], [-1], [2], "num_computed_tokens"),
        ([[0]], [3], [2], "cannot hold 5 tokens"),
        ([[-2]], [0], [1], "negative block id"),
    ],
)
def test_build_attention_metadata_rejects_bad_input(tables, computed, qlens, match) -> None:
    with pytest.raises(ValueError, match=match):
        build_attention_metadata(tables, computed, qlens, block_size=4)


# ----------------------------------------------------------------------------------------- get_backend
def test_get_backend_selection(monkeypatch: pytest.MonkeyPatch) -> None:
    assert get_backend("auto", "cpu").name == "torch"
    assert get_backend("torch", "cpu").name == "torch"
    with pytest.raises(ValueError, match="unknown attention backend 'sdpa'"):
        get_backend("sdpa", "cpu")
    with pytest.raises(ValueError, match="flash_attn backend needs CUDA"):
        get_backend("flash_attn", "cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="triton backend needs CUDA"):
        get_backend("triton", "cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert get_backend("triton", "cpu").name == "triton"


@gpu_only
@pytest.mark.gpu
def test_get_backend_auto_on_cuda() -> None:
    from engine.attention.backend import flash_attn_available

    assert get_backend("auto", "cuda").name == ("flash_attn" if flash_attn_available() else "triton")


# ---------------------------------------------------------------------------------------------- forward
def _forward(backend, batch, scale: float, layer: int = 0) -> torch.Tensor:
    return backend.forward(layer, batch.q, batch.k_new, batch.v_new, batch.pool, batch.meta, scale)


F32, F16 = torch.float32, torch.float16
SHAPES = [(4, 4, 64), (6, 2, 64), (4, 1, 128)]
TORCH, TRITON = BACKENDS
# the torch backend (no interpreter) over the whole grid everywhere; the Triton one over a subset on CPU
FORWARD_GRID = list(itertools.product([TORCH], [F32, F16], SHAPES)) + grid(
    list(itertools.product([TRITON], [F32, F16], SHAPES)),
    cpu=[(TRITON, F32, (6, 2, 64)), (TRITON, F16, (4, 4, 64)), (TRITON, F16, (4, 1, 128))])


@pytest.mark.parametrize(("backend", "dtype", "shape"), FORWARD_GRID,
                         ids=[f"{b.name}-{d}-{s}" for b, d, s in FORWARD_GRID])
def test_forward_mixed_batch_matches_float64_softmax(backend, dtype, shape):
    num_heads, num_kv_heads, head_dim = shape
    batch = make_batch(MIXED, num_heads, num_kv_heads, head_dim, 8, dtype, seed=1)
    assert batch.meta.num_decodes == 4
    scale = head_dim**-0.5
    out = _forward(backend, batch, scale)
    assert out.shape == batch.q.shape and out.dtype == dtype
    torch.testing.assert_close(out.double(), naive_attention(batch, scale), atol=TOL[dtype], rtol=TOL[dtype])
    assert_no_stray_writes(batch)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_and_torch_backends_agree(dtype: torch.dtype) -> None:
    outs, caches = [], []
    for backend in BACKENDS:
        batch = make_batch(MIXED, 9, 3, 64, 16, dtype, seed=2)  # SmolLM2's heads, block_size 16
        outs.append(_forward(backend, batch, 0.125))
        caches.append(batch.pool.kv_buffer)
    torch.testing.assert_close(outs[0], outs[1], atol=TOL[dtype], rtol=TOL[dtype])
    assert torch.equal(caches[0], caches[1])


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.name)
def test_chunked_prefill_then_decode_equals_one_shot(backend) -> None:
    """A prompt run as 3 chunks + 2 decode steps gives the rows of one 21-token causal pass."""
    torch.manual_seed(3)
    num_heads, num_kv_heads, head_dim, block_size = 4, 2, 64, 4
    q = torch.randn(21, num_heads, head_dim, device=DEVICE)
    k = torch.randn(21, num_kv_heads, head_dim, device=DEVICE)
    v = torch.randn(21, num_kv_heads, head_dim, device=DEVICE)
    table = [6, 1, 4, 0, 3, 7]  # 24 slots, scattered
    one_pool = KVCachePool(2, 8, block_size, num_kv_heads, head_dim, torch.float32, DEVICE)
    one_meta = build_attention_metadata([table], [0], [21], block_size, DEVICE)
    expected = backend.forward(1, q, k, v, one_pool, one_meta, 0.125)
    pool = KVCachePool(2, 8, block_size, num_kv_heads, head_dim, torch.float32, DEVICE)
    got, done = [], 0
    for n in (7, 5, 7, 1, 1):
        meta = build_attention_metadata([table], [done], [n], block_size, DEVICE)
        rows = slice(done, done + n)
        got.append(backend.forward(1, q[rows], k[rows], v[rows], pool, meta, 0.125))
        done += n
    torch.testing.assert_close(torch.cat(got), expected, atol=2e-5, rtol=2e-5)
    assert torch.equal(pool.kv_buffer, one_pool.kv_buffer)
    assert bool((pool.kv_buffer[0] == 0).all()), "layer 0 must be untouched"


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.name)
def test_layer_hook_runs_after_the_store(backend) -> None:
    batch = make_batch([(3, 1), (0, 5)], 2, 2, 64, 4, torch.float32)
    seen: list[tuple[int, bool]] = []

    def hook(layer: int) -> None:
        slots = batch.meta.slot_mapping
        stored = batch.pool.k_cache(layer).reshape(-1, 2, 64)[slots]
        seen.append((layer, torch.equal(stored, batch.k_new)))

    meta = build_attention_metadata(batch.meta.block_tables.tolist(), [3, 0], [1, 5], 4, DEVICE, hook)
    backend.forward(0, batch.q, batch.k_new, batch.v_new, batch.pool, meta, 0.125)
    assert seen == [(0, True)]


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.name)
def test_forward_rejects_bad_inputs(backend) -> None:
    batch = make_batch([(0, 3)], 4, 2, 64, 4, torch.float32)
    q, k, v, pool, meta = batch.q, batch.k_new, batch.v_new, batch.pool, batch.meta
    cases = [
        ((0, q.half(), k, v), "dtype"),
        ((0, q[:, :3], k, v), "multiple of num_kv_heads"),
        ((0, q[:2], k[:2], v[:2]), "token counts differ"),
        ((0, q, k[:, :1], v[:, :1]), "do not fit the cache"),
        ((5, q, k, v), "layer 5 out of range"),
        ((0, q, k, v[:, :, :32]), "differ"),
    ]
    before = pool.kv_buffer.clone()
    for (layer, qq, kk, vv), match in cases:
        with pytest.raises(ValueError, match=match):
            backend.forward(layer, qq, kk, vv, pool, meta, 0.125)
    assert torch.equal(pool.kv_buffer, before), "a rejected call must not touch the cache"


@gpu_only
@pytest.mark.gpu
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(32, 8, 128), (9, 3, 64)])
def test_backends_agree_bf16_gpu(num_heads: int, num_kv_heads: int, head_dim: int) -> None:
    specs = [(15, 1), (16, 1), (600, 1), (0, 15), (0, 17), (48, 200), (1000, 33)]
    outs = []
    for backend in BACKENDS:
        batch = make_batch(specs, num_heads, num_kv_heads, head_dim, 16, torch.bfloat16, seed=4)
        outs.append(_forward(backend, batch, head_dim**-0.5))
        assert_no_stray_writes(batch)
    torch.testing.assert_close(outs[0], outs[1], atol=2e-2, rtol=2e-2)
