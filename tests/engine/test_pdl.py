"""Programmatic dependent launch (engine/ops/pdl.py, ``ModelConfig.pdl``).

CPU: the switch and its defaults (PDL never applies to CPU tensors or under the Triton interpreter), the
rule that launches the decode split kernel late right after a GEMV (PDL made active by hand) and the
names the GEMV and split launches give it (their arguments recorded), and that the model runner applies
``ModelConfig.pdl``; on a GPU also that only one-row launches use it. On a Hopper GPU
(scripts/gpu_tests.sh): a chain of dependent kernels (RMSNorm with residual, GEMV, SiLU·mul, decode
attention's split, launched late after its GEMV or early, and reduce) captured in a CUDA graph with PDL
gives bit-identical results to the same chain run eagerly without PDL (and a mixture-of-experts layer's:
q/k head norms, router GEMV, top-k softmax, matrix-vector experts), replay after replay (a kernel reading
before its predecessor finished would show here), and the engine's greedy tokens through captured decode
graphs are the same with and without PDL.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.engine_core import EngineCore
from engine.ops import pdl
from engine.ops.gemv import gemv
from engine.ops.paged_decode import paged_decode_attention
from engine.ops.pdl import pdl_active, pdl_enabled, pdl_kwargs, set_pdl
from engine.ops.rms_norm import rms_norm
from engine.ops.silu_mul import silu_mul
from engine.sampling_params import SamplingParams
from tests.engine.test_async_scheduling import Run, prompts
from tests.engine.test_kernels import make_batch
from tests.engine.test_loader import save_tiny_model

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)
NOT_HOPPER = "needs a CUDA device of compute capability >= 9.0 (scripts/gpu_tests.sh)"


@pytest.fixture(autouse=True)
def restore_switch() -> Iterator[None]:
    before = pdl_enabled()
    yield
    set_pdl(before)


def test_off_for_cpu_tensors_and_when_switched_off() -> None:
    assert pdl_enabled()  # the default
    cpu = torch.zeros(2)
    assert pdl_kwargs(cpu) == {"USE_GDC": False} and not pdl_active(cpu)
    set_pdl(False)
    assert not pdl_enabled() and pdl_kwargs(cpu) == {"USE_GDC": False}
    if HOPPER:
        one_row, two_rows = torch.zeros(1, 8, device="cuda"), torch.zeros(2, 8, device="cuda")
        assert pdl_kwargs(one_row) == {"USE_GDC": False}
        set_pdl(True)
        assert pdl_kwargs(one_row) == {"USE_GDC": True, "launch_pdl": True}
        assert pdl_kwargs(two_rows) == {"USE_GDC": False}  # one-token steps only (module docstring)


def test_split_kernel_launched_late_after_a_gemv_only(monkeypatch: pytest.MonkeyPatch) -> None:
    active = {"now": True}
    monkeypatch.setattr(pdl, "pdl_active", lambda t: active["now"])
    t = torch.zeros(1, 8)
    early, late = {"USE_GDC": True, "launch_pdl": True}, {"USE_GDC": True}

    def split() -> dict[str, bool]:
        return pdl.pdl_kwargs(t, "decode_split", late_after=pdl.GEMV_KERNELS)

    for gemv_name in sorted(pdl.GEMV_KERNELS):
        assert pdl.pdl_kwargs(t, gemv_name) == early  # the GEMV itself launches early
        assert split() == late
        assert pdl.pdl_kwargs(t, "reduce") == early  # the split's successor still may
    assert pdl.pdl_kwargs(t, "qk_norm") == early and split() == early  # Qwen3: a head norm in between
    assert pdl.pdl_kwargs(t) == early and split() == early  # an unnamed launch is no GEMV
    pdl.pdl_kwargs(t, "gemv")
    active["now"] = False
    assert pdl.pdl_kwargs(t, "copy") == {"USE_GDC": False}  # a launch without PDL in between
    active["now"] = True
    assert split() == early


class _Spy:
    """Stands in for a module's ``pdl_kwargs``: records each call's ``kernel`` and ``late_after`` and
    answers as the real one does on a CPU (no PDL)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, frozenset[str]]] = []

    def __call__(self, t: torch.Tensor, kernel: str = "",
                 late_after: frozenset[str] = frozenset()) -> dict[str, bool]:
        self.calls.append((kernel, late_after))
        return {"USE_GDC": False}


