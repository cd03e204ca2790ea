"""Loader, registry and GGUF-conversion tests: the supported architectures, dtypes, dummy weights, clear
errors for bad directories and refused models (Gemma, LongRoPE past its context, sliding windows),
cache-dir resolution, atomic conversion under a file lock."""

from __future__ import annotations

import json
import os
import re
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import (
    AutoModelForCausalLM,
    Glm4Config,
    Glm4MoeConfig,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    Phi3Config,
    PretrainedConfig,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
)

from engine.config import ModelConfig
from engine.models import gguf_convert, registry
from engine.models.loader import load_model

ARCHS = ["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"]
MOE_ARCHS = ["Qwen3MoeForCausalLM", "MixtralForCausalLM", "Glm4MoeForCausalLM"]
# Dense families beyond the Llama layout: Phi-3 (merged qkv_proj / gate_up_proj) and GLM-4 (interleaved
# rotary, norms after attention and after the MLP).
NEW_DENSE_ARCHS = ["Phi3ForCausalLM", "Glm4ForCausalLM"]
# Phi-3: half-width rotary and LongRoPE within its original context (the short factors, uneven so a
# wrong choice shows); GLM-4: its published config's half-width rotary and QKV biases.
DENSE_EXTRA: dict[str, dict[str, object]] = {
    "Phi3ForCausalLM": dict(rope_scaling=dict(rope_type="longrope", rope_theta=10000.0,
                                              partial_rotary_factor=0.5, short_factor=[1.0, 1.5, 2.0, 3.0],
                                              long_factor=[4.0] * 4),
                            original_max_position_embeddings=512, partial_rotary_factor=0.5, pad_token_id=0),
    "Glm4ForCausalLM": dict(head_dim=16, partial_rotary_factor=0.5, attention_bias=True, pad_token_id=0),
}
# Tiny mixture-of-experts shapes: 8 experts of width 32, top-2 (Qwen3-MoE: one dense layer through
# mlp_only_layers; GLM-4.5: a dense first layer, a shared expert, 2 groups with the best 1 kept, scaling,
# half-width rotary and q/k norms, as GLM-4.5's published config has them).
MOE_EXTRA: dict[str, dict[str, object]] = {
    "Qwen3MoeForCausalLM": dict(head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                norm_topk_prob=True, mlp_only_layers=[1], num_hidden_layers=3),
    "MixtralForCausalLM": dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=32),
    "Glm4MoeForCausalLM": dict(head_dim=16, n_routed_experts=8, num_experts_per_tok=2,
                               moe_intermediate_size=32, n_shared_experts=1, n_group=2, topk_group=1,
                               first_k_dense_replace=1,
                               routed_scaling_factor=2.5, norm_topk_prob=True, use_qk_norm=True,
                               num_hidden_layers=3, partial_rotary_factor=0.5),
}


def tiny_config(arch: str, vocab: int = 256) -> PretrainedConfig:
    """2 layers (the MoE ones: ``MOE_EXTRA``), hidden 64, 4 query heads / 2 KV heads (GQA), head_dim 16."""
    common = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=vocab,
        max_position_embeddings=512,
        initializer_range=0.2,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    cls = {
        "LlamaForCausalLM": LlamaConfig,
        "MistralForCausalLM": MistralConfig,
        "Qwen2ForCausalLM": Qwen2Config,
        "Qwen3ForCausalLM": Qwen3Config,
        "Qwen3MoeForCausalLM": Qwen3MoeConfig,
        "MixtralForCausalLM": MixtralConfig,
        "Glm4MoeForCausalLM": Glm4MoeConfig,
        "Phi3ForCausalLM": Phi3Config,
        "Glm4ForCausalLM": Glm4Config,
    }[arch]
    extra = {"head_dim": 16} if arch == "Qwen3ForCausalLM" else {**MOE_EXTRA, **DENSE_EXTRA}.get(arch, {})
    cfg = cls(**{**common, **extra})
    cfg.architectures = [arch]
    return cfg


