"""cuDNN's paged prefill attention (engine/ops/cudnn_paged_prefill.py): buckets and per-step inputs (CPU),
and on a Hopper GPU with the cuDNN frontend its output against the plain-torch reference, its determinism,
the triton backend's dispatch and the warm-up."""

from __future__ import annotations

import importlib
import importlib.util
import logging
import math
import types

import pytest
import torch

from engine.ops.cudnn_paged_prefill import (
    CUDNN_PAGED_MIN_KV,
    cudnn_paged_prefill,
    paged_graph_key,
    paged_prefill_inputs,
    paged_prefill_usable,
    warm_paged_prefill_graphs,
)
from engine.ops.paged_prefill import paged_prefill_attention_reference

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)
FRONTEND = importlib.util.find_spec("cudnn") is not None
gpu = pytest.mark.skipif(not (HOPPER and FRONTEND), reason="cuDNN frontend on a Hopper GPU")


def test_bucket_rounds_counts_and_lengths_up_to_powers_of_two() -> None:
    q = torch.zeros(5, 8, 64, dtype=torch.bfloat16)
    k_cache = torch.zeros(40, 16, 2, 64, dtype=torch.bfloat16)
    key = paged_graph_key(q, k_cache, 3, 100, 2049)
    assert (key.batch, key.max_query_len, key.max_seq_len) == (4, 128, 4096)
    assert (key.heads, key.kv_heads, key.head_dim, key.num_blocks, key.block_size) == (8, 2, 64, 40, 16)
    assert key.cache_strides == k_cache.stride()
    exact = paged_graph_key(q, k_cache, 4, 512, 4096)
    assert (exact.batch, exact.max_query_len, exact.max_seq_len) == (4, 512, 4096)
    small = paged_graph_key(q, k_cache, 1, 1, 3)
    assert (small.batch, small.max_query_len, small.max_seq_len) == (1, 128, 16)  # floors: 128 rows, a page


def test_step_inputs_skip_the_decode_rows_and_pad_the_bucket() -> None:
    """A decode row, then prefill sequences of 9 and 11 tokens: offsets relative to the first prefill
    token in elements (rows of H x D), lengths 0 and empty page rows past the step's sequences."""
    heads, dim, bs = 4, 8, 16
    q = torch.zeros(21, heads, dim, dtype=torch.bfloat16)
    k_cache = torch.zeros(64, bs, 2, dim, dtype=torch.bfloat16)
    block_tables = torch.tensor([[1, 0, 0], [2, 3, 4], [5, 6, 7]], dtype=torch.int32)
    seq_lens = torch.tensor([9, 40, 35], dtype=torch.int32)
    query_start_loc = torch.tensor([0, 1, 10, 21], dtype=torch.int32)
    key = paged_graph_key(q, k_cache, 4, 11, 40)  # a bucket of 4 sequences, 64 tokens of KV: 4 pages
    inputs = paged_prefill_inputs(key, block_tables, seq_lens, query_start_loc, 1, 1, 0.125)
    row = heads * dim
    assert inputs.q_offsets.flatten().tolist() == [0, 9 * row, 20 * row, 20 * row, 20 * row]
    assert torch.equal(inputs.o_offsets, inputs.q_offsets)
    assert inputs.seq_len_q.flatten().tolist() == [9, 11, 0, 0]
    assert inputs.seq_len_kv.flatten().tolist() == [40, 35, 0, 0]
    assert inputs.page_table.shape == (4, 1, 4, 1)
    assert inputs.page_table[:, 0, :, 0].tolist() == [[2, 3, 4, 0], [5, 6, 7, 0], [0] * 4, [0] * 4]
    assert inputs.scale.flatten().tolist() == [0.125] and inputs.scale.device.type == "cpu"
    with pytest.raises(ValueError, match="do not fit"):
        paged_prefill_inputs(paged_graph_key(q, k_cache, 1, 11, 40), block_tables, seq_lens, query_start_loc,
                             1, 1, 0.125)