@pytest.mark.skipif(torch.cuda.is_available(), reason="the Triton interpreter over CPU tensors records "
                    "the launches' arguments; compiled Triton refuses CPU tensors (the GPU chain tests "
                    "replay the rule)")
def test_the_launches_name_themselves_as_the_rule_expects(monkeypatch: pytest.MonkeyPatch) -> None:
    """The one-row GEMVs give the names in ``GEMV_KERNELS``; the decode split kernel asks to be late
    after them, its reduce kernel does not (Triton interpreter, PDL's arguments recorded)."""
    import engine.ops.fp8_gemv as fp8_gemv_module
    import engine.ops.gemv as gemv_module
    import engine.ops.paged_decode as paged_decode_module
    from engine.ops.fp8_weight import quantize_weight_per_channel

    spies = {m: _Spy() for m in (gemv_module, fp8_gemv_module, paged_decode_module)}
    for module, spy in spies.items():
        monkeypatch.setattr(module, "pdl_kwargs", spy)
    x, w = torch.randn(1, 64), torch.randn(32, 64)
    gemv_module.gemv(x, w)
    fp8_gemv_module.fp8_gemv(x, quantize_weight_per_channel(w), None)
    batch = make_batch([(40, 1)], 4, 2, 16, 8, torch.float32, device="cpu")
    meta, pool = batch.meta, batch.pool
    paged_decode_module.paged_decode_attention(torch.randn(1, 4, 16), pool.k_cache(0), pool.v_cache(0),
                                               meta.block_tables, meta.seq_lens, meta.max_seq_len, 0.25,
                                               num_splits=2)
    named = {spies[gemv_module].calls[0][0], spies[fp8_gemv_module].calls[0][0]}
    assert named == pdl.GEMV_KERNELS
    split, reduce = spies[paged_decode_module].calls
    assert split[1] == pdl.GEMV_KERNELS and reduce[1] == frozenset()


def test_model_runner_applies_model_config_pdl(tmp_path: Path) -> None:
    path = save_tiny_model("LlamaForCausalLM", tmp_path / "m", seed=2)
    for wanted in (False, True):
        EngineCore(EngineConfig(ModelConfig(str(path), dtype="float32", device="cpu", pdl=wanted),
                                CacheConfig(block_size=4, num_blocks=16), SchedulerConfig()))
        assert pdl_enabled() is wanted


def _chain(x: torch.Tensor, residual: torch.Tensor, weights: list[torch.Tensor], norm: torch.Tensor,
           batch: object) -> torch.Tensor:
    """Four 'layers' of dependent kernels; every output feeds the next kernel."""
    meta = batch.meta  # type: ignore[attr-defined]
    pool = batch.pool  # type: ignore[attr-defined]
    max_len = meta.max_seq_len  # a python int: nothing may synchronise while a graph is captured
    for _ in range(4):
        h = rms_norm(x, norm, 1e-5, residual)
        gate_up = gemv(h, weights[0])  # [1, 2 * F]
        q = gemv(silu_mul(gate_up), weights[1])  # [1, H * D]
        attn = paged_decode_attention(q.view(1, 8, 64), pool.k_cache(0), pool.v_cache(0), meta.block_tables,
                                      meta.seq_lens, max_len, 0.125, num_splits=4)
        x = gemv(attn.view(1, -1), weights[2])
    return x


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason=NOT_HOPPER)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("split_late", [True, False])
def test_kernel_chain_in_a_graph_with_pdl_equals_eager_without(dtype: torch.dtype, split_late: bool,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """``split_late``: the split kernel launched late after its GEMV (the rule), else early as after
    Qwen3's head norm."""
    import engine.ops.paged_decode as paged_decode_module

    if not split_late:
        monkeypatch.setattr(paged_decode_module, "GEMV_KERNELS", frozenset())
    gen = torch.Generator(device="cuda").manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device="cuda") * 0.05).to(dtype)

    width, ffn = 512, 1536
    weights = [rand(2 * ffn, width), rand(512, ffn), rand(width, 512)]
    norm = rand(width) + 1
    batch = make_batch([(300, 1)], 8, 2, 64, 16, dtype, device="cuda")
    x0, r0 = rand(1, width), rand(1, width)
    set_pdl(False)
    want = _chain(x0.clone(), r0.clone(), weights, norm, batch)
    set_pdl(True)
    x, residual = x0.clone(), r0.clone()
    _chain(x.clone(), residual.clone(), weights, norm, batch)  # compile the PDL variants outside capture
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        got = _chain(x, residual, weights, norm, batch)
    torch.cuda.current_stream().wait_stream(stream)
    for _ in range(20):
        residual.copy_(r0)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(got, want)
    assert torch.equal(residual, _residual_after(x0, r0, weights, norm, batch))