def save_tiny_model(arch: str, path: Path, seed: int = 0, dtype: torch.dtype = torch.float32) -> Path:
    """Random-weight tiny model of ``arch`` saved as an HF directory (safetensors) at ``path``. The
    one-dimensional parameters (norm weights, biases), which transformers initialises to constants
    (ones, zeros), are drawn at random too (norm weights ``1 + 0.25 N(0, 1)``, biases ``0.1 N(0, 1)``),
    so that a norm applied with another layer's weight, or a bias left out, changes the output."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch), dtype=dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and "norm" in name:
                p.copy_(1 + 0.25 * torch.randn_like(p))
            elif p.dim() == 1 and name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
    model.save_pretrained(path)
    return path


@pytest.mark.parametrize("arch", ARCHS + NEW_DENSE_ARCHS)
def test_load_each_architecture_keeps_weights(arch, tmp_path):
    path = save_tiny_model(arch, tmp_path / arch)
    model, cfg = load_model(ModelConfig(str(path), dtype="float32", device="cpu"))
    assert type(model).__name__ == arch and cfg.architectures == [arch]
    saved = load_file(str(path / "model.safetensors"))
    state = model.state_dict()
    for name, tensor in saved.items():
        assert torch.equal(state[name], tensor), name
    assert not model.training and not any(p.requires_grad for p in model.parameters())


def test_dtype_auto_is_float32_on_cpu_checkpoint_half_on_gpu_and_override(tmp_path):
    from engine.models.loader import load_hf_config, resolve_dtype

    path = save_tiny_model("LlamaForCausalLM", tmp_path / "m", dtype=torch.bfloat16)
    auto, _ = load_model(ModelConfig(str(path), device="cpu"))
    assert {p.dtype for p in auto.parameters()} == {torch.float32}  # bf16 checkpoint, CPU → fp32
    cfg = load_hf_config(path)
    assert resolve_dtype("auto", cfg, torch.device("cuda")) == torch.bfloat16
    cfg.dtype = torch.float16
    assert resolve_dtype("auto", cfg, torch.device("cuda")) == torch.float16
    cfg.dtype = torch.float32  # a full-precision checkpoint is served in bf16 on a GPU
    assert resolve_dtype("auto", cfg, torch.device("cuda")) == torch.bfloat16
    for name, dtype in [("float16", torch.float16), ("float32", torch.float32)]:
        model, _ = load_model(ModelConfig(str(path), dtype=name, device="cpu"))
        assert {p.dtype for p in model.parameters()} == {dtype}


def test_dummy_weights_shapes_values_and_seed(tmp_path):
    cfg = tiny_config("Qwen2ForCausalLM")  # has q/k/v biases
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "config.json").write_text(cfg.to_json_string())
    mc = ModelConfig(str(tmp_path / "d"), load_format="dummy", dtype="float32", device="cpu", seed=7)
    model, _ = load_model(mc)
    ref = AutoModelForCausalLM.from_config(cfg)
    assert {k: v.shape for k, v in model.state_dict().items()} == {
        k: v.shape for k, v in ref.state_dict().items()
    }
    params = dict(model.named_parameters())
    assert torch.all(params["model.norm.weight"] == 1)
    assert torch.all(params["model.layers.0.self_attn.q_proj.bias"] == 0)
    w = params["model.layers.0.mlp.up_proj.weight"]
    assert abs(float(w.std()) - 0.02) < 0.002 and abs(float(w.mean())) < 0.002
    again, _ = load_model(mc)
    assert torch.equal(
        dict(again.named_parameters())["model.embed_tokens.weight"], params["model.embed_tokens.weight"]
    )


def test_llama3_8b_dummy_alias_is_config_only(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    path = registry.resolve_model("llama3-8b")
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["hidden_size"] == 4096 and cfg["num_key_value_heads"] == 8 and cfg["num_hidden_layers"] == 32
    assert not list(path.glob("*.safetensors"))
    # a dummy alias comes with a synthetic tokenizer; load_format "auto" loads it with dummy weights
    # (checked on the CPU-sized alias in tests/engine/test_dummy_model.py: 8B in fp32 would not fit here)
    assert (path / "tokenizer.json").is_file()


@pytest.mark.parametrize(("alias", "arch", "total", "active"), [
    ("qwen3-30b-a3b", "Qwen3MoeForCausalLM", 30.53, 3.35),  # published: 30.5B total, 3.3B active
    ("mixtral-8x7b", "MixtralForCausalLM", 46.70, 12.88),  # 46.7B, 12.9B
    ("glm-4.5-air", "Glm4MoeForCausalLM", 106.85, 13.42),  # 106B, 12B active without the embeddings
])
def test_moe_dummy_aliases_have_the_published_sizes(alias, arch, total, active, tmp_path, monkeypatch):
    """Each MoE shape alias builds (on the meta device: no memory) the model of its published config:
    total and active parameters (dense parts + top-k of each layer's experts) in billions."""
    from transformers import AutoConfig

    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    path = registry.resolve_model(alias)
    assert registry.is_dummy_alias(alias) and (path / "tokenizer.json").is_file()
    registry.read_model_config(path)  # passes the launcher's check
    cfg = AutoConfig.from_pretrained(str(path))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    assert type(model).__name__ == arch
    params = dict(model.named_parameters())
    experts = sum(p.numel() for n, p in params.items() if ".experts." in n)
    num_experts = next(lay.mlp.experts.gate_up_proj.shape[0] for lay in model.model.layers
                       if hasattr(lay.mlp, "experts"))
    all_params = sum(p.numel() for p in params.values())
    assert all_params / 1e9 == pytest.approx(total, abs=0.01)
    on = all_params - experts + experts * cfg.num_experts_per_tok / num_experts
    assert on / 1e9 == pytest.approx(active, abs=0.01)


def test_unsupported_architecture_named(tmp_path):
    cfg = GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)
    GPT2LMHeadModel(cfg).save_pretrained(tmp_path / "gpt2")
    with pytest.raises(ValueError, match=r"unsupported architecture.*GPT2LMHeadModel"):
        load_model(ModelConfig(str(tmp_path / "gpt2"), device="cpu"))


