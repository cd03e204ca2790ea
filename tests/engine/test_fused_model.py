"""FusedCausalLM (merged QKV / gate-up GEMMs, fused RMSNorm, rotary and SiLU) against transformers: the same
logits as the transformers model through the same paged attention, greedy tokens equal to ``generate``,
weights stored once, and the ``fused_ops`` switch."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.llm import LLM
from engine.model_runner import ModelRunner
from engine.models.fused_model import PROJECTIONS, FusedCausalLM
from engine.sampling_params import SamplingParams
from tests.engine.grid import grid
from tests.engine.test_hf_parity import assert_matches_hf, make_prompts
from tests.engine.test_loader import ARCHS, MOE_ARCHS, NEW_DENSE_ARCHS, save_tiny_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, logprobs=0)


def _llm(path, fused_ops: str, backend: str = "torch", device: str = "cpu",
         quantization: str | None = None) -> LLM:
    return LLM(str(path), dtype="float32", device=device, attention_backend=backend, block_size=4,
               num_blocks=256, fused_ops=fused_ops, max_num_batched_tokens=24, quantization=quantization)


@pytest.mark.parametrize("arch", ARCHS + NEW_DENSE_ARCHS + MOE_ARCHS)
def test_fused_greedy_matches_transformers_generate(arch, tmp_path):
    path = save_tiny_model(arch, tmp_path / "m", seed=7)
    reference = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    llm = _llm(path, "on")
    assert isinstance(llm.core.runner.net, FusedCausalLM)
    prompts = make_prompts(seed=7)[::2]
    outs = llm.generate(prompts, GREEDY)  # chunked prefill (24-token budget), prefix hits, decode batches
    assert_matches_hf(reference, prompts, outs, eos=2, max_tokens=6)
    llm.core.check_no_leaks()


def test_fused_triton_kernels_match_transformers(tmp_path):
    """The Triton kernels inside the whole forward with the triton attention backend (Triton's interpreter
    on a CPU-only machine; compiled, fp32, with CUDA graphs for decode on a GPU)."""
    path = save_tiny_model("LlamaForCausalLM", tmp_path / "m", seed=8)
    reference = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    llm = _llm(path, "on", backend="triton", device="cuda" if torch.cuda.is_available() else "cpu")
    net = llm.core.runner.net
    assert net.use_triton
    plain_gemv = set(PROJECTIONS) - {"silu_down", "router"}  # every dense projection (silu_down: below)
    net.gemv_projections = frozenset(plain_gemv)  # one-token steps through engine.ops.gemv
    llm.core.runner.decode_graphs = None  # (GPU) run decode steps eagerly so the change takes effect
    calls = []
    original = net._linear
    net._linear = lambda name, x, w, b, **kw: (calls.append((name, x.shape[0]))
                                               or original(name, x, w, b, **kw))
    prompts = make_prompts(seed=8)[::5]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=3, logprobs=0))
    assert_matches_hf(reference, prompts, outs, eos=2, max_tokens=3)
    # batch 1 (a 1-token prompt): its prefill and one decode step, each one row through the GEMVs
    solo = llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=2, logprobs=0))
    assert_matches_hf(reference, prompts[:1], solo, eos=2, max_tokens=2)
    assert {name for name, rows in calls if rows == 1} == plain_gemv  # batch-1 steps ran, LM head included
    llm.core.check_no_leaks()
    with pytest.raises(ValueError, match="unknown projections"):
        FusedCausalLM(llm.core.runner.model, use_triton=True, gemv_projections=("qkv", "embed_tokens"))


@pytest.mark.parametrize("arch", grid(MOE_ARCHS, ["Glm4MoeForCausalLM"]))  # CPU: the one with every part
def test_fused_moe_kernels_match_transformers(arch, tmp_path, monkeypatch):
    """A mixture of experts with the Triton kernels (``fused_moe`` for every sparse layer, and GLM-4.5's
    shared expert, partial rotary and dense first layer) through the triton attention backend: greedy
    tokens and logprobs equal transformers' in one batch, then again with prefix-cache hits."""
    from engine.models import fused_model

    path = save_tiny_model(arch, tmp_path / "m", seed=12)
    reference = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    llm = _llm(path, "on", backend="triton", device="cuda" if torch.cuda.is_available() else "cpu")
    net = llm.core.runner.net
    sparse = [lay.index for lay in net.fused_layers if isinstance(lay.ffn, fused_model._SparseMoE)]
    dense = {"Qwen3MoeForCausalLM": [1], "MixtralForCausalLM": [], "Glm4MoeForCausalLM": [0]}[arch]
    assert sorted(set(range(len(net.fused_layers))) - set(sparse)) == dense
    llm.core.runner.decode_graphs = None  # (GPU) every step eager, so the counter below sees each call
    calls: list[int] = []
    real = fused_model.fused_moe
    monkeypatch.setattr(fused_model, "fused_moe",
                        lambda x, *a, **kw: calls.append(x.shape[0]) or real(x, *a, **kw))
    prompts = [make_prompts(seed=12)[14], make_prompts(seed=12)[3]]  # 13-token shared prefix + 1; 4 tokens
    params = SamplingParams(temperature=0.0, max_tokens=3, logprobs=0)
    outs = llm.generate(prompts, params)
    assert_matches_hf(reference, prompts, outs, eos=2, max_tokens=3)
    # its full blocks now hit the prefix cache: the first two tokens (prefill, one decode step) the same
    again = llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=2, logprobs=0))
    assert again[0].num_cached_tokens > 0 and again[0].token_ids == outs[0].token_ids[:2]
    assert calls and len(calls) % len(sparse) == 0
    llm.core.check_no_leaks()


