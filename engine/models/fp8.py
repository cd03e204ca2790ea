"""FP8 projections in a transformers model: the ``Fp8Linear`` module, building a model whose decoder
projections are FP8, and loading its weights (an FP8 checkpoint, a bf16/fp16/fp32 checkpoint quantized
per output feature on load, or dummy weights).

The model is built on the meta device (no memory), its decoder layers' ``nn.Linear`` projections
(q/k/v/o, gate/up/down, minus the scheme's ignored modules) replaced by ``Fp8Linear``, then allocated on
the target device; the rotary modules (whose non-persistent ``inv_freq`` buffers the meta build cannot
hold) are rebuilt there. Weights are then streamed from the safetensors files tensor by tensor, so a
checkpoint never exists in memory twice and a bf16 checkpoint quantized on load needs one projection's
bf16 copy at a time. The GEMMs are ``engine.ops.fp8_gemm.fp8_linear`` (checkpoint formats:
``engine.models.quant_config``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, PretrainedConfig

from engine.models.fp8_moe import (
    ExpertLoader,
    Fp8Experts,
    checkpoint_name,
    expert_key,
    init_dummy_experts,
    replace_experts,
)
from engine.models.mtp import is_mtp_key, log_skipped, mtp_layers
from engine.models.quant_config import Fp8Scheme
from engine.ops.fp8_gemm import fp8_linear
from engine.ops.fp8_weight import FP8_DTYPE, Fp8Weight, quantize_weight_blocks, quantize_weight_per_channel

# names of the decoder projections made FP8 (the attention's and the dense MLP's)
FP8_PROJECTIONS = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"})


class Fp8Linear(torch.nn.Module):
    """A linear layer with an FP8 weight: ``forward(x [..., K]) -> [..., N]`` in ``x.dtype``.

    Parameters (state-dict names as in FP8 checkpoints): ``weight`` float8_e4m3fn ``[N, K]``,
    ``weight_scale`` float32 (``[1]``, ``[N]`` or ``[ceil(N / bn), ceil(K / bk)]``; the checkpoints'
    ``weight_scale_inv`` of the block format loads into it), ``input_scale`` float32 ``[1]`` (static
    activation scales only), ``bias`` in the model dtype when the projection has one. ``fp8`` is the
    ``Fp8Weight`` view of them the GEMM takes. Kernels (Triton, ``torch._scaled_mm``) run on CUDA; on a
    CPU the plain-torch references.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                 block: tuple[int, int] | None, static_activations: bool, device: torch.device | str) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = torch.nn.Parameter(
            torch.empty(out_features, in_features, dtype=FP8_DTYPE, device=device), requires_grad=False)
        if block is not None:
            shape: tuple[int, ...] = (-(-out_features // block[0]), -(-in_features // block[1]))
            self.layout = "block"
        else:
            shape, self.layout = (out_features,), "channel"
        self.block = block
        self.weight_scale = torch.nn.Parameter(torch.ones(shape, dtype=torch.float32, device=device),
                                               requires_grad=False)
        self.input_scale = (torch.nn.Parameter(torch.ones(1, dtype=torch.float32, device=device),
                                               requires_grad=False) if static_activations else None)
        self.bias = (torch.nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device),
                                        requires_grad=False) if bias else None)
        self.fp8 = self._view()

    def _view(self) -> Fp8Weight:
        inp = self.input_scale.data if self.input_scale is not None else None
        return Fp8Weight(self.weight.data, self.weight_scale.data, self.layout, self.block, inp)

    def bind(self, fp8: Fp8Weight | None = None) -> None:
        """Re-point the parameters to ``fp8``'s tensors (or re-read them after they were re-allocated)."""
        if fp8 is not None:
            self.weight = torch.nn.Parameter(fp8.weight, requires_grad=False)
            self.weight_scale = torch.nn.Parameter(fp8.scale, requires_grad=False)
            self.layout, self.block = fp8.layout, fp8.block
            if fp8.input_scale is not None:
                self.input_scale = torch.nn.Parameter(fp8.input_scale, requires_grad=False)
        self.fp8 = self._view()

    def set_scale(self, scale: torch.Tensor) -> None:
        """Load a checkpoint's per-tensor (``[]``/``[1]``) or per-channel (``[N]``/``[N, 1]``) weight scale,
        or its block scales; the layout follows the shape. Raises ValueError for any other shape."""
        scale = scale.float()
        if self.layout == "block":
            if tuple(scale.shape) != tuple(self.weight_scale.shape):
                raise ValueError(f"block scale of shape {list(scale.shape)}, expected "
                                 f"{list(self.weight_scale.shape)}")
            self.weight_scale.data.copy_(scale)
        elif scale.numel() == 1:
            self.layout = "tensor"
            self.weight_scale = torch.nn.Parameter(scale.reshape(1).to(self.weight.device),
                                                   requires_grad=False)
        elif scale.numel() == self.out_features and scale.shape[0] == self.out_features:
            self.layout = "channel"
            self.weight_scale = torch.nn.Parameter(scale.reshape(-1).to(self.weight.device).contiguous(),
                                                   requires_grad=False)
        else:
            raise ValueError(f"weight scale of shape {list(scale.shape)} for a [{self.out_features}, "
                             f"{self.in_features}] weight: expected one value or one per output feature")
        self.bind()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        y = fp8_linear(flat, self.fp8, self.bias, use_kernels=flat.is_cuda)
        return y.reshape(*x.shape[:-1], self.out_features)