@pytest.mark.parametrize("method", ["awq", "gptq", "bitsandbytes", "compressed-tensors"])
def test_quantized_checkpoint_refused_before_weights_are_read(method, tmp_path, monkeypatch):
    """A worker's loader refuses any ``quantization_config`` method by name, listing what is supported,
    before it opens a weight file (here the weights are garbage: reading them would fail differently)."""
    path = save_tiny_model("LlamaForCausalLM", tmp_path / "m")
    raw = json.loads((path / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": method, "bits": 4}
    (path / "config.json").write_text(json.dumps(raw))
    (path / "model.safetensors").write_bytes(b"not a safetensors file")
    opened = []
    monkeypatch.setattr("engine.models.loader.safe_open", lambda *a, **k: opened.append(a) or 1 / 0)
    with pytest.raises(registry.UnsupportedModelError,
                       match=rf"unsupported quantization method '{method}'.*supported: fp8$"):
        load_model(ModelConfig(str(path), device="cpu"))
    assert opened == []


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_load_each_moe_architecture_merges_per_expert_checkpoints(arch, tmp_path):
    """``save_pretrained`` writes one tensor per expert projection (the published checkpoints' layout);
    the loaded model holds them stacked per layer, every value kept."""
    path = save_tiny_model(arch, tmp_path / arch)
    saved = load_file(str(path / "model.safetensors"))
    model, cfg = load_model(ModelConfig(str(path), dtype="float32", device="cpu"))
    assert type(model).__name__ == arch and cfg.architectures == [arch]
    layer = next(lay for lay in model.model.layers if hasattr(lay.mlp, "experts"))
    i = int(layer.self_attn.layer_idx)
    gate = saved.get(f"model.layers.{i}.mlp.experts.3.gate_proj.weight")
    if gate is None:  # Mixtral's original names: w1 gate, w3 up, w2 down
        gate = saved[f"model.layers.{i}.block_sparse_moe.experts.3.w1.weight"]
    inter = gate.shape[0]
    assert torch.equal(layer.mlp.experts.gate_up_proj[3, :inter], gate)


def test_sliding_window_shorter_than_max_model_len_refused(tmp_path):
    """Mistral's ``sliding_window`` (and Qwen's with ``use_sliding_window``) is not silently run as full
    attention: refused while a sequence could outgrow it, accepted once ``max_model_len`` fits in it."""
    cfg = tiny_config("MistralForCausalLM")
    cfg.sliding_window = 64  # max_position_embeddings 512
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "m")
    with pytest.raises(ValueError, match=r"sliding_window=64 < max_model_len=512: sliding-window attention "
                                         r"is not supported.*max_model_len <= 64"):
        load_model(ModelConfig(str(tmp_path / "m"), device="cpu"))
    with pytest.raises(ValueError, match=r"sliding_window=64 < max_model_len=65"):
        load_model(ModelConfig(str(tmp_path / "m"), device="cpu", max_model_len=65))
    model, _ = load_model(ModelConfig(str(tmp_path / "m"), device="cpu", max_model_len=64))
    assert model.config.sliding_window == 64


@pytest.mark.parametrize(("arch", "named"), [
    ("Gemma2ForCausalLM", r"sliding-window attention layers .* not supported .* nor is its attention logit "
                          r"soft-capping"),
    ("Gemma3ForCausalLM", r"sliding-window attention layers \(interleaved with global ones\) are not "
                          r"supported"),
])
def test_gemma_refused_before_weights_naming_why(arch, named, tmp_path):
    """Gemma 2/3 (sliding-window layers, Gemma 2's soft-capped attention logits) are refused from their
    config.json alone, with the reason, not run with full attention."""
    (tmp_path / "config.json").write_text(json.dumps({"architectures": [arch], "vocab_size": 64}))
    with pytest.raises(registry.UnsupportedModelError, match=rf"architecture {arch} .*{named}.*supported: "):
        load_model(ModelConfig(str(tmp_path), device="cpu"))


def test_longrope_past_original_context_refused(tmp_path):
    """Phi-3's LongRoPE runs while sequences stay within ``original_max_position_embeddings`` (the short
    factors, as transformers uses them there); a ``max_model_len`` beyond it is refused, naming both."""
    cfg = tiny_config("Phi3ForCausalLM")
    cfg.max_position_embeddings = 1024  # original_max_position_embeddings 512
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "m")
    with pytest.raises(ValueError, match=r"rope_scaling longrope with max_model_len=1024 > "
                                         r"original_max_position_embeddings=512.*max_model_len <= 512"):
        load_model(ModelConfig(str(tmp_path / "m"), device="cpu"))
    with pytest.raises(ValueError, match=r"max_model_len=513 > original_max_position_embeddings=512"):
        load_model(ModelConfig(str(tmp_path / "m"), device="cpu", max_model_len=513))
    model, _ = load_model(ModelConfig(str(tmp_path / "m"), device="cpu", max_model_len=512))
    assert type(model).__name__ == "Phi3ForCausalLM"