def test_bucket_pages_cover_the_kv_for_any_block_size() -> None:
    """A block size that does not divide the bucket's KV length: the page table is rounded up, so a
    step's block table (ceil(4096 / 24) = 171 pages) fits."""
    q = torch.zeros(5, 8, 64, dtype=torch.bfloat16)
    k_cache = torch.zeros(400, 24, 2, 64, dtype=torch.bfloat16)
    key = paged_graph_key(q, k_cache, 1, 5, 4096)
    assert key.pages == 171
    tables = torch.arange(171, dtype=torch.int32).view(1, 171)
    inputs = paged_prefill_inputs(key, tables, torch.tensor([4096], dtype=torch.int32),
                                  torch.tensor([0, 5], dtype=torch.int32), 0, 0, 0.125)
    assert torch.equal(inputs.page_table.view(1, 171), tables)


def test_not_usable_off_a_gpu() -> None:
    q = torch.zeros(3, 8, 64, dtype=torch.bfloat16)
    k_cache = torch.zeros(40, 16, 2, 64, dtype=torch.bfloat16)
    assert not paged_prefill_usable(q, k_cache, k_cache, 4 * CUDNN_PAGED_MIN_KV)
    assert warm_paged_prefill_graphs(q[:1], k_cache, 8, 2048, 8192) == 0


@pytest.mark.parametrize("cudnn_runs", [True, False])
def test_backend_builds_the_inputs_once_per_step_and_falls_back(monkeypatch: pytest.MonkeyPatch,
                                                                 cudnn_runs: bool) -> None:
    """The triton backend's dispatch with the cuDNN call replaced (on the GPU where there is one, else on
    the CPU through the Triton interpreter): a decode row then a prefill sequence, two layers of one step.
    The step's inputs are built once and handed to both layers, the prefill rows start after the decode
    row; where cuDNN refuses (the call returns False) the Triton kernel's output is returned, bit for bit
    the output with the path switched off."""
    import engine.attention.triton_backend as tb
    from engine.attention.metadata import build_attention_metadata
    from engine.kv_cache import KVCachePool

    built: list[object] = []
    calls: list[tuple[int, int]] = []

    def inputs(*args: object) -> object:
        result = paged_prefill_inputs(*args)  # type: ignore[arg-type]
        built.append(result)
        return result

    def fake(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, step_inputs: object,
             out: torch.Tensor, first_token: int) -> bool:
        calls.append((id(step_inputs), first_token))
        if cudnn_runs:
            out[first_token:] = 7.0
        return cudnn_runs

    monkeypatch.setattr(tb, "paged_prefill_usable", lambda *args: True)
    monkeypatch.setattr(tb, "paged_prefill_inputs", inputs)
    monkeypatch.setattr(tb, "cudnn_paged_prefill", fake)
    gen = torch.Generator().manual_seed(6)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    h, hkv, d, bs = 4, 2, 16, 16
    pool = KVCachePool(num_layers=2, num_blocks=12, block_size=bs, num_kv_heads=hkv, head_dim=d,
                       dtype=torch.float32, device=device)
    meta = build_attention_metadata([[0, 1], [2, 3, 4]], [20, 30], [1, 9], bs, device)
    q, k, v = (torch.randn(10, x, d, generator=gen).to(device) for x in (h, hkv, hkv))
    backend = tb.TritonAttentionBackend()
    scale = d ** -0.5
    outs = [backend.forward(layer, q.clone(), k.clone(), v.clone(), pool, meta, scale) for layer in (0, 1)]
    assert len(built) == 1 and calls == [(id(built[0]), 1)] * 2
    backend.cudnn_paged_prefill = False
    off = backend.forward(1, q.clone(), k.clone(), v.clone(), pool, meta, d ** -0.5)
    assert len(calls) == 2  # switched off: not asked
    assert torch.equal(outs[1][:1], off[:1])  # the decode row comes from the decode kernel either way
    if cudnn_runs:
        assert bool((outs[1][1:] == 7.0).all())
    else:
        assert torch.equal(outs[1], off)
    backend.cudnn_paged_prefill = True
    backend.forward(0, q.clone(), k.clone(), v.clone(), pool, build_attention_metadata(
        [[0, 1], [2, 3, 4]], [20, 30], [1, 9], bs, device), d ** -0.5)
    assert len(built) == 2  # a new step's metadata: its own inputs