def fp8_mergeable(linears: list[Fp8Linear]) -> bool:
    """Whether ``merge_fp8`` can concatenate ``linears``: False for block-scaled parts whose row counts are
    not multiples of their common block height (a scale row would cover rows of two projections, e.g.
    GLM-4.5-Air's dense gate/up of 10944 rows in 128-row blocks) or whose block shapes differ."""
    blocks = {lin.block for lin in linears if lin.layout == "block"}
    if not blocks:
        return True
    block = next(iter(blocks))
    return len(blocks) == 1 and block is not None and all(lin.out_features % block[0] == 0 for lin in linears)


def merge_fp8(linears: list[Fp8Linear]) -> tuple[Fp8Weight, torch.Tensor | None]:
    """Concatenate FP8 projections along the output dim (the fused forward's QKV and gate/up) and re-point
    each module's parameters to its slice, so nothing is stored twice. Per-tensor scales become
    per-channel; static input scales merge to their maximum (no activation overflows its range).

    Raises:
        ValueError: block-scaled parts whose row count is not a multiple of ``block_n`` (their scale tiles
            would straddle two projections), mixed layouts or activation schemes, or a bias on only some.
    """
    layouts = {lin.layout if lin.layout == "block" else "scaled" for lin in linears}
    statics = {lin.input_scale is not None for lin in linears}
    if len(layouts) != 1 or len(statics) != 1:
        raise ValueError("cannot merge FP8 projections with different scale layouts or activation schemes")
    has_bias = [lin.bias is not None for lin in linears]
    if any(has_bias) and not all(has_bias):
        raise ValueError("cannot merge projections where only some have a bias")
    weight = torch.cat([lin.weight.data for lin in linears], dim=0)
    bias = torch.cat([lin.bias.data for lin in linears], dim=0) if all(has_bias) else None  # type: ignore[union-attr]
    if layouts == {"block"}:
        block = linears[0].block
        assert block is not None
        ragged = [lin.out_features for lin in linears if lin.out_features % block[0]]
        if ragged or any(lin.block != block for lin in linears):
            raise ValueError(f"cannot merge block-scaled FP8 projections of {ragged} rows: not multiples of "
                             f"the block height {block[0]}")
        scale = torch.cat([lin.weight_scale.data for lin in linears], dim=0)
        merged = Fp8Weight(weight, scale, "block", block)
        row_scale = block[0]
    else:
        scale = torch.cat([lin.weight_scale.data.expand(lin.out_features) for lin in linears]).contiguous()
        inp = (torch.stack([lin.input_scale.data for lin in linears]).amax(0)  # type: ignore[union-attr]
               if statics == {True} else None)
        merged = Fp8Weight(weight, scale, "channel", None, inp)
        row_scale = 1
    start = 0
    for lin in linears:
        rows = lin.out_features
        scales = merged.scale[start // row_scale:(start + rows) // row_scale]
        part = Fp8Weight(weight[start:start + rows], scales, merged.layout, merged.block, merged.input_scale)
        lin.bind(part)
        if bias is not None:
            lin.bias = torch.nn.Parameter(bias[start:start + rows], requires_grad=False)
        start += rows
    return merged, bias


def _fp8_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module, str, torch.nn.Linear]]:
    """``(full name, parent, attribute, linear)`` of each decoder projection to make FP8."""
    found = []
    for name, module in model.named_modules():
        for attr, child in module.named_children():
            if attr in FP8_PROJECTIONS and isinstance(child, torch.nn.Linear) and ".layers." in f".{name}.":
                found.append((f"{name}.{attr}", module, attr, child))
    return found