@pytest.mark.parametrize("arch", NEW_DENSE_ARCHS)
def test_new_dense_refuse_fp8_and_tensor_parallelism(arch, tmp_path):
    """Phi-3 and GLM-4 load as they are; FP8 (``--quantization fp8``) and tensor parallelism, which
    handle the Llama layout only, are refused naming the architecture."""
    from engine.models.tensor_parallel import check_tensor_parallel

    path = save_tiny_model(arch, tmp_path / "m")
    model, cfg = load_model(ModelConfig(str(path), dtype="float32", device="cpu"))
    assert type(model).__name__ == arch
    with pytest.raises(registry.UnsupportedModelError, match=rf"FP8 weights for {arch} .* not supported"):
        load_model(ModelConfig(str(path), device="cpu", quantization="fp8"))
    with pytest.raises(ValueError, match=rf"tensor_parallel_size=2: {arch} is not supported with tensor "
                                         r"parallelism"):
        check_tensor_parallel(cfg, 2)


def test_missing_config_weights_and_unknown_path(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"no config\.json"):
        load_model(ModelConfig(str(tmp_path / "empty"), device="cpu"))
    (tmp_path / "noweights").mkdir()
    (tmp_path / "noweights" / "config.json").write_text(tiny_config("LlamaForCausalLM").to_json_string())
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors"):
        load_model(ModelConfig(str(tmp_path / "noweights"), device="cpu"))
    with pytest.raises(FileNotFoundError, match="not a directory and not a known alias"):
        load_model(ModelConfig(str(tmp_path / "nope"), device="cpu"))
    (tmp_path / "badjson").mkdir()
    (tmp_path / "badjson" / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_model(ModelConfig(str(tmp_path / "badjson"), device="cpu"))


def _rewrite(path: Path, add: dict[str, torch.Tensor] | None = None, drop: tuple[str, ...] = (),
             **config: object) -> dict[str, torch.Tensor]:
    """Rewrite the tiny checkpoint at ``path`` with tensors added / dropped and config keys changed;
    returns the tensors written."""
    state = {k: v for k, v in load_file(str(path / "model.safetensors")).items() if k not in drop}
    state |= add or {}
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    if config:
        raw = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**raw, **config}))
    return state