def _paged_case(lens: list[tuple[int, int]], heads: int = 32, kv_heads: int = 8, dim: int = 128, bs: int = 16,
                seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Random q and caches for sequences of (new tokens, KV tokens), each sequence's KV in scattered
    blocks. Returns q, k_cache, v_cache, block_tables, seq_lens,
    query_start_loc."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    pages = [math.ceil(kv / bs) for _, kv in lens]
    num_blocks = sum(pages) + 3
    perm = torch.randperm(num_blocks, generator=gen, device="cuda").to(torch.int32)
    tables = torch.zeros(len(lens), max(pages), dtype=torch.int32, device="cuda")
    at = 0
    for i, n in enumerate(pages):
        tables[i, :n] = perm[at:at + n]
        at += n
    k_cache, v_cache = (torch.randn(num_blocks, bs, kv_heads, dim, generator=gen, device="cuda")
                        .to(torch.bfloat16) for _ in range(2))
    starts = [0]
    for new, _ in lens:
        starts.append(starts[-1] + new)
    q = torch.randn(starts[-1], heads, dim, generator=gen, device="cuda").to(torch.bfloat16)
    seq_lens = torch.tensor([kv for _, kv in lens], dtype=torch.int32, device="cuda")
    return q, k_cache, v_cache, tables, seq_lens, torch.tensor(starts, dtype=torch.int32, device="cuda")


@gpu
@pytest.mark.parametrize("lens,decodes", [
    ([(37, 2100)], 0),
    ([(100, 2500), (64, 64), (5, 3000)], 0),  # uneven lengths, one sequence without cached context
    ([(1, 2701), (1, 2600), (200, 2700)], 2),  # decode rows first: only the prefill rows are written
    ([(300, 300), (700, 4100)], 0),
])
def test_matches_the_reference_and_repeats_its_bits(lens: list[tuple[int, int]], decodes: int) -> None:
    q, k_cache, v_cache, tables, seq_lens, starts = _paged_case(lens)
    scale = 128 ** -0.5
    prefill = lens[decodes:]
    key = paged_graph_key(q, k_cache, len(prefill), max(n for n, _ in prefill), max(kv for _, kv in lens))
    inputs = paged_prefill_inputs(key, tables, seq_lens, starts, decodes, decodes, scale)
    out = torch.zeros_like(q)
    assert cudnn_paged_prefill(q, k_cache, v_cache, inputs, out, decodes)
    ref = paged_prefill_attention_reference(q, k_cache, v_cache, tables, seq_lens, starts,
                                            max(n for n, _ in lens), max(kv for _, kv in lens), scale)
    torch.testing.assert_close(out[decodes:].float(), ref[decodes:].float(), rtol=2e-2, atol=2e-2)
    assert bool((out[:decodes] == 0).all())
    again = torch.zeros_like(q)
    cudnn_paged_prefill(q, k_cache, v_cache, inputs, again, decodes)
    assert torch.equal(out, again)


@gpu
def test_queries_that_are_a_view_of_a_packed_qkv_buffer() -> None:
    q, k_cache, v_cache, tables, seq_lens, starts = _paged_case([(500, 3100)], seed=4)
    packed = torch.randn(q.shape[0], 32 + 16, 128, device="cuda").to(torch.bfloat16)
    packed[:, :32] = q
    key = paged_graph_key(q, k_cache, 1, 500, 3100)
    inputs = paged_prefill_inputs(key, tables, seq_lens, starts, 0, 0, 128 ** -0.5)
    view_out, out = torch.zeros_like(q), torch.zeros_like(q)
    assert cudnn_paged_prefill(packed[:, :32], k_cache, v_cache, inputs, view_out, 0)
    assert cudnn_paged_prefill(q, k_cache, v_cache, inputs, out, 0)
    assert torch.equal(view_out, out) and bool(out.abs().sum() > 0)


@gpu
def test_triton_backend_takes_cudnn_over_a_long_kv_and_the_triton_kernel_below() -> None:
    """Backend ``forward`` of 300 new tokens after 2000 cached ones (KV 2300 >= CUDNN_PAGED_MIN_KV): the
    cuDNN output with the switch on, the Triton kernel's off, close to each other; after 1000 cached
    ones both settings give the Triton kernel's bits."""
    from engine.attention.metadata import build_attention_metadata
    from engine.attention.triton_backend import TritonAttentionBackend
    from engine.kv_cache import KVCachePool

    gen = torch.Generator().manual_seed(5)
    h, hkv, d, bs = 32, 8, 128, 16
    for cached, takes_cudnn in ((2000, True), (1000, False)):
        new = 300
        total = cached + new
        pool = KVCachePool(num_layers=1, num_blocks=total // bs + 4, block_size=bs, num_kv_heads=hkv,
                           head_dim=d, dtype=torch.bfloat16, device=torch.device("cuda"))
        pool.k_cache(0).normal_()
        pool.v_cache(0).normal_()
        meta = build_attention_metadata([list(range(math.ceil(total / bs)))], [cached], [new], bs, "cuda")
        q, k, v = (torch.randn(new, x, d, generator=gen).to("cuda", torch.bfloat16) for x in (h, hkv, hkv))
        backend = TritonAttentionBackend()
        backend.set_step_limits(2048, 8192)
        on = backend.forward(0, q.clone(), k.clone(), v.clone(), pool, meta, d ** -0.5)
        backend.cudnn_paged_prefill = False
        off = backend.forward(0, q.clone(), k.clone(), v.clone(), pool, meta, d ** -0.5)
        assert torch.equal(on, off) != takes_cudnn
        torch.testing.assert_close(on.float(), off.float(), rtol=2e-2, atol=2e-2)


@gpu
def test_warm_up_builds_one_graph_per_sequence_count_bucket() -> None:
    q = torch.zeros(1, 8, 128, dtype=torch.bfloat16, device="cuda")
    k_cache = torch.zeros(600, 16, 2, 128, dtype=torch.bfloat16, device="cuda")
    assert warm_paged_prefill_graphs(q, k_cache, 5, 2048, 8192) == 4  # 1, 2, 4, 8 sequences
    assert warm_paged_prefill_graphs(q, k_cache, 5, 2048, CUDNN_PAGED_MIN_KV - 1) == 0  # no KV that long


def test_a_hopper_worker_without_the_frontend_is_told(monkeypatch: pytest.MonkeyPatch,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    """Where only the frontend package keeps the paged cuDNN path off (a Hopper GPU, a bf16 cache), the
    warm-up builds nothing and says so once, naming the package; off a GPU, with an FP8 cache or under the
    Triton interpreter nothing is said."""
    module = importlib.import_module("engine.ops.cudnn_paged_prefill")
    monkeypatch.setattr(module, "frontend_available", lambda: False)
    monkeypatch.setattr(module, "_hopper", lambda index: True)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    gpu = torch.device("cuda", 0)
    assert module.frontend_missing_on(gpu, torch.bfloat16, torch.bfloat16)
    assert not module.frontend_missing_on(torch.device("cpu"), torch.bfloat16, torch.bfloat16)
    assert not module.frontend_missing_on(gpu, torch.bfloat16, torch.float8_e4m3fn)
    monkeypatch.setattr(module, "_hopper", lambda index: False)
    assert not module.frontend_missing_on(gpu, torch.bfloat16, torch.bfloat16)
    monkeypatch.setattr(module, "_hopper", lambda index: True)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not module.frontend_missing_on(gpu, torch.bfloat16, torch.bfloat16)
    monkeypatch.delenv("TRITON_INTERPRET")
    monkeypatch.setattr(module, "frontend_available", lambda: True)
    assert not module.frontend_missing_on(gpu, torch.bfloat16, torch.bfloat16)

    monkeypatch.setattr(module, "frontend_available", lambda: False)
    # what the warm-up reads of its probes before this branch returns: device and dtype
    probe = types.SimpleNamespace(device=gpu, dtype=torch.bfloat16)
    k_cache = types.SimpleNamespace(dtype=torch.bfloat16)
    with caplog.at_level(logging.WARNING, logger="pdserve.engine"):
        assert warm_paged_prefill_graphs(probe, k_cache, 8, 2048, 8192) == 0
        assert warm_paged_prefill_graphs(probe, k_cache, 8, 2048, CUDNN_PAGED_MIN_KV - 1) == 0
        # a tensor parallel rank past the first: the same answer, nothing logged (rank 0 says it)
        assert warm_paged_prefill_graphs(probe, k_cache, 8, 2048, 8192, warn_missing=False) == 0
    warnings = [r.getMessage() for r in caplog.records if "cudnn_frontend_missing" in r.getMessage()]
    assert len(warnings) == 1 and "nvidia-cudnn-frontend" in warnings[0] and "pdserve[gpu]" in warnings[0]