def build_fp8_model(hf_config: PretrainedConfig, scheme: Fp8Scheme, dtype: torch.dtype,
                    device: torch.device) -> Any:
    """An uninitialised transformers causal LM on ``device`` whose decoder projections are ``Fp8Linear``
    and whose mixture-of-experts experts are ``engine.models.fp8_moe.Fp8Experts`` (those ``scheme``
    ignores stay unquantized), its other parameters in ``dtype``, tied weights tied. Built on the meta
    device first: no full-precision copy of an FP8 weight is ever allocated. Returns the model (values
    undefined until loaded).

    Raises:
        ValueError: block-scaled experts whose width is not a multiple of the block height."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    static = scheme.from_checkpoint and scheme.static_activations
    for full, parent, attr, lin in _fp8_modules(model):
        if scheme.is_ignored(full):
            continue
        setattr(parent, attr, Fp8Linear(lin.in_features, lin.out_features, lin.bias is not None, dtype,
                                         scheme.block, static, "meta"))
    replace_experts(model, scheme, "meta")
    model.to_empty(device=device)
    for name, module in list(model.named_modules()):
        if isinstance(module, Fp8Linear):
            module.bind()
        elif hasattr(module, "inv_freq") and hasattr(module, "config"):  # rotary: recompute its buffers
            parent_name, _, attr = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, attr, type(module)(module.config).to(device))
    model.tie_weights()
    return model


def _persistent_buffers(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The buffers a checkpoint stores (``to_empty`` leaves them undefined): name -> tensor."""
    state = model.state_dict(keep_vars=True)
    return {n: b for n, b in model.named_buffers() if n in state}


def _quantize_into(lin: Fp8Linear, weight: torch.Tensor) -> None:
    fw = quantize_weight_blocks(weight, lin.block) if lin.block else quantize_weight_per_channel(weight)
    lin.weight.data.copy_(fw.weight)
    if lin.layout == "block":
        lin.weight_scale.data.copy_(fw.scale)
    else:
        lin.set_scale(fw.scale)
    lin.bind()


@torch.no_grad()
def init_dummy_fp8(model: torch.nn.Module, seed: int) -> None:
    """Dummy weights as ``loader.init_dummy_weights`` draws them (matrices ~ normal(0, 0.02), norms 1,
    other vectors and buffers 0), each ``Fp8Linear``'s drawn in the model dtype on its device and quantized
    (per block, else per output feature), one projection at a time, ``Fp8Experts`` one expert at a time
    (``init_dummy_experts``); seeded, so equal on every worker."""
    first = next(model.parameters())
    gen = torch.Generator(device=first.device).manual_seed(seed)
    dtype = next(p.dtype for p in model.parameters() if p.dtype != FP8_DTYPE)
    fp8_params = set()
    for module in model.modules():
        if isinstance(module, Fp8Linear):
            w = torch.empty(module.out_features, module.in_features, dtype=dtype, device=first.device)
            _quantize_into(module, w.normal_(0.0, 0.02, generator=gen))
            fp8_params.update({id(module.weight), id(module.weight_scale)})
            if module.input_scale is not None:
                fp8_params.add(id(module.input_scale))
        elif isinstance(module, Fp8Experts):
            init_dummy_experts(module, dtype, gen)
            fp8_params.update(id(p) for p in module.parameters())
    for buf in _persistent_buffers(model).values():
        buf.zero_()
    for name, param in model.named_parameters():
        if id(param) in fp8_params:
            continue
        if param.dim() >= 2:
            param.normal_(0.0, 0.02, generator=gen)
        elif "norm" in name:
            param.fill_(1.0)
        else:
            param.zero_()