@pytest.mark.parametrize(("extra", "drop", "words"), [
    ({"model.layers.0.mlp.extra_proj.weight": torch.zeros(4, 4, dtype=torch.bfloat16)}, (),
     r": 1 tensors have no place in the model, e\.g\. \['model\.layers\.0\.mlp\.extra_proj\.weight'\]"),
    ({}, ("model.layers.1.post_attention_layernorm.weight",),
     r" lacks 1 tensors of the model, e\.g\. \['model\.layers\.1\.post_attention_layernorm\.weight'\]"),
])
def test_bf16_checkpoint_extra_or_missing_tensor_refused_naming_it(tmp_path, extra, drop, words):
    path = save_tiny_model("LlamaForCausalLM", tmp_path / "m", dtype=torch.bfloat16)
    _rewrite(path, extra, drop=drop)
    with pytest.raises(ValueError, match=rf"checkpoint {re.escape(str(path))}{words}"):
        load_model(ModelConfig(str(path), device="cpu"))


def test_mistral_original_format_copy_beside_the_shards_is_not_read(tmp_path):
    """Mistral's repositories ship ``consolidated.safetensors`` (their own tensor names) beside the
    transformers checkpoint: every loader reads only the checkpoint's files, as transformers does, so the
    plain and the tensor-parallel loads both succeed; with an index, only the files it names are read."""
    from engine.models.loader import checkpoint_files
    from engine.models.tensor_parallel import TensorParallel, load_sharded_model

    path = save_tiny_model("MistralForCausalLM", tmp_path / "m")
    state = load_file(str(path / "model.safetensors"))
    native = {"tok_embeddings.weight": state["model.embed_tokens.weight"],
              "output.weight": state["lm_head.weight"]}
    save_file(native, str(path / "consolidated.safetensors"), metadata={"format": "pt"})
    assert checkpoint_files(path) == [path / "model.safetensors"]
    model, _ = load_model(ModelConfig(str(path), dtype="float32", device="cpu"))
    assert torch.equal(model.model.norm.weight, state["model.norm.weight"])
    sharded, _ = load_sharded_model(ModelConfig(str(path), dtype="float32", device="cpu"),
                                 TensorParallel(rank=0, size=2), torch.device("cpu"))
    assert sharded.model.norm.weight.shape == state["model.norm.weight"].shape
    (path / "model.safetensors").rename(path / "model-00001-of-00001.safetensors")
    assert checkpoint_files(path) == [path / "model-00001-of-00001.safetensors"]
    (path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {k: "model-00001-of-00001.safetensors" for k in state}}))
    assert checkpoint_files(path) == [path / "model-00001-of-00001.safetensors"]
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "gone.safetensors"}}))
    with pytest.raises(FileNotFoundError, match="absent"):
        checkpoint_files(path)


