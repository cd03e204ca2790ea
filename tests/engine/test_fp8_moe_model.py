"""FP8 mixtures of experts end to end on the CPU (engine/models/fp8_moe.py): tiny random Qwen3-MoE, Mixtral
and GLM-4.5 models saved as HF FP8 checkpoints (per-expert ``gate_proj``/``up_proj``/``down_proj``, or
Mixtral's ``block_sparse_moe.experts.{e}.w1/w3/w2``, float8_e4m3fn with block ``weight_scale_inv``; the
attention, dense and shared-expert projections listed in ``modules_to_not_convert``) decode through the
fused forward exactly the greedy tokens (logprobs within 1e-5) of the same weights dequantized to fp32;
``quantization="fp8"`` quantizes a float MoE checkpoint's experts per row on load; dummy FP8 experts are
drawn one expert at a time; what the kernels cannot run is refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.config import ModelConfig
from engine.llm import LLM
from engine.models.fp8 import Fp8Linear
from engine.models.fp8_moe import Fp8Experts
from engine.models.loader import load_model
from engine.models.registry import UnsupportedModelError
from engine.ops.fp8_weight import FP8_DTYPE
from engine.ops.fused_moe_fp8 import dequantize_experts, quantize_experts
from engine.sampling_params import SamplingParams
from tests.engine.test_hf_parity import make_prompts
from tests.engine.test_loader import save_tiny_model, tiny_config

pytestmark = pytest.mark.usefixtures("one_torch_thread")
GREEDY = SamplingParams(temperature=0.0, max_tokens=5, logprobs=0)
BLOCK = (16, 32)  # tiny shapes: several tiles per expert projection (hidden 64, width 32)
IGNORED = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "shared_experts.gate_proj", "shared_experts.up_proj", "shared_experts.down_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]


def write_fp8_moe_checkpoint(src: Path, fp8_dir: Path, deq_dir: Path, block: tuple[int, int]) -> int:
    """Quantize every expert projection of ``src`` (as transformers saves it: per expert, Mixtral with its
    own ``block_sparse_moe.experts.{e}.w1/w3/w2`` names) per ``block`` tile into ``fp8_dir`` (HF FP8
    layout), and write the dequantized fp32 weights to ``deq_dir``. Returns the number of expert
    projections."""
    state = load_file(str(src / "model.safetensors"))
    raw = json.loads((src / "config.json").read_text())
    fp8_state, deq_state, n = {}, {}, 0
    for key, tensor in state.items():
        deq_state[key] = fp8_state[key] = tensor
        if ".experts." in key and key.endswith(".weight") and ".shared_experts." not in key:
            q, s = quantize_experts(tensor[None], block)
            deq_state[key] = dequantize_experts(q, s, block, torch.float32)[0]
            fp8_state[key], fp8_state[key + "_scale_inv"] = q[0], s[0]
            n += 1
    quant = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
             "weight_block_size": list(block), "modules_to_not_convert": IGNORED}
    for out, st, cfg in ((fp8_dir, fp8_state, {**raw, "quantization_config": quant}),
                         (deq_dir, deq_state, raw)):
        out.mkdir(parents=True)
        save_file(st, str(out / "model.safetensors"), metadata={"format": "pt"})
        (out / "config.json").write_text(json.dumps(cfg))
    return n


def _llm(path: Path, **kw) -> LLM:
    return LLM(str(path), dtype="float32", device="cpu", attention_backend="torch", block_size=4,
               num_blocks=128, fused_ops="on", max_num_batched_tokens=24, **kw)


@pytest.mark.parametrize("arch", ["Qwen3MoeForCausalLM", "MixtralForCausalLM", "Glm4MoeForCausalLM"])
def test_fp8_moe_checkpoint_decodes_like_its_dequantized_weights(arch, tmp_path):
    src = save_tiny_model(arch, tmp_path / "src", seed=5)
    n = write_fp8_moe_checkpoint(src, tmp_path / "fp8", tmp_path / "deq", BLOCK)
    names = load_file(str(tmp_path / "fp8" / "model.safetensors"))
    if arch == "MixtralForCausalLM":  # Mixtral's checkpoint names
        assert names["model.layers.1.block_sparse_moe.experts.3.w3.weight"].dtype == FP8_DTYPE
    fp8 = _llm(tmp_path / "fp8")
    model = fp8.core.runner.model
    experts = [m for m in model.modules() if isinstance(m, Fp8Experts)]
    assert experts and 3 * sum(m.num_experts for m in experts) == n
    assert all(m.gate_up_proj.dtype == FP8_DTYPE and m.down_proj.dtype == FP8_DTYPE for m in experts)
    assert all(m.gate_up_proj_scale.shape == (8, 4, 2) for m in experts)  # 64 rows / 16, 64 cols / 32
    assert not any(isinstance(m, Fp8Linear) for m in model.modules())  # modules_to_not_convert honoured
    routers = [lay.mlp.gate.weight for lay in model.model.layers if hasattr(lay.mlp, "experts")]
    assert routers and all(r.dtype == torch.float32 for r in routers)  # the router stays unquantized
    ref = _llm(tmp_path / "deq")
    prompts = make_prompts(seed=5)[::4]
    outs, refs = fp8.generate(prompts, GREEDY), ref.generate(prompts, GREEDY)
    for i, (o, r) in enumerate(zip(outs, refs, strict=True)):
        assert o.token_ids == r.token_ids, f"prompt {i}"
        torch.testing.assert_close(torch.tensor(o.logprobs), torch.tensor(r.logprobs), atol=1e-5, rtol=0)
    fp8.core.check_no_leaks()


def test_fp8_moe_misplaced_scale_changes_the_output(tmp_path):
    """The block scales are applied per tile: swapping two experts' scales moves the logits."""
    src = save_tiny_model("Qwen3MoeForCausalLM", tmp_path / "src", seed=6)
    write_fp8_moe_checkpoint(src, tmp_path / "fp8", tmp_path / "deq", BLOCK)
    model, _ = load_model(ModelConfig(str(tmp_path / "fp8"), device="cpu"))
    ids = torch.tensor([make_prompts(seed=6)[2]])
    with torch.no_grad():
        before = model(ids).logits.clone()
        mod = next(m for m in model.modules() if isinstance(m, Fp8Experts))
        mod.gate_up_proj_scale.data[:, [0, 1]] = mod.gate_up_proj_scale.data[:, [1, 0]]
        after = model(ids).logits
    assert (after - before).norm() > 1e-3 * before.norm()