def test_qwen3_head_norms_in_one_launch_match_transformers(tmp_path, monkeypatch):
    """Qwen3's per-head q/k RMSNorm with the Triton kernels: one ``qk_rms_norm`` launch per layer and step,
    and greedy tokens and logprobs equal transformers' (batch 2, then batch 1)."""
    from engine.models import fused_model

    path = save_tiny_model("Qwen3ForCausalLM", tmp_path / "m", seed=16)
    reference = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    llm = _llm(path, "on", backend="triton", device="cuda" if torch.cuda.is_available() else "cpu")
    net = llm.core.runner.net
    llm.core.runner.decode_graphs = None  # (GPU) every step eager, so the counter below sees each call
    calls: list[tuple[int, int]] = []
    real = fused_model.qk_rms_norm
    monkeypatch.setattr(fused_model, "qk_rms_norm",
                        lambda qk, *a: calls.append(tuple(qk.shape[:2])) or real(qk, *a))
    prompts = make_prompts(seed=16)[:2]
    params = SamplingParams(temperature=0.0, max_tokens=3, logprobs=0)
    outs = llm.generate(prompts, params)
    assert_matches_hf(reference, prompts, outs, eos=2, max_tokens=3)
    solo = llm.generate(prompts[:1], params)
    assert_matches_hf(reference, prompts[:1], solo, eos=2, max_tokens=3)
    cfg = reference.config
    assert calls and len(calls) % len(net.fused_layers) == 0
    assert {heads for _, heads in calls} == {cfg.num_attention_heads + cfg.num_key_value_heads}
    assert 1 in {tokens for tokens, _ in calls}  # batch-1 decode steps took it too
    llm.core.check_no_leaks()


@pytest.mark.parametrize("arch", grid(["Qwen3MoeForCausalLM", "MixtralForCausalLM"], ["Qwen3MoeForCausalLM"]))
def test_one_token_router_logits_come_from_the_gemv(arch, tmp_path, monkeypatch):
    """``"router"`` in ``gemv_projections``: a one-token step's softmax top-k router takes its logits from
    ``engine.ops.gemv`` (no cuBLAS call), once per sparse layer, and each sparse block's output equals the
    transformers block's; a two-token step keeps ``torch.nn.functional.linear``."""
    from engine.models import fused_model

    path = save_tiny_model(arch, tmp_path / "m", seed=15)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # compiled kernels read device tensors
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval().to(device)
    net = FusedCausalLM(model, use_triton=True, gemv_projections=("router",))
    weights: list[torch.Tensor] = []
    real = fused_model.gemv
    monkeypatch.setattr(fused_model, "gemv",
                        lambda x, w, b=None, **kw: weights.append(w) or real(x, w, b, **kw))
    gen = torch.Generator().manual_seed(15)
    sparse = [lay for lay in net.fused_layers if isinstance(lay.ffn, fused_model._SparseMoE)]
    assert sparse
    for tokens in (1, 2):
        weights.clear()
        for lay in sparse:
            x = torch.randn(tokens, model.config.hidden_size, generator=gen).to(device)
            with torch.no_grad():
                got = net._mlp(lay, x)
                out = lay.mlp(x[None])
            want = (out[0] if isinstance(out, tuple) else out).reshape(tokens, -1)
            torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
        routers = [lay.ffn.router.weight for lay in sparse]
        if tokens == 1:
            assert len(weights) == len(routers)
            assert all(w is r for w, r in zip(weights, routers, strict=True))
        else:
            assert weights == []


