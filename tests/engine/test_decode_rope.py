"""Decode attention with the step's RoPE and K/V store inside its split kernel (``paged_decode_attention(
rope=RopeStore(...))``) against ``rotary_store_kv`` followed by the plain kernel: the same output and the
same cache, bit for bit. CPU: Triton's interpreter (fp32, fp16) over a subset of the shape grid
(tests/engine/grid.py); bf16, compiled kernels and the full grid on a GPU (scripts/gpu_tests.sh)."""

from __future__ import annotations

import itertools

import pytest
import torch

from engine.attention import triton_backend
from engine.cuda_graphs import DecodeCudaGraphs
from engine.llm import LLM
from engine.ops.paged_decode import RopeStore, paged_decode_attention, rope_fusable
from engine.ops.rotary_store import rotary_store_kv
from engine.sampling_params import SamplingParams
from tests.engine.grid import grid
from tests.engine.test_hf_parity import make_prompts
from tests.engine.test_loader import save_tiny_model

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if CUDA else [])


def _step(dtype: torch.dtype, lens: list[int], heads: int, kv_heads: int, dim: int, bs: int = 16):
    """A decode step: sequences of ``lens`` tokens (the last one new), scattered blocks, one padding row
    (slot -1, length 1) at the end."""
    g = torch.Generator().manual_seed(sum(lens) + heads + dim)
    n = len(lens) + 1
    max_blocks = max(-(-x // bs) for x in lens)
    num_blocks = n * max_blocks + 3
    perm = torch.randperm(num_blocks, generator=g)[: n * max_blocks].view(n, max_blocks).to(torch.int32)
    slots = [int(perm[i, (x - 1) // bs]) * bs + (x - 1) % bs for i, x in enumerate(lens)] + [-1]
    rnd = lambda *s: torch.randn(*s, generator=g).to(dtype).to(DEVICE)  # noqa: E731
    return dict(q=rnd(n, heads, dim), k=rnd(n, kv_heads, dim), v=rnd(n, kv_heads, dim),
                cos=rnd(n, dim), sin=rnd(n, dim), kc=rnd(num_blocks, bs, kv_heads, dim),
                vc=rnd(num_blocks, bs, kv_heads, dim), tables=perm.to(DEVICE),
                lens=torch.tensor([*lens, 1], dtype=torch.int32, device=DEVICE),
                slots=torch.tensor(slots, dtype=torch.int64, device=DEVICE), max_len=max(lens))


FUSED_CASES = [((37, 16, 100), 8, 2, 64, 3), ((1, 64, 17), 4, 4, 32, 1), ((200,), 8, 2, 128, 8),
               ((33, 90), 6, 2, 16, None)]
FUSED_GRID = grid([(d, *c) for d, c in itertools.product(DTYPES, FUSED_CASES)],
                  cpu=[(torch.float32, *FUSED_CASES[0]), (torch.float16, *FUSED_CASES[1]),
                       (torch.float16, *FUSED_CASES[2]), (torch.float32, *FUSED_CASES[3])])


@pytest.mark.parametrize(("dtype", "lens", "heads", "kv_heads", "dim", "splits"), FUSED_GRID)
def test_fused_rope_store_equals_rotary_store_then_attention(dtype, lens, heads, kv_heads, dim, splits):
    lens = list(lens)
    _fused_equals_separate(dtype, lens, heads, kv_heads, dim, splits)


@pytest.fixture
def programs_backwards(monkeypatch):
    """Triton's interpreter runs a grid in order, split index innermost and ascending, so a wrong owner
    that comes earlier than the right one would still store before the reader: walk it backwards."""
    import triton.runtime.interpreter as interpreter

    real = interpreter.InterpreterBuilder.set_grid_idx

    def backwards(self, x, y, z):  # type: ignore[no-untyped-def]
        gx, gy, gz = self.grid_dim
        real(self, gx - 1 - x, gy - 1 - y, gz - 1 - z)
    monkeypatch.setattr(interpreter.InterpreterBuilder, "set_grid_idx", backwards)


@pytest.mark.skipif(CUDA, reason="orders the programs of Triton's CPU interpreter")
@pytest.mark.parametrize(("lens", "splits"), [([37, 16, 100], 3), ([200], 8), ([33, 90], 2)])
def test_only_the_owner_split_stores_before_it_reads(programs_backwards, lens, splits):
    _fused_equals_separate(torch.float32, lens, 8, 2, 64, splits)


def _fused_equals_separate(dtype, lens, heads, kv_heads, dim, splits):
    x = _step(dtype, lens, heads, kv_heads, dim)
    q2, k2, kc2, vc2 = x["q"].clone(), x["k"].clone(), x["kc"].clone(), x["vc"].clone()
    rotary_store_kv(q2, k2, x["v"], x["cos"], x["sin"], kc2, vc2, x["slots"])
    want = paged_decode_attention(q2, kc2, vc2, x["tables"], x["lens"], x["max_len"], dim ** -0.5,
                                  num_splits=splits)
    q0 = x["q"].clone()
    got = paged_decode_attention(x["q"], x["kc"], x["vc"], x["tables"], x["lens"], x["max_len"], dim ** -0.5,
                                 num_splits=splits, rope=RopeStore(x["k"], x["v"], x["cos"], x["sin"],
                                                                    x["slots"]))
    assert torch.equal(x["kc"], kc2) and torch.equal(x["vc"], vc2)  # the new K (rotated) and V stored
    assert torch.equal(got[:-1], want[:-1])  # the padding row's output is never used
    assert torch.equal(x["q"], q0)  # q itself is left as it was


@pytest.mark.parametrize("dtype", [torch.bfloat16] if CUDA else [torch.float32])
def test_new_slots_filled_with_nan_are_never_read_before_their_store(dtype):
    """Stress of the store -> barrier -> load order: each new position's cache slot holds NaN before the
    launch, every sequence's last split is one tile long (the default tiles: 64 tokens compiled, 16 under
    the interpreter; lengths <= tile x 8 splits), so the owner reads the position right after storing
    it. A read that beat the store would put NaN into the output. Every repeat must be finite and equal,
    bit for bit, to the first (compiled GPU: 100 repeats of 512 sequences; the interpreter runs programs
    one by one: 1 of 9). Against the separate path: equal under the interpreter; compiled bf16 within one
    bf16 ulp (stop 15 measured 1 ulp in 1-4 % of the rows of sequences spanning 2+ splits,
    docs/benchmarks/engine.md)."""
    g = torch.Generator().manual_seed(11)
    n, repeats, tile = (512, 100, 64) if CUDA else (9, 1, 16)
    lens = torch.randint(1, tile * 8 + 1, (n,), generator=g).tolist()
    x = _step(dtype, lens, 8, 2, 64)
    real = x["slots"][:-1]
    blocks, offsets = real // 16, real % 16
    q2, k2, kc2, vc2 = x["q"].clone(), x["k"].clone(), x["kc"].clone(), x["vc"].clone()
    rotary_store_kv(q2, k2, x["v"], x["cos"], x["sin"], kc2, vc2, x["slots"])
    want = paged_decode_attention(q2, kc2, vc2, x["tables"], x["lens"], x["max_len"], 0.125, num_splits=8)
    rope = RopeStore(x["k"], x["v"], x["cos"], x["sin"], x["slots"])
    first = None
    for _ in range(repeats):
        x["kc"][blocks, offsets] = float("nan")
        x["vc"][blocks, offsets] = float("nan")
        got = paged_decode_attention(x["q"], x["kc"], x["vc"], x["tables"], x["lens"], x["max_len"], 0.125,
                                     num_splits=8, rope=rope)[:-1]
        assert torch.isfinite(got).all()
        first = got.clone() if first is None else first
        assert torch.equal(got, first)
    assert torch.equal(x["kc"], kc2) and torch.equal(x["vc"], vc2)
    if CUDA:  # one bf16 ulp is at most 2**-7 of the value
        torch.testing.assert_close(first, want[:-1], rtol=2.0 ** -7, atol=2.0 ** -12)
    else:
        assert torch.equal(first, want[:-1])


def test_rope_fusable_names_what_does_not_fit():
    x = _step(torch.float32, [20], 4, 2, 48)  # 48: not a power of two
    rope = RopeStore(x["k"], x["v"], x["cos"], x["sin"], x["slots"])
    assert not rope_fusable(x["q"], x["kc"], x["vc"], rope)
    with pytest.raises(ValueError, match="power of two"):
        paged_decode_attention(x["q"], x["kc"], x["vc"], x["tables"], x["lens"], x["max_len"], 0.1, rope=rope)
    y = _step(torch.float32, [20], 4, 2, 32)
    assert rope_fusable(y["q"], y["kc"], y["vc"], RopeStore(y["k"], y["v"], y["cos"], y["sin"], y["slots"]))
    assert not rope_fusable(y["q"], y["kc"], y["vc"], RopeStore(y["k"], y["v"], y["cos"][:, :16], y["sin"],
                                                                y["slots"]))


def _llm(path) -> LLM:
    return LLM(str(path), dtype="float32", device=DEVICE, attention_backend="triton", block_size=4,
               num_blocks=256, fused_ops="on", max_num_batched_tokens=24, enable_prefix_caching=False)


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen3ForCausalLM"])  # Qwen3: q/k norms before RoPE
def test_engine_tokens_and_logprobs_identical_with_the_fused_path(arch, tmp_path, monkeypatch):
    """Through the whole engine (fused forward, triton backend): decode-only steps run the decode kernel
    with ``rope`` (prefill and mixed steps do not); tokens and logprobs equal those with it off.

    A 3- and a 31-token prompt under a 24-token budget: the second is chunked, so the first's decode can
    share a step with its prefill; then decode-only steps of both cross block boundaries (block_size 4:
    positions 4 and 32)."""
    path = save_tiny_model(arch, tmp_path / "m", seed=5)
    prompts = make_prompts(seed=5)
    prompts = [prompts[2], prompts[11]]
    assert [len(p) for p in prompts] == [3, 31]
    params = SamplingParams(temperature=0.0, max_tokens=4, logprobs=3, ignore_eos=True)
    real = triton_backend.paged_decode_attention
    llm = _llm(path)  # one engine for both runs: the backend reads fuse_decode_rope at every call
    llm.core.runner.decode_graphs = None  # (GPU) eager steps, so the switch takes effect
    runs = {}
    for fuse in (True, False):
        llm.core.runner.backend.fuse_decode_rope = fuse
        calls: list[bool] = []
        monkeypatch.setattr(triton_backend, "paged_decode_attention", lambda *a, calls=calls, **kw:
                            calls.append(kw.get("rope") is not None) or real(*a, **kw))
        outs = llm.generate(prompts, params)
        assert (True in calls) == fuse and False in calls  # prefill / mixed steps: the separate path
        runs[fuse] = [(o.token_ids, [repr(lp) for lp in (o.logprobs or [])]) for o in outs]
        llm.core.check_no_leaks()
    assert all(len(lps) == 4 for _, lps in runs[True])
    assert runs[True] == runs[False]


def test_decode_buffers_with_padding_and_stale_rows_are_bit_identical(tmp_path):
    """The decode-graph inputs (static buffers, run eagerly off a captured graph) with padding rows whose
    stale block-table rows point at blocks real rows write this step: logits and the whole KV cache equal
    the separate path's."""
    path = save_tiny_model("LlamaForCausalLM", tmp_path / "m", seed=3)
    llm = _llm(path)
    core, runner = llm.core, llm.core.runner
    for i, n in enumerate((3, 4, 8)):  # decode positions 3, 4 (a new block), 8 (a new block)
        core.add_request(f"p{i}", list(range(10, 10 + n)),
                         SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    core.step()
    step = core.scheduler.schedule()
    assert all(s.num_scheduled_tokens == 1 for s in step.scheduled)
    tables = [s.seq.block_table for s in step.scheduled]
    before = runner.kv_cache.kv_buffer.clone()
    out = {}
    for fuse in (True, False):
        runner.kv_cache.kv_buffer.copy_(before)
        runner.backend.fuse_decode_rope = fuse
        graphs = DecodeCudaGraphs(runner.net, runner.kv_cache, runner.backend, 8, runner.max_model_len)
        stale = [[t[-1]] for t in tables] + [[tables[0][0]], [tables[1][-1]]]  # rows 3..7 left stale
        graphs.inputs.fill([1] * 5, [0] * 5, stale, 8)
        runner.decode_graphs = graphs
        out[fuse] = (runner.compute_logits(step).clone(), runner.kv_cache.kv_buffer.clone())
    assert torch.equal(out[True][0], out[False][0])
    assert torch.equal(out[True][1], out[False][1])