def test_quantization_fp8_quantizes_moe_experts_per_row(tmp_path):
    src = save_tiny_model("Glm4MoeForCausalLM", tmp_path / "src", seed=7)
    state = load_file(str(src / "model.safetensors"))
    model, _ = load_model(ModelConfig(str(src), device="cpu", quantization="fp8"))
    mod = model.model.layers[1].mlp.experts
    assert isinstance(mod, Fp8Experts) and mod.block is None and mod.gate_up_proj_scale.shape == (8, 64)
    gate = torch.stack([state[f"model.layers.1.mlp.experts.{e}.gate_proj.weight"] for e in range(8)])
    up = torch.stack([state[f"model.layers.1.mlp.experts.{e}.up_proj.weight"] for e in range(8)])
    q, s = quantize_experts(torch.cat([gate, up], dim=1), None)
    assert torch.equal(mod.gate_up_proj.float(), q.float()) and torch.equal(mod.gate_up_proj_scale, s)
    # the shared expert and the attention through Fp8Linear per channel; the router unquantized
    shared = model.model.layers[1].mlp.shared_experts.gate_proj
    assert isinstance(shared, Fp8Linear) and shared.layout == "channel"
    assert model.model.layers[1].mlp.gate.weight.dtype == torch.float32
    llm = _llm(src, quantization="fp8")
    out = llm.generate([make_prompts(seed=7)[1]], GREEDY)[0]
    assert len(out.token_ids) == GREEDY.max_tokens
    llm.core.check_no_leaks()


def test_dummy_fp8_moe_experts_are_drawn_per_expert_and_seeded(tmp_path):
    cfg = tiny_config("Qwen3MoeForCausalLM")
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "config.json").write_text(cfg.to_json_string())
    mc = ModelConfig(str(tmp_path / "d"), load_format="dummy", device="cpu", quantization="fp8", seed=3)
    model, _ = load_model(mc)
    experts = [m for m in model.modules() if isinstance(m, Fp8Experts)]
    assert len(experts) == 2  # layers 0 and 2; layer 1 is dense (mlp_only_layers)
    floats = [n for n, p in model.named_parameters() if p.dim() == 3 and p.dtype != FP8_DTYPE]
    assert floats == []  # no full-precision stacked expert tensor
    w = dequantize_experts(experts[0].gate_up_proj.data, experts[0].gate_up_proj_scale.data, None,
                           torch.float32)
    assert 0.015 < float(w.std()) < 0.025 and not torch.equal(w[0], w[1])  # normal(0, 0.02), per expert
    again, _ = load_model(mc)
    assert torch.equal(next(m for m in again.modules() if isinstance(m, Fp8Experts)).down_proj.float(),
                       experts[0].down_proj.float())