@pytest.mark.parametrize("arch", NEW_DENSE_ARCHS)
def test_fused_new_dense_kernels_match_transformers(arch, tmp_path, monkeypatch):
    """Phi-3 (its merged projections, half-width LongRoPE) and GLM-4 (pairwise half-width rotary, the
    norms after attention and MLP) with the Triton kernels through the triton attention backend: greedy
    tokens and logprobs equal transformers' in one batch, then again with prefix-cache hits; the rotary
    kernel ran in the model's layout."""
    from engine.models import fused_model

    path = save_tiny_model(arch, tmp_path / "m", seed=15)
    reference = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    llm = _llm(path, "on", backend="triton", device="cuda" if torch.cuda.is_available() else "cpu")
    llm.core.runner.decode_graphs = None  # (GPU) every step eager, so the probe below sees each call
    layouts: list[bool] = []
    real = fused_model.apply_rotary
    monkeypatch.setattr(fused_model, "apply_rotary", lambda *a, interleaved=False: layouts.append(interleaved)
                        or real(*a, interleaved=interleaved))
    prompts = [make_prompts(seed=15)[14], make_prompts(seed=15)[3]]  # 13-token shared prefix + 1; 4 tokens
    params = SamplingParams(temperature=0.0, max_tokens=3, logprobs=0)
    outs = llm.generate(prompts, params)
    assert_matches_hf(reference, prompts, outs, eos=2, max_tokens=3)
    # its full blocks now hit the prefix cache: the first two tokens (prefill, one decode step) the same
    again = llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=2, logprobs=0))
    assert again[0].num_cached_tokens > 0 and again[0].token_ids == outs[0].token_ids[:2]
    torch.testing.assert_close(torch.tensor(again[0].logprobs), torch.tensor(outs[0].logprobs[:2]),
                               atol=1e-4, rtol=0)
    assert set(layouts) == {arch == "Glm4ForCausalLM"}
    llm.core.check_no_leaks()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_moe_decode_cuda_graphs_match_transformers(arch, tmp_path):
    """On CUDA a mixture of experts runs fused by default and its decode steps replay CUDA graphs (the
    routing, the expert alignment and the MoE kernels captured): greedy tokens equal transformers'."""
    path = save_tiny_model(arch, tmp_path / "m", seed=14)
    reference = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    llm = _llm(path, "auto", backend="triton", device="cuda")
    assert isinstance(llm.core.runner.net, FusedCausalLM) and llm.core.runner.decode_graphs is not None
    prompts = make_prompts(seed=14)[::3]
    outs = llm.generate(prompts, GREEDY)
    assert_matches_hf(reference, prompts, outs, eos=2, max_tokens=6)
    solo = llm.generate(prompts[:1], GREEDY)  # batch 1: the one-row bucket
    assert_matches_hf(reference, prompts[:1], solo, eos=2, max_tokens=6)
    llm.core.check_no_leaks()


def test_silu_down_gemv_matches_transformers(tmp_path, monkeypatch):
    """``gemv_projections`` with ``silu_down``: batch-1 decode steps take the down projection's gated GEMV
    (no ``silu_mul`` launch) and greedy tokens still equal transformers'."""
    from engine.models import fused_model

    path = save_tiny_model("LlamaForCausalLM", tmp_path / "m", seed=11)
    reference = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    llm = _llm(path, "on", backend="triton", device="cuda" if torch.cuda.is_available() else "cpu")
    net = llm.core.runner.net
    # the gated GEMV alone: the plain projections' GEMVs at batch 1 are test_fused_triton_kernels_match_
    # transformers' (under the interpreter each is one program per output row)
    net.gemv_projections = frozenset(("silu_down",))
    llm.core.runner.decode_graphs = None
    gated, silu = [], []
    real_gemv, real_silu = fused_model.gemv, fused_model.silu_mul
    monkeypatch.setattr(fused_model, "gemv", lambda x, w, b=None, **kw: gated.append(kw.get("gated", False))
                        or real_gemv(x, w, b, **kw))
    monkeypatch.setattr(fused_model, "silu_mul", lambda x: silu.append(x.shape[0]) or real_silu(x))
    prompts = make_prompts(seed=11)[:1]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=3, logprobs=0))
    assert_matches_hf(reference, prompts, outs, eos=2, max_tokens=3)
    assert True in gated and 1 not in silu  # one-token steps: gated GEMV, never silu_mul
    llm.core.check_no_leaks()