def _residual_after(x0: torch.Tensor, r0: torch.Tensor, weights: list[torch.Tensor], norm: torch.Tensor,
                    batch: object) -> torch.Tensor:
    set_pdl(False)
    residual = r0.clone()
    _chain(x0.clone(), residual, weights, norm, batch)
    set_pdl(True)
    return residual


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason=NOT_HOPPER)
def test_engine_greedy_tokens_equal_with_and_without_pdl(tmp_path: Path) -> None:
    path = save_tiny_model("LlamaForCausalLM", tmp_path / "m", seed=5)

    def go(pdl: bool) -> dict[str, list[int]]:
        core = EngineCore(EngineConfig(
            ModelConfig(str(path), dtype="bfloat16", device="cuda", attention_backend="triton",
                        max_model_len=96, pdl=pdl),
            CacheConfig(block_size=4, num_blocks=200),
            SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=256),
        ))
        assert core.runner.decode_graphs is not None and core.runner.decode_graphs.captured
        run = Run(core)
        for i, p in enumerate(prompts(9, seed=4)):
            run.add(f"q{i}", p, SamplingParams(temperature=0.0, max_tokens=6 + 3 * i, ignore_eos=True))
        run.drain()
        return run.tokens

    assert go(True) == go(False)


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason=NOT_HOPPER)
@pytest.mark.parametrize("slots", [1, 4])
def test_moe_chain_in_a_graph_with_pdl_equals_eager_without(slots: int) -> None:
    """A batch-1 MoE layer's launches (q/k head norms, router GEMV, top-k softmax, the matrix-vector
    experts with ``slots`` experts read at once; with all of them, the down kernel reads the expert ids
    before its wait) captured with PDL equal the eager chain without PDL, bit for bit, replay after replay,
    each replay on new inputs (so ids left from the replay before would show)."""
    from engine.ops.fused_moe_gemv import fused_moe_gemv
    from engine.ops.rms_norm import qk_rms_norm
    from engine.ops.topk_softmax import topk_softmax

    dtype = torch.bfloat16
    gen = torch.Generator(device="cuda").manual_seed(1)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device="cuda") * 0.05).to(dtype)

    hidden, inter, experts, d = 256, 64, 16, 32
    router = rand(experts, hidden)
    gate_up, down = rand(experts, 2 * inter, hidden), rand(experts, hidden, inter)
    wq, wk = rand(d) + 1, rand(d) + 1
    x0, qkv0 = rand(1, hidden), rand(1, 8 * d)

    def chain(x: torch.Tensor, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        qk = qk_rms_norm(qkv[:, :6 * d].view(1, 6, d), 4, wq, 1e-6, wk, 1e-6)
        weights, ids = topk_softmax(gemv(x, router), 4, True, dtype)
        return fused_moe_gemv(x, gate_up, down, weights, ids, down_slots=slots), qk

    x, qkv = x0.clone(), qkv0.clone()
    set_pdl(True)
    chain(x, qkv)  # compile the PDL variants outside capture
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        got = chain(x, qkv)
    torch.cuda.current_stream().wait_stream(stream)
    routed = set()
    for _ in range(20):
        x.copy_(rand(1, hidden))
        qkv.copy_(rand(1, 8 * d))
        set_pdl(False)
        want = chain(x.clone(), qkv.clone())
        set_pdl(True)
        routed.add(tuple(topk_softmax(gemv(x, router), 4, True, dtype)[1].flatten().tolist()))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert len(routed) > 1  # the replays were routed differently