def test_fp8_moe_refusals_name_the_reason(tmp_path):
    src = save_tiny_model("Qwen3MoeForCausalLM", tmp_path / "src", seed=8)
    write_fp8_moe_checkpoint(src, tmp_path / "fp8", tmp_path / "deq", BLOCK)
    path = tmp_path / "fp8"
    raw = json.loads((path / "config.json").read_text())

    def with_quant(**quant: object) -> Path:
        (path / "config.json").write_text(json.dumps({**raw, "quantization_config": {
            **raw["quantization_config"], **quant}}))
        return path

    with pytest.raises(UnsupportedModelError, match=r"activation_scheme 'static'.*weight-only"):
        load_model(ModelConfig(str(with_quant(activation_scheme="static", weight_block_size=None)),
                               device="cpu"))
    with pytest.raises(UnsupportedModelError, match="expert width 32 is not a multiple of the "
                                                    "weight_block_size height 24"):
        load_model(ModelConfig(str(with_quant(weight_block_size=[24, 32])), device="cpu"))
    with pytest.raises(ValueError, match="block width 24 is not a multiple of 16"):
        Fp8Experts(4, 64, 32, (16, 24), "cpu")
    with pytest.raises(ValueError, match="width 32: not a multiple of the block height 24"):
        Fp8Experts(4, 64, 32, (24, 32), "cpu")
    with pytest.raises(ValueError, match=r"layers\.0\.mlp\.experts\.\d+\.\S+: per-expert tensors of unq"):
        load_model(ModelConfig(str(with_quant(modules_to_not_convert=["model.layers.0.mlp.experts"])),
                               device="cpu"))
    state = load_file(str(path / "model.safetensors"))
    del state["model.layers.2.mlp.experts.5.up_proj.weight_scale_inv"]
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"lacks 1 tensors.*2\.mlp\.experts\.5\.up_proj\.weight_scale_inv"):
        load_model(ModelConfig(str(with_quant()), device="cpu"))


def test_glm_4_5_air_fp8_fits_one_h200_without_a_float_expert_tensor(tmp_path, monkeypatch):
    """The ``glm-4.5-air`` alias under ``--quantization fp8``, built on the meta device: every expert and
    decoder projection FP8 (no bf16 stacked expert tensor), about 101 GiB in all: one H200 (139 GiB
    usable) holds it with room for the KV cache."""
    from engine.models.fp8 import build_fp8_model
    from engine.models.loader import load_hf_config
    from engine.models.quant_config import Fp8Scheme
    from engine.models.registry import resolve_model

    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    cfg = load_hf_config(resolve_model("glm-4.5-air"), "fp8")
    model = build_fp8_model(cfg, Fp8Scheme(from_checkpoint=False), torch.bfloat16, torch.device("meta"))
    by_dtype: dict[torch.dtype, int] = {}
    for p in model.parameters():
        by_dtype[p.dtype] = by_dtype.get(p.dtype, 0) + p.numel() * p.element_size()
    experts = [m for m in model.modules() if isinstance(m, Fp8Experts)]
    assert len(experts) == 45 and experts[0].gate_up_proj.shape == (128, 2816, 4096)
    assert [n for n, p in model.named_parameters() if p.dim() == 3 and p.dtype != FP8_DTYPE] == []
    assert 100 * 2**30 < sum(by_dtype.values()) < 102 * 2**30
    assert by_dtype[torch.bfloat16] < 2.5e9  # embeddings and LM head (151552 x 4096 each), norms, routers