@pytest.mark.parametrize("arch,quantization", [("LlamaForCausalLM", None), ("Phi3ForCausalLM", None),
                                               ("Glm4ForCausalLM", None), ("LlamaForCausalLM", "fp8")])
def test_qkv_written_into_the_attention_buffer_changes_nothing(arch, quantization, tmp_path, monkeypatch):
    """Where the attention backend reads a step's q, k, v in place (``fresh_qkv_rows``: on an H200 cuDNN
    for one fresh long prompt), the QKV projection writes into the zero-tailed ``[rows, H + 2 Hkv, D]``
    buffer itself (``torch.mm``/``addmm`` with ``out=``; QKV bias, merged Phi-3 QKV and GLM's pairwise
    rotary included; FP8 weights: the product copied in) and RoPE, the KV store and the attention work on
    its views: on a CPU, with the
    buffer forced for every multi-row step (the paged kernel then attends over the views), the same
    logprobs bit for bit as the usual projection output, and the buffer's tail stays zero. The same on a
    GPU (float32: cuDNN does not take the step, the paged kernel attends over the views)."""
    from engine.attention.triton_backend import TritonAttentionBackend

    path = save_tiny_model(arch, tmp_path / "m", seed=9)
    # 1, 15 and 17 tokens over the 24-token budget: a step of a decode row and two fresh prompts, one of
    # decode rows and a chunk continued over its cached context, then decode-only steps
    prompts = [make_prompts(seed=9)[i] for i in (0, 8, 16)]
    params = SamplingParams(temperature=0.0, max_tokens=3, logprobs=2)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # float32: the paged kernel attends on a GPU too
    plain = _llm(path, "on", "triton", device, quantization).generate(prompts, params)
    buffers: list[tuple[torch.Tensor, int]] = []

    def rows(self, meta, heads, kv_heads, head_dim, dtype, device, k_cache_dtype):
        return None if meta.num_decodes == meta.num_seqs else -(-meta.num_tokens // 16) * 16 + 16

    real = FusedCausalLM._packed_qkv

    def spy(self, lay, rows, t, x):
        packed = real(self, lay, rows, t, x)
        if packed is not None:
            buffers.append((packed, t))
        return packed

    monkeypatch.setattr(TritonAttentionBackend, "fresh_qkv_rows", rows)
    monkeypatch.setattr(FusedCausalLM, "_packed_qkv", spy)
    llm = _llm(path, "on", "triton", device, quantization)
    packed = llm.generate(prompts, params)
    assert buffers and all(buf[:t].abs().sum() > 0 and not buf[t:].any() for buf, t in buffers)
    for a, b in zip(packed, plain, strict=True):
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs and a.top_logprobs == b.top_logprobs
    llm.core.check_no_leaks()


def test_fused_and_unfused_logits_agree_and_weights_are_shared(tmp_path):
    path = save_tiny_model("Qwen2ForCausalLM", tmp_path / "m", seed=9)  # QKV biases merged too
    before = {k: v.clone() for k, v in
              AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).state_dict().items()}
    fused, plain = _llm(path, "on"), _llm(path, "off")
    runner = fused.core.runner
    assert runner.net is not runner.model and plain.core.runner.net is plain.core.runner.model
    state = runner.model.state_dict()
    assert state.keys() == before.keys()
    for key, value in before.items():
        assert torch.equal(state[key], value), key
    attn = runner.model.model.layers[0].self_attn
    merged = runner.net.fused_layers[0].qkv_weight
    assert attn.k_proj.weight.untyped_storage().data_ptr() == merged.untyped_storage().data_ptr()
    prompt = make_prompts(seed=9)[10]
    params = SamplingParams(temperature=0.0, max_tokens=5, logprobs=3)
    a, b = fused.generate([prompt], params)[0], plain.generate([prompt], params)[0]
    assert a.token_ids == b.token_ids
    torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)