@torch.no_grad()
def load_fp8_weights(model: torch.nn.Module, files: list[Path], scheme: Fp8Scheme) -> None:
    """Stream every tensor of ``files`` into ``model`` (built by ``build_fp8_model``): FP8 weights and
    their scales into ``Fp8Linear`` modules (block scales from ``*.weight_scale_inv``, per-tensor or
    per-channel ones from ``*.weight_scale``, static ``*.input_scale``), float weights of an ``Fp8Linear``
    quantized on load (only when ``scheme`` does not come from the checkpoint), expert tensors (per
    expert, or stacked) into their ``Fp8Experts`` (``engine.models.fp8_moe.ExpertLoader``), everything
    else copied. Mixtral's ``block_sparse_moe`` names load as ``mlp``. Tensors of the multi-token-prediction
    layers (``mtp_layers``) are skipped, with one INFO line counting them.

    Raises:
        ValueError: a tensor the model has no place for, a parameter no file provides, a shape mismatch,
            or a float weight for an FP8 projection of an FP8 checkpoint (each named).
    """
    fp8_mods = {name: m for name, m in model.named_modules() if isinstance(m, Fp8Linear)}
    experts = ExpertLoader({n: m for n, m in model.named_modules() if isinstance(m, Fp8Experts)}, scheme)
    params = dict(model.named_parameters())  # tied parameters appear once
    expected = {n for n in params if n.rpartition(".")[0] not in fp8_mods
                and n.rpartition(".")[0] not in experts.modules}
    buffers = _persistent_buffers(model)  # e.g. GLM-4.5's router e_score_correction_bias
    targets: dict[str, torch.Tensor] = {**params, **buffers}
    expected |= set(buffers)
    expected |= {f"{n}.weight" for n in fp8_mods} | {f"{n}.weight_scale" for n, m in fp8_mods.items()
                                                    if m.layout == "block" or scheme.from_checkpoint}
    expected |= {f"{n}.input_scale" for n, m in fp8_mods.items() if m.input_scale is not None}
    expected |= {f"{n}.bias" for n, m in fp8_mods.items() if m.bias is not None}
    loaded: set[str] = set()
    mtp = mtp_layers(getattr(model, "config", None))
    skipped = 0
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as handle:
            for key in list(handle.keys()):
                if key.endswith("rotary_emb.inv_freq"):  # older checkpoints store the recomputed buffer
                    continue
                if is_mtp_key(key, mtp):
                    skipped += 1
                    continue
                tensor = handle.get_tensor(key)
                ekey = expert_key(checkpoint_name(key))
                if ekey is not None and experts.load(ekey, key, tensor):
                    continue
                if ekey is not None and ekey.expert is not None:
                    raise ValueError(f"{f.name}: {key}: per-expert tensors of unquantized experts (left out "
                                     "by the quantization_config) are not supported")
                key = checkpoint_name(key)
                prefix, _, leaf = key.rpartition(".")
                name = f"{prefix}.weight_scale" if leaf == "weight_scale_inv" else key
                mod = fp8_mods.get(prefix)
                if mod is not None and leaf in ("weight", "weight_scale", "weight_scale_inv", "input_scale"):
                    _load_fp8_tensor(mod, key, leaf, tensor, scheme)
                elif key in targets:
                    param = targets[key]
                    if tuple(param.shape) != tuple(tensor.shape):
                        raise ValueError(f"{f.name}: {key} has shape {list(tensor.shape)}, the model "
                                         f"expects {list(param.shape)}")
                    param.data.copy_(tensor)
                else:
                    raise ValueError(f"{f.name}: tensor {key} has no place in the model")
                loaded.add(name)
    if skipped:
        log_skipped(skipped, mtp)
    tie = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
    tied = {"lm_head.weight"} if tie else set()
    missing = sorted(expected - loaded - tied) + experts.missing()
    if missing:
        raise ValueError(f"the checkpoint lacks {len(missing)} tensors, e.g. {missing[:5]}")
    for mod in fp8_mods.values():
        mod.bind()


def _load_fp8_tensor(mod: Fp8Linear, key: str, leaf: str, tensor: torch.Tensor, scheme: Fp8Scheme) -> None:
    if leaf == "weight":
        if tuple(tensor.shape) != (mod.out_features, mod.in_features):
            raise ValueError(f"{key} has shape {list(tensor.shape)}, expected "
                             f"{[mod.out_features, mod.in_features]}")
        if tensor.dtype == FP8_DTYPE:
            mod.weight.data.copy_(tensor)
        elif scheme.from_checkpoint:
            raise ValueError(f"{key} is {tensor.dtype}, but the checkpoint's quantization_config says FP8")
        else:
            _quantize_into(mod, tensor.to(mod.weight.device))
    elif leaf in ("weight_scale", "weight_scale_inv"):
        mod.set_scale(tensor)
    else:  # input_scale
        if mod.input_scale is None:
            raise ValueError(f"{key}: an input_scale, but activation_scheme is dynamic")
        mod.input_scale.data.copy_(tensor.float().reshape(1))
        mod.bind()