def test_fp8_moe_triton_kernels_in_the_fused_forward(tmp_path, monkeypatch):
    """The block-scaled Qwen3-MoE checkpoint through the fused forward with the Triton kernels (Triton's
    interpreter on a CPU, compiled on a GPU; the triton attention backend): every sparse layer's
    ``fused_moe`` call gets the FP8 weights with their scales, and the greedy tokens equal the plain-torch
    reference path's (logprobs within 1e-4: the same dequantized values, summed in another order)."""
    from engine.models import fused_model

    src = save_tiny_model("Qwen3MoeForCausalLM", tmp_path / "src", seed=9)
    write_fp8_moe_checkpoint(src, tmp_path / "fp8", tmp_path / "deq", BLOCK)
    calls: list[bool] = []
    real = fused_model.fused_moe
    monkeypatch.setattr(fused_model, "fused_moe", lambda x, w_up, *a, scales=None, **kw: calls.append(
        w_up.dtype == FP8_DTYPE and scales is not None and scales.block == BLOCK) or real(x, w_up, *a,
                                                                                      scales=scales, **kw))
    device = "cuda" if torch.cuda.is_available() else "cpu"  # compiled kernels read device tensors
    kernels = LLM(str(tmp_path / "fp8"), dtype="float32", device=device, attention_backend="triton",
                  block_size=4, num_blocks=64, fused_ops="on", max_num_batched_tokens=24)
    params = SamplingParams(temperature=0.0, max_tokens=2, logprobs=0)
    prompt = [make_prompts(seed=9)[3][:5]]  # a 5-token prefill, then a one-row step
    got = kernels.generate(prompt, params)[0]
    want = _llm(tmp_path / "fp8").generate(prompt, params)[0]
    assert calls and all(calls)
    assert got.token_ids == want.token_ids
    torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(want.logprobs), atol=1e-4, rtol=0)
    kernels.core.check_no_leaks()


def test_fp8_checkpoint_mtp_layer_skipped_other_extra_layers_refused(tmp_path, caplog):
    """A GLM-4.5 checkpoint stores its multi-token-prediction layer (``num_nextn_predict_layers: 1``) as
    ``model.layers.{num_hidden_layers}``: the FP8 loader skips its tensors with one INFO line counting
    them and decodes as without them; a layer past it, or the MTP layer's tensors when the config
    declares no MTP layer (``num_nextn_predict_layers: 0``), is still refused."""
    src = save_tiny_model("Glm4MoeForCausalLM", tmp_path / "src", seed=5)
    write_fp8_moe_checkpoint(src, tmp_path / "fp8", tmp_path / "deq", BLOCK)
    st_path, cfg_path = tmp_path / "fp8" / "model.safetensors", tmp_path / "fp8" / "config.json"
    state, raw = load_file(str(st_path)), json.loads(cfg_path.read_text())
    last, n = raw["num_hidden_layers"] - 1, raw["num_hidden_layers"]
    mtp = {k.replace(f"model.layers.{last}.", f"model.layers.{n}."): v.clone() for k, v in state.items()
           if k.startswith(f"model.layers.{last}.")}
    mtp |= {f"model.layers.{n}.eh_proj.weight": torch.ones(64, 128),
            f"model.layers.{n}.enorm.weight": torch.ones(64),
            f"model.layers.{n}.shared_head.head.weight": torch.ones(256, 64)}
    save_file({**state, **mtp}, str(st_path), metadata={"format": "pt"})
    cfg_path.write_text(json.dumps({**raw, "num_nextn_predict_layers": 1}))
    with caplog.at_level("INFO", logger="engine.models"):
        fp8 = _llm(tmp_path / "fp8")
    lines = [r.getMessage() for r in caplog.records if "multi-token-prediction" in r.getMessage()]
    assert lines == [f"skipped {len(mtp)} checkpoint tensors of the multi-token-prediction layers [{n}] "
                     "(not part of the decoder)"]
    assert len(fp8.core.runner.model.model.layers) == n
    ref = _llm(tmp_path / "deq")
    prompts = make_prompts(seed=5)[::8]
    outs, refs = fp8.generate(prompts, GREEDY), ref.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == [r.token_ids for r in refs]
    save_file({**state, **mtp, f"model.layers.{n + 1}.enorm.weight": torch.ones(64)}, str(st_path),
              metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"model\.layers\.{n + 1}\.enorm\.weight has no place"):
        load_model(ModelConfig(str(tmp_path / "fp8"), device="cpu"))
    save_file({**state, **mtp}, str(st_path), metadata={"format": "pt"})
    cfg_path.write_text(json.dumps({**raw, "num_nextn_predict_layers": 0}))
    with pytest.raises(ValueError, match=rf"model\.layers\.{n}\..* has no place"):
        load_model(ModelConfig(str(tmp_path / "fp8"), device="cpu"))