def test_fused_ops_switch(tmp_path):
    path = save_tiny_model("MistralForCausalLM", tmp_path / "m", seed=10)
    auto = _llm(path, "auto")  # auto: transformers' modules off CUDA
    assert auto.core.runner.net is auto.core.runner.model
    with pytest.raises(ValueError, match="fused_ops must be one of"):
        ModelConfig(str(path), fused_ops="yes")


def test_fused_on_refuses_an_unsupported_model(tmp_path, monkeypatch):
    path = save_tiny_model("LlamaForCausalLM", tmp_path / "m", seed=11)
    monkeypatch.setattr("engine.models.fused_model.FUSED_ARCHITECTURES", frozenset({"GPT2LMHeadModel"}))
    config = EngineConfig(ModelConfig(str(path), dtype="float32", device="cpu", fused_ops="on"),
                          CacheConfig(block_size=4, num_blocks=16), SchedulerConfig())
    with pytest.raises(ValueError, match="fused_ops=on: architecture LlamaForCausalLM has no fused forward"):
        ModelRunner(config)
    config_auto = EngineConfig(ModelConfig(str(path), dtype="float32", device="cpu", fused_ops="auto"),
                               CacheConfig(block_size=4, num_blocks=16), SchedulerConfig())
    runner = ModelRunner(config_auto)  # auto falls back to transformers' modules
    assert runner.net is runner.model


@pytest.mark.parametrize(("arch", "dtype"), [("LlamaForCausalLM", torch.float32),
                                             ("Qwen2ForCausalLM", torch.bfloat16)])
def test_rope_table_rows_equal_rotary_emb(arch, dtype, tmp_path):
    """The cos/sin table (``rope_table``, built once) holds, bit for bit, what the model's ``rotary_emb``
    computes for any positions in a step; a dynamic RoPE gets no table; the runner's fused model has one
    sized by ``max_model_len``."""
    from engine.models.fused_model import rope_table

    path = save_tiny_model(arch, tmp_path / "m", seed=13)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).eval()
    rotary, like = model.model.rotary_emb, model.model.embed_tokens.weight
    table = rope_table(rotary, 300, like)
    assert table is not None and table.dtype == dtype
    positions = torch.tensor([[0, 7, 8, 299, 150, 151]])
    cos, sin = rotary(like[:0], position_ids=positions)
    half = table.shape[1] // 2
    assert torch.equal(table[positions[0], :half], cos[0]) and torch.equal(table[positions[0], half:], sin[0])
    assert rope_table(rotary, 0, like) is None
    rotary.rope_type = "dynamic"
    assert rope_table(rotary, 300, like) is None
    llm = _llm(path, "on")
    net = llm.core.runner.net
    assert net.rope_table is not None and net.rope_table.shape[0] == llm.core.runner.max_model_len


def test_longrope_table_within_original_context(tmp_path):
    """Phi-3's LongRoPE gets a table only while every position is inside its original context (where
    transformers takes the short factors): its rows equal ``rotary_emb``'s; one position more, none."""
    from engine.models.fused_model import rope_table

    path = save_tiny_model("Phi3ForCausalLM", tmp_path / "m", seed=13)  # original context 512
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    rotary, like = model.model.rotary_emb, model.model.embed_tokens.weight
    assert rotary.rope_type == "longrope"
    table = rope_table(rotary, 512, like)
    assert table is not None
    positions = torch.tensor([[0, 7, 300, 511]])
    cos, sin = rotary(like[:0], position_ids=positions)
    assert torch.equal(table[positions[0]], torch.cat((cos[0], sin[0]), dim=1))
    assert rope_table(rotary, 513, like) is None


def test_norm_weight_of_another_dtype_refused_when_the_model_is_built(tmp_path):
    """A norm weight kept in float32 under bfloat16 activations is refused when the fused model is built,
    naming the norm (``rms_norm`` would refuse it at the first request otherwise); the model as loaded
    (every norm in the activations' dtype) builds."""
    path = save_tiny_model("Qwen3ForCausalLM", tmp_path / "m", seed=3)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16).eval()
    FusedCausalLM(model, use_triton=False)
    model.model.layers[1].self_attn.k_norm.weight.data = model.model.layers[1].self_attn.k_norm.weight.float()
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.k_norm\.weight is torch\.float32, "
                                         r"the model's activations torch\.bfloat16"):
        FusedCausalLM(model, use_triton=False)