def test_checkpoint_rotary_inv_freq_buffers_are_ignored(tmp_path):
    path = save_tiny_model("LlamaForCausalLM", tmp_path / "m")
    saved = _rewrite(path, {"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)})
    model, _ = load_model(ModelConfig(str(path), dtype="float32", device="cpu"))
    assert torch.equal(model.model.norm.weight, saved["model.norm.weight"])


def test_bf16_checkpoint_mtp_layer_skipped_other_extra_layers_refused(tmp_path, caplog):
    """GLM-4.5 stores its multi-token-prediction layer (``num_nextn_predict_layers: 1``) as
    ``model.layers.{num_hidden_layers}``: its tensors are skipped with one INFO line counting them and
    every decoder weight loads; a layer past it, or that layer when the config declares no MTP layer, is
    refused (transformers' own GLM-4.5 ignore patterns hide neither)."""
    path = save_tiny_model("Glm4MoeForCausalLM", tmp_path / "m", seed=3)
    n = json.loads((path / "config.json").read_text())["num_hidden_layers"]
    mtp = {f"model.layers.{n}.eh_proj.weight": torch.ones(64, 128), f"model.layers.{n}.enorm.weight":
           torch.ones(64), f"model.layers.{n}.self_attn.q_proj.weight": torch.ones(64, 64)}
    saved = _rewrite(path, mtp, num_nextn_predict_layers=1)
    with caplog.at_level("INFO", logger="engine.models"):
        model, _ = load_model(ModelConfig(str(path), dtype="float32", device="cpu"))
    lines = [r.getMessage() for r in caplog.records if "multi-token-prediction" in r.getMessage()]
    assert lines == [f"skipped 3 checkpoint tensors of the multi-token-prediction layers [{n}] "
                     "(not part of the decoder)"]
    assert len(model.model.layers) == n
    state = model.state_dict()
    assert torch.equal(state[f"model.layers.{n - 1}.self_attn.q_proj.weight"],
                       saved[f"model.layers.{n - 1}.self_attn.q_proj.weight"])
    _rewrite(path, {f"model.layers.{n + 1}.enorm.weight": torch.ones(64)})
    with pytest.raises(ValueError, match=rf"model\.layers\.{n + 1}\.enorm\.weight.*not declared by "
                                         "num_nextn_predict_layers"):
        load_model(ModelConfig(str(path), device="cpu"))
    _rewrite(path, drop=(f"model.layers.{n + 1}.enorm.weight",), num_nextn_predict_layers=0)
    with pytest.raises(ValueError, match=rf"3 tensors have no place in the model.*model\.layers\.{n}\."):
        load_model(ModelConfig(str(path), device="cpu"))


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_corrupt_safetensors_named(tmp_path, damage):
    path = save_tiny_model("LlamaForCausalLM", tmp_path / "m")
    weights = path / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(b"\x00garbage" * 8 if damage == "garbage" else data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"corrupt safetensors file .*model\.safetensors"):
        load_model(ModelConfig(str(path), device="cpu"))


def test_cache_dir_precedence(monkeypatch, tmp_path):
    monkeypatch.delenv("PDSERVE_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert registry.cache_dir() == tmp_path / "xdg" / "pdserve"
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "explicit"))
    assert registry.cache_dir() == tmp_path / "explicit"
    monkeypatch.delenv("PDSERVE_CACHE_DIR")
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert registry.cache_dir() == Path.home() / ".cache" / "pdserve"


def test_conversion_failure_leaves_nothing(tmp_path, monkeypatch):
    def broken(gguf_path, out, dtype):
        (out / "config.json").write_text("{}")
        raise RuntimeError("disk full")

    monkeypatch.setattr(gguf_convert, "_write_hf_dir", broken)
    fake = tmp_path / "x.gguf"
    fake.write_bytes(b"GGUF")
    with pytest.raises(RuntimeError, match="disk full"):
        gguf_convert.convert_gguf_to_hf(fake, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")) == ["x.gguf"]


def test_concurrent_conversions_run_once_and_never_expose_half_dir(tmp_path, monkeypatch):
    calls = []

    def slow(gguf_path, out, dtype):
        calls.append(out)
        (out / "config.json").write_text("{}")
        time.sleep(0.3)
        (out / "model.safetensors").write_text("w")

    monkeypatch.setattr(gguf_convert, "_write_hf_dir", slow)
    fake = tmp_path / "x.gguf"
    fake.write_bytes(b"GGUF")
    target = tmp_path / "out"
    seen: list[list[str]] = []

    def worker():
        result = gguf_convert.convert_gguf_to_hf(fake, target)
        seen.append(sorted(os.listdir(result)))

    threads = [threading.Thread(target=worker) for _ in range(3)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):  # whenever the target exists, it is complete
        if target.exists():
            assert (target / "model.safetensors").exists()
        time.sleep(0.01)
    assert len(calls) == 1
    assert seen == [["config.json", "model.safetensors"]] * 3


def test_missing_gguf_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        gguf_convert.convert_gguf_to_hf(tmp_path / "none.gguf", tmp_path / "out")


@pytest.mark.slow
def test_embedded_model_converted_bf16_with_tokenizer_and_template():
    path = registry.resolve_model("smollm2-135m")  # user cache; converts once (~25 s) if absent
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["num_hidden_layers"] == 30
    assert cfg["num_key_value_heads"] == 3 and cfg["vocab_size"] == 49152
    weights = load_file(str(path / "model.safetensors"))
    assert {t.dtype for t in weights.values()} == {torch.bfloat16}
    assert (path / "tokenizer.json").is_file()
    assert "im_start" in (path / "chat_template.jinja").read_text()



@pytest.mark.parametrize("arch", ["Glm4ForCausalLM", "Phi3ForCausalLM"])
def test_a_default_pad_token_id_outside_the_vocabulary_is_dropped(arch, tmp_path, caplog):
    """A new-user trial: a GLM-4 config with 49152 tokens and no pad_token_id took transformers' default
    151329 (Phi-3's: 32000), which transformers passes to nn.Embedding as padding_idx: "AssertionError:
    Padding_idx must be within num_embeddings". Serving needs no padding index, so such an id is dropped
    and the model loads, dummy or from a checkpoint (same weights); an id inside the vocabulary is kept."""
    cfg = tiny_config(arch, vocab=300)
    torch.manual_seed(0)
    saved = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)  # pad_token_id=0 here
    saved.save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw.pop("pad_token_id")
    (tmp_path / "config.json").write_text(json.dumps(raw))
    for load_format in ("dummy", "auto"):
        caplog.clear()
        with caplog.at_level("INFO", logger="engine.models.loader"):
            model, hf_config = load_model(ModelConfig(str(tmp_path), dtype="float32", device="cpu",
                                                      load_format=load_format))
        assert hf_config.pad_token_id is None and model.model.embed_tokens.padding_idx is None
        default = 151329 if arch == "Glm4ForCausalLM" else 32000
        assert [r.getMessage() for r in caplog.records if r.name == "engine.models.loader"] == [
            f"pad_token_id={default} is outside the vocabulary (vocab_size=300): not used (serving needs no "
            "padding index)"]
        assert model.model.embed_tokens.weight.shape[0] == 300
    torch.testing.assert_close(model.model.embed_tokens.weight, saved.model.embed_tokens.weight)
    (tmp_path / "config.json").write_text(json.dumps({**raw, "pad_token_id": 7}))
    _, hf_config = load_model(ModelConfig(str(tmp_path), dtype="float32", device="cpu", load_format="dummy"))
    assert hf_config.pad_token_id == 7
