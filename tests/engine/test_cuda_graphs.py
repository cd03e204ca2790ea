"""Decode CUDA graphs (engine/cuda_graphs.py) and the graph-capturable decode kernel.

CPU (Triton interpreter): bucketing, the static-buffer metadata against ``build_attention_metadata``,
padding rows (never written to the KV cache, never changing real rows), the decode kernel with a fixed
``num_splits`` and an oversized ``max_seq_len`` against the reference, and whole greedy/seeded generation
through the static-buffer path (uncaptured on CPU) against the eager path. GPU (``gpu`` mark, run by
scripts/gpu_tests.sh): graph replay against eager logits for several batch sizes, identical greedy
generation with and without graphs, and no host synchronisation inside a graph decode step.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from engine.attention.metadata import build_attention_metadata
from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.cuda_graphs import PAD_SLOT, DecodeCudaGraphs, StaticDecodeInputs, bucket_for, decode_buckets
from engine.engine_core import EngineCore
from engine.ops.paged_decode import paged_decode_attention, paged_decode_attention_reference
from engine.sampling_params import SamplingParams
from tests.engine.test_kernels import make_batch
from tests.engine.test_loader import save_tiny_model

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"  # CPU: Triton interpreter; CUDA: compiled kernels, graphs uncaptured


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model("LlamaForCausalLM", tmp_path_factory.mktemp("graphs") / "m", seed=3)


def _core(path: Path, device: str, enforce_eager: bool, max_num_seqs: int = 8) -> EngineCore:
    return EngineCore(EngineConfig(
        ModelConfig(str(path), dtype="float32", device=device, attention_backend="triton",
                    max_model_len=128, enforce_eager=enforce_eager),
        CacheConfig(block_size=4, num_blocks=160, enable_prefix_caching=False),
        SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=256),
    ))


def _generate(core: EngineCore, prompts: list[list[int]],
              params: list[SamplingParams]) -> dict[str, list[int]]:
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        core.add_request(f"r{i}", p, sp)
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    while core.has_unfinished():
        for out in core.step():
            tokens[out.request_id].append(out.token_id)
    core.check_no_leaks()
    return tokens


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 256) for _ in range(rng.randrange(1, 12))] for _ in range(n)]


def test_buckets_and_bucket_for():
    assert decode_buckets(1) == (1,)
    assert decode_buckets(8) == (1, 2, 4, 8)
    assert decode_buckets(12) == (1, 2, 4, 8, 12)
    assert decode_buckets(256)[-3:] == (64, 128, 256)
    buckets = decode_buckets(12)
    assert [bucket_for(n, buckets) for n in (1, 2, 3, 5, 9, 12, 13)] == [1, 2, 4, 8, 12, 12, None]
    with pytest.raises(ValueError, match="max_num_seqs"):
        decode_buckets(0)


def test_static_metadata_matches_builder_and_pads():
    inputs = StaticDecodeInputs(max_batch=8, max_blocks_per_seq=6, block_size=4, max_model_len=24,
                                device=torch.device("cpu"))
    # a larger step first, so the later step's padding rows held real values before
    inputs.fill([5, 6, 7, 8, 9], [0, 3, 4, 7, 20], [[1], [2], [3, 4], [5, 6], [9, 8, 7, 10, 11, 12]], 8)
    tables, positions = [[7, 3], [11], [2, 4, 6]], [4, 0, 9]
    inputs.fill([10, 11, 12], positions, tables, 4)
    meta = inputs.metadata(4)
    ref = build_attention_metadata(tables, positions, [1, 1, 1], 4)
    assert torch.equal(meta.slot_mapping[:3], ref.slot_mapping)
    assert torch.equal(meta.seq_lens[:3], ref.seq_lens)
    assert torch.equal(meta.block_tables[:3, :3], ref.block_tables)
    assert torch.equal(meta.query_start_loc, torch.arange(5, dtype=torch.int32))
    assert meta.slot_mapping[3].item() == PAD_SLOT and meta.seq_lens[3].item() == 1
    assert inputs.input_ids[:4].tolist() == [10, 11, 12, 0]
    assert inputs.position_ids[:4].tolist() == [4, 0, 9, 0]
    assert (meta.num_decodes, meta.max_query_len, meta.max_seq_len) == (4, 1, 24)


def test_fill_rejects_bad_input():
    inputs = StaticDecodeInputs(4, 3, 4, 12, torch.device("cpu"))
    with pytest.raises(ValueError, match="bucket"):
        inputs.fill([1, 2, 3], [0, 0, 0], [[0], [1], [2]], 2)
    with pytest.raises(ValueError, match="position 12"):
        inputs.fill([1], [12], [[0, 1, 2]], 1)
    with pytest.raises(ValueError, match="does not fit position 4"):
        inputs.fill([1], [4], [[0]], 1)
    with pytest.raises(ValueError, match="length mismatch"):
        inputs.fill([1, 2], [0], [[0], [1]], 2)


@pytest.mark.parametrize("num_splits", [1, 3, 8])
def test_decode_kernel_fixed_splits_and_oversized_max_seq_len(num_splits):
    batch = make_batch([(0, 1), (14, 1), (15, 1), (16, 1), (39, 1)], 4, 2, 16, 4, torch.float32, DEVICE)
    meta = batch.meta
    k_cache, v_cache = batch.pool.k_cache(0), batch.pool.v_cache(0)
    for i, (c, _) in enumerate(batch.specs):  # write the new tokens' K/V the kernel attends over too
        slot = int(meta.slot_mapping[i])
        k_cache.view(-1, 2, 16)[slot], v_cache.view(-1, 2, 16)[slot] = batch.k_full[i][c], batch.v_full[i][c]
    got = paged_decode_attention(batch.q, k_cache, v_cache, meta.block_tables, meta.seq_lens, 4096, 0.25,
                                 num_splits=num_splits)
    want = paged_decode_attention_reference(batch.q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                            meta.max_seq_len, 0.25)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    with pytest.raises(ValueError, match="num_splits"):
        paged_decode_attention(batch.q, k_cache, v_cache, meta.block_tables, meta.seq_lens, 40, 0.25,
                               num_splits=0)


def test_padding_rows_change_neither_logits_nor_kv(tiny_path):
    core = _core(tiny_path, DEVICE, enforce_eager=True)
    runner = core.runner
    for i, p in enumerate(_prompts(3, seed=1)):
        core.add_request(f"p{i}", p, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    core.step()  # prefill all three (eager)
    step = core.scheduler.schedule()
    assert len(step.scheduled) == 3 and all(s.num_scheduled_tokens == 1 for s in step.scheduled)
    before = runner.kv_cache.kv_buffer.clone()
    eager = runner.compute_logits(step).clone()
    kv_eager = runner.kv_cache.kv_buffer.clone()
    runner.kv_cache.kv_buffer.copy_(before)
    graphs = DecodeCudaGraphs(runner.model, runner.kv_cache, runner.backend, 8, runner.max_model_len)
    graphs.inputs.fill([1] * 5, [0, 1, 2, 3, 4], [[150], [151], [152], [153], [154, 155]], 8)  # stale rows
    runner.decode_graphs = graphs
    static = runner.compute_logits(step)  # 3 real rows in bucket 4: row 3 is padding
    assert static.shape == eager.shape == (3, runner.vocab_size)
    torch.testing.assert_close(static, eager, atol=1e-5, rtol=1e-5)
    kv = runner.kv_cache.kv_buffer
    torch.testing.assert_close(kv, kv_eager, atol=1e-5, rtol=1e-5)  # GEMM rounding differs with M
    changed = (kv != before).flatten(2, 3).any(dim=(0, 1, 3, 4)).nonzero().flatten().tolist()
    pos = [s.seq.num_computed_tokens for s in step.scheduled]
    real = sorted(s.seq.block_table[p // 4] * 4 + p % 4 for s, p in zip(step.scheduled, pos, strict=True))
    assert changed == real  # padding wrote nothing: only the three real slots changed
    core.scheduler.update(step, {s.seq.request_id: 3 for s in step.scheduled})
    while core.has_unfinished():
        core.step()
    core.check_no_leaks()


def test_generation_same_through_static_buffers_on_cpu(tiny_path):
    """Greedy and seeded rows through the static decode buffers equal eager steps. Three rows of 1..3
    prompt tokens fill bucket 4 with one padding row; with 4 tokens two of them cross a block boundary."""
    prompts = _prompts(3, seed=2)
    assert [len(p) for p in prompts] == [1, 2, 3]
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=i, max_tokens=4, ignore_eos=True)
              for i in range(3)]
    eager = _generate(_core(tiny_path, DEVICE, enforce_eager=True), prompts, params)
    core = _core(tiny_path, DEVICE, enforce_eager=True)
    r = core.runner
    r.decode_graphs = DecodeCudaGraphs(r.model, r.kv_cache, r.backend, 8, r.max_model_len)
    assert _generate(core, prompts, params) == eager


def test_graphs_refuse_other_backends_and_cpu(tiny_path):
    core = _core(tiny_path, DEVICE, enforce_eager=True)
    r = core.runner
    from engine.attention.torch_backend import TorchAttentionBackend

    with pytest.raises(ValueError, match="triton"):
        DecodeCudaGraphs(r.model, r.kv_cache, TorchAttentionBackend(), 8, r.max_model_len)
    assert r.decode_graphs is None  # enforce_eager (and on CPU the runner never captures)
    if not CUDA:
        with pytest.raises(RuntimeError, match="CUDA"):
            DecodeCudaGraphs(r.model, r.kv_cache, r.backend, 8, r.max_model_len).capture()


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA (run by scripts/gpu_tests.sh)")
@pytest.mark.parametrize("num_seqs", [1, 3, 8, 13])
def test_gpu_replay_equals_eager_logits(tiny_path, num_seqs):
    core = _core(tiny_path, "cuda", enforce_eager=False, max_num_seqs=16)
    runner = core.runner
    assert runner.decode_graphs is not None and runner.decode_graphs.captured == (1, 2, 4, 8, 16)
    for i, p in enumerate(_prompts(num_seqs, seed=num_seqs)):
        core.add_request(f"p{i}", p, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    core.step()
    step = core.scheduler.schedule()
    assert len(step.scheduled) == num_seqs and all(s.num_scheduled_tokens == 1 for s in step.scheduled)
    before = runner.kv_cache.kv_buffer.clone()
    replayed = runner.compute_logits(step).clone()
    kv_graph = runner.kv_cache.kv_buffer.clone()
    runner.kv_cache.kv_buffer.copy_(before)
    graphs, runner.decode_graphs = runner.decode_graphs, None
    eager = runner.compute_logits(step)
    runner.decode_graphs = graphs
    torch.testing.assert_close(replayed, eager, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(kv_graph, runner.kv_cache.kv_buffer, atol=1e-5, rtol=1e-5)
    core.scheduler.update(step, {s.seq.request_id: 5 for s in step.scheduled})
    while core.has_unfinished():
        core.step()
    core.check_no_leaks()


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA (run by scripts/gpu_tests.sh)")
def test_gpu_generate_identical_with_and_without_graphs(tiny_path):
    prompts = _prompts(11, seed=4)
    params = [SamplingParams(temperature=0.0 if i % 3 else 0.7, seed=i, max_tokens=12, ignore_eos=True)
              for i in range(11)]
    eager = _generate(_core(tiny_path, "cuda", enforce_eager=True, max_num_seqs=16), prompts, params)
    graphed_core = _core(tiny_path, "cuda", enforce_eager=False, max_num_seqs=16)
    assert graphed_core.runner.decode_graphs is not None
    assert _generate(graphed_core, prompts, params) == eager


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA (run by scripts/gpu_tests.sh)")
def test_gpu_graph_step_has_no_host_sync(tiny_path):
    core = _core(tiny_path, "cuda", enforce_eager=False)
    for i, p in enumerate(_prompts(3, seed=5)):
        core.add_request(f"p{i}", p, SamplingParams(temperature=0.9, top_p=0.9, seed=i, max_tokens=3))
    core.step()
    step = core.scheduler.schedule()
    rows = [core.runner._row(s.seq) for s in step.scheduled]
    from engine.sampler import apply_filters, apply_penalties

    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        logits = core.runner.compute_logits(step)
        apply_filters(apply_penalties(logits.float(), rows), rows)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    core.scheduler.update(step, {s.seq.request_id: 5 for s in step.scheduled})
    while core.has_unfinished():
        core.step()
    core.check_no_leaks()


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA or torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_gpu_worker_on_second_device_runs_there_from_any_thread(tiny_path):
    """A runner on cuda:1 stepped from a thread whose current device is cuda:0 (the worker loop's
    executor) must launch its kernels on cuda:1 and produce cuda:0's tokens (found by reading the code:
    the runner never set the device, so Triton and graph capture used cuda:0)."""
    import concurrent.futures

    prompts = _prompts(5, seed=9)
    params = [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True) for _ in prompts]
    expected = _generate(_core(tiny_path, "cuda:0", enforce_eager=False), prompts, params)
    core = _core(tiny_path, "cuda:1", enforce_eager=False)
    seen: list[int] = []
    compute = core.runner.compute_logits

    def spy(*args, **kwargs):
        seen.append(torch.cuda.current_device())
        return compute(*args, **kwargs)

    core.runner.compute_logits = spy  # type: ignore[method-assign]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pool.submit(torch.cuda.set_device, 0).result()
        got = pool.submit(_generate, core, prompts, params).result()
    assert got == expected
    assert seen and set(seen) == {1}


def test_plain_greedy_batches_take_the_fast_path_and_others_do_not(tiny_path):
    """A batch whose every row is plain greedy is sampled by ``Sampler.greedy``; one row with a penalty,
    logprobs or ``min_tokens`` not yet reached sends the whole batch through the full sampler (eos,
    the argmax of these fixed logits, is masked for the ``min_tokens`` row)."""
    core = _core(tiny_path, DEVICE, enforce_eager=True)
    runner, [eos] = core.runner, core.eos_token_ids
    logits = torch.zeros(8, runner.vocab_size)
    logits[:, eos], logits[:, 7] = 10.0, 5.0
    runner.compute_logits = lambda out, hook=None, note=b"": logits[: len(out.scheduled)]  # type: ignore[method-assign]
    calls: list[str] = []
    greedy, full = runner.sampler.greedy, type(runner.sampler).__call__
    runner.sampler.greedy = lambda x: calls.append("greedy") or greedy(x)  # type: ignore[method-assign]
    type(runner.sampler).__call__ = (
        lambda self, x, rows, *mask: calls.append("full") or full(self, x, rows, *mask))
    try:
        core.add_request("plain", [5, 6], SamplingParams(temperature=0.0, max_tokens=4))
        assert [o.token_id for o in core.step()] == [eos] and calls == ["greedy"]
        core.add_request("min", [5, 6], SamplingParams(temperature=0.0, min_tokens=2, max_tokens=4))
        core.add_request("plain2", [5, 6], SamplingParams(temperature=0.0, max_tokens=4))
        assert [(o.request_id, o.token_id) for o in core.step()] == [("min", 7), ("plain2", eos)]
        assert calls == ["greedy", "full"]
        assert [(o.request_id, o.token_id) for o in core.step()] == [("min", 7)]  # 1 output < min_tokens
        assert [(o.request_id, o.token_id) for o in core.step()] == [("min", eos)]
        assert calls == ["greedy", "full", "full", "greedy"]
    finally:
        type(runner.sampler).__call__ = full  # type: ignore[method-assign]
    core.check_no_leaks()
