"""The decoder forward with merged projections and fused small kernels, over a transformers model's weights.

transformers' Llama-family modules launch about ten small kernels per layer besides the GEMMs (separate
q/k/v and gate/up projections, RMSNorm in five elementwise steps, the rotary ``cat``, SiLU, the residual
adds). ``FusedCausalLM`` runs the same arithmetic (same rounding points, so greedy outputs agree with
transformers') with:

- one QKV GEMM and one gate/up GEMM per layer: the projections' weights are concatenated once, and the
  transformers modules' own parameters are re-pointed to views of the merged tensors (no extra memory;
  ``model.state_dict()`` is unchanged);
- ``rms_norm`` with the residual add fused in, RoPE in place on the QKV output (with ``use_triton`` handed
  to the attention backend, whose ``rotary_store_kv`` kernel rotates and stores K/V in one launch),
  ``silu_mul`` (``engine.ops``: Triton kernels, or their plain-torch references when ``use_triton`` is off);
- attention through the paged backend exactly as ``engine.models.hf_attention`` calls it.

Supported: ``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM`` (QKV bias),
``Qwen3ForCausalLM`` (per-head q/k RMSNorm: one ``qk_rms_norm`` launch over both, the model's own modules
when ``use_triton`` is off) and ``Phi3ForCausalLM`` (its checkpoint's ``qkv_proj`` and ``gate_up_proj``
are already merged; partial rotary as below) and ``Glm4ForCausalLM`` (GLM-4: merged gate/up, QKV bias, an
RMSNorm after attention and one after the MLP, each before its residual add, and the rotary on adjacent
pairs of dims: ``apply_rotary(interleaved=True)``) with ``hidden_act`` silu, and
the mixtures of experts ``Qwen3MoeForCausalLM``, ``MixtralForCausalLM`` and ``Glm4MoeForCausalLM``: each
sparse layer's router scores and normalises as its transformers module (softmax top-k with
``norm_topk_prob`` for Qwen3-MoE and softmax renormalised over the top-k for Mixtral, both in one
``engine.ops.topk_softmax`` launch with the kernels on; sigmoid plus ``e_score_correction_bias`` with
grouped top-k and ``routed_scaling_factor`` for GLM-4.5, the module itself; all device-side, no host
sync), its experts run through ``engine.ops.fused_moe`` (its per-expert reference when
``use_triton`` is off on a CPU; FP8 experts, ``engine.models.fp8_moe.Fp8Experts``, with their scales),
and GLM-4.5's shared expert through the dense path (merged gate/up,
``silu_mul``); dense layers of those models (``mlp_only_layers``, ``first_k_dense_replace``) run as in
the dense architectures. Partial
rotary (GLM-4.5: ``partial_rotary_factor``) rotates the first dims of each head before the attention
backend stores K/V.
FP8 projections (``engine.models.fp8.Fp8Linear``) merge the same way (``merge_fp8``: weights and scales
concatenated) and run ``engine.ops.fp8_gemm.fp8_linear`` (one-row steps on CUDA: the weight-only FP8 GEMVs
of ``engine.ops.fp8_gemv``; never the bf16 ``engine.ops.gemv``); the down projection's takes the gate/up
output with SiLU·mul folded into the GEMV or the activation quantizer (``gated``).
Method as vLLM's ``QKVParallelLinear`` / ``MergedColumnParallelLinear`` and fused ``RMSNorm``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from engine.attention.backend import AttentionBackend
from engine.attention.metadata import AttentionMetadata
from engine.kv_cache import KVCachePool
from engine.models.fp8 import Fp8Linear, fp8_mergeable, merge_fp8
from engine.models.fp8_moe import Fp8Experts
from engine.models.hf_attention import BACKEND_KWARG, CACHE_KWARG, META_KWARG
from engine.ops.fp8_gemm import Fp8Activation, fp8_linear, fp8_linear_quantized, takes_fp8_activation
from engine.ops.fp8_gemv import fp8_gemv_folds_silu, measured_gpu
from engine.ops.fp8_weight import Fp8Weight
from engine.ops.fused_moe import fused_moe, fused_moe_reference
from engine.ops.gemv import ROUTER_GEMV_TILE, gemv
from engine.ops.rms_norm import qk_rms_norm, rms_norm, rms_norm_fp8, rms_norm_reference
from engine.ops.rotary import apply_rotary, apply_rotary_reference
from engine.ops.silu_mul import silu_mul, silu_mul_reference
from engine.ops.topk_softmax import topk_softmax

FUSED_ARCHITECTURES = frozenset({"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                                 "Qwen3ForCausalLM", "Phi3ForCausalLM", "Glm4ForCausalLM",
                                 "Qwen3MoeForCausalLM", "MixtralForCausalLM", "Glm4MoeForCausalLM"})
# model types whose rotary turns adjacent pairs of dims (transformers' GLM-4 ``rotate_half``), not halves
INTERLEAVED_ROTARY_MODEL_TYPES = frozenset({"glm4"})
# one-row steps' projections through engine.ops.gemv on CUDA; "silu_down": the down projection's GEMV also
# computes SwiGLU's silu(gate) * up while loading, so no silu_mul launch (H200, 16 x 512 tiles: 32.6 µs
# against 34.9 µs for silu_mul + GEMV, docs/benchmarks/engine.md); "router": a softmax top-k router's
# logits (``E x H``, 0.5 MB for Qwen3-30B-A3B: cuBLAS's GEMV took 5.1 µs of an H200 step for it)
PROJECTIONS = ("qkv", "o", "gate_up", "down", "lm_head", "silu_down", "router")
GEMV_OPTIONS = PROJECTIONS


@dataclass
class FusedOutput:
    """What ``FusedCausalLM.forward`` returns: ``logits [1, S, vocab]`` in the model dtype."""

    logits: torch.Tensor


def unsupported_reason(model: torch.nn.Module) -> str | None:
    """Why ``model`` cannot run fused (``None`` when it can): architecture or activation not covered."""
    cfg = getattr(model, "config", None)
    archs = list(getattr(cfg, "architectures", None) or [type(model).__name__])
    if archs[0] not in FUSED_ARCHITECTURES:
        return f"architecture {archs[0]} has no fused forward (supported: {sorted(FUSED_ARCHITECTURES)})"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"hidden_act {cfg.hidden_act!r} is not silu"  # type: ignore[union-attr]
    return None


def _weight_of(lin: Any) -> torch.Tensor | Fp8Weight:  # an nn.Linear or an Fp8Linear
    return lin.fp8 if isinstance(lin, Fp8Linear) else lin.weight


@dataclass(frozen=True)
class SplitFp8:
    """Block-scaled FP8 projections that share an input but cannot be merged (``fp8_mergeable``): the
    fused forward runs one GEMM per part and concatenates the outputs along the last dim, in order."""

    parts: tuple[Fp8Linear, ...]


def _merge(linears: list[Any]) -> tuple[torch.Tensor | Fp8Weight | SplitFp8, torch.Tensor | None]:
    """Concatenate the linears' weights (and biases) along the output dim; re-point each module's
    parameters to its slice of the merged tensor so nothing is stored twice (FP8 ones: ``merge_fp8``;
    block-scaled FP8 ones whose rows do not fill whole scale blocks stay apart: ``SplitFp8``, biases kept
    in their modules).

    Raises:
        ValueError: some but not all of ``linears`` are FP8, or ``merge_fp8`` refuses them."""
    fp8 = [isinstance(lin, Fp8Linear) for lin in linears]
    if all(fp8):
        if not fp8_mergeable(linears):
            return SplitFp8(tuple(linears)), None
        return merge_fp8(linears)
    if any(fp8):
        raise ValueError("cannot merge FP8 and unquantized projections (an ignored module in a merged group)")
    weight = torch.cat([lin.weight.detach() for lin in linears], dim=0)
    has_bias = [lin.bias is not None for lin in linears]
    bias = torch.cat([lin.bias.detach() for lin in linears], dim=0) if all(has_bias) else None  # type: ignore[union-attr]
    if any(has_bias) and bias is None:
        raise ValueError("cannot merge projections where only some have a bias")
    start = 0
    for lin in linears:
        rows = lin.weight.shape[0]
        lin.weight = torch.nn.Parameter(weight[start:start + rows], requires_grad=False)
        if bias is not None:
            lin.bias = torch.nn.Parameter(bias[start:start + rows], requires_grad=False)
        start += rows
    return weight, bias


class _DenseMLP:
    """A SwiGLU MLP's merged gate/up weight and its down projection module."""

    def __init__(self, mlp: Any) -> None:  # transformers MLP: gate_proj, up_proj (or gate_up_proj), down_proj
        self.gate_up_weight: torch.Tensor | Fp8Weight | SplitFp8
        if hasattr(mlp, "gate_up_proj"):  # Phi-3: already merged (gate rows first, as silu_mul reads them)
            self.gate_up_weight, self.gate_up_bias = _weight_of(mlp.gate_up_proj), mlp.gate_up_proj.bias
        else:
            self.gate_up_weight, self.gate_up_bias = _merge([mlp.gate_proj, mlp.up_proj])
        self.down = mlp.down_proj


class _SparseMoE:
    """A sparse MoE block's router (the transformers module: ``router(x [T, H]) -> (logits, weights [T, k],
    ids [T, k])``), its experts' stacked weights (``gate_up [E, 2 I, H]``, ``down [E, H, I]``) and its
    shared expert (GLM-4.5), if any."""

    def __init__(self, mlp: Any) -> None:  # a transformers sparse MoE block (gate, experts)
        self.router = mlp.gate
        # softmax top-k routers run as one kernel (engine/ops/topk_softmax.py): (renormalize, weights
        # dtype of None = the logits') for the ones whose arithmetic it is; others run their module
        kind = type(mlp.gate).__name__
        self.softmax_topk: tuple[bool, torch.dtype | None] | None = (
            (bool(mlp.gate.norm_topk_prob), None) if kind == "Qwen3MoeTopKRouter"
            else (True, torch.float32) if kind == "MixtralTopKRouter" else None)
        self.gate_up = mlp.experts.gate_up_proj
        self.down = mlp.experts.down_proj
        self.scales = mlp.experts.scales if isinstance(mlp.experts, Fp8Experts) else None  # FP8 experts
        shared = getattr(mlp, "shared_experts", None)
        self.shared = _DenseMLP(shared) if shared is not None else None


class _FusedLayer:
    """Merged weights of one decoder layer plus references to its transformers modules."""

    def __init__(self, layer: Any) -> None:  # a transformers decoder layer
        attn, mlp = layer.self_attn, layer.mlp
        self.attn, self.mlp = attn, mlp
        self.index = int(attn.layer_idx)
        self.head_dim = int(attn.head_dim)
        self.scale = float(attn.scaling)
        if hasattr(attn, "qkv_proj"):  # Phi-3: already merged, q rows then k then v
            cfg = attn.config
            self.q_width = int(cfg.num_attention_heads) * self.head_dim
            self.kv_width = int(cfg.num_key_value_heads) * self.head_dim
            self.qkv_weight: torch.Tensor | Fp8Weight | SplitFp8
            self.qkv_weight, self.qkv_bias = _weight_of(attn.qkv_proj), attn.qkv_proj.bias
        else:
            self.q_width = attn.q_proj.weight.shape[0]
            self.kv_width = attn.k_proj.weight.shape[0]
            self.qkv_weight, self.qkv_bias = _merge([attn.q_proj, attn.k_proj, attn.v_proj])
        self.ffn: _DenseMLP | _SparseMoE = _SparseMoE(mlp) if hasattr(mlp, "experts") else _DenseMLP(mlp)
        self.input_norm = (layer.input_layernorm.weight, float(layer.input_layernorm.variance_epsilon))
        self.post_norm = (layer.post_attention_layernorm.weight,
                          float(layer.post_attention_layernorm.variance_epsilon))
        self.q_norm = getattr(attn, "q_norm", None)
        self.k_norm = getattr(attn, "k_norm", None)
        # GLM-4: RMSNorm of the attention output and of the MLP output, before each residual add
        self.attn_out_norm = _norm_of(getattr(layer, "post_self_attn_layernorm", None))
        self.mlp_out_norm = _norm_of(getattr(layer, "post_mlp_layernorm", None))
        self.interleaved = getattr(attn.config, "model_type", None) in INTERLEAVED_ROTARY_MODEL_TYPES


def _norm_of(norm: Any) -> tuple[torch.Tensor, float] | None:  # a transformers RMSNorm module, or None
    return None if norm is None else (norm.weight, float(norm.variance_epsilon))


def _check_norm_dtypes(layers: list[_FusedLayer], final_norm: torch.Tensor, dtype: torch.dtype) -> None:
    """Every RMSNorm weight of the model in the activations' ``dtype`` (the embedding's), checked when the
    model is built: ``rms_norm`` / ``qk_rms_norm`` refuse a weight of another dtype, so a model keeping a
    norm in float32 would otherwise load and then fail its first request.

    Raises:
        ValueError: naming the first norm whose weight has another dtype.
    """
    named: list[tuple[str, torch.Tensor]] = [("model.norm", final_norm)]
    for layer in layers:
        pre = f"model.layers.{layer.index}"
        named += [(f"{pre}.input_layernorm", layer.input_norm[0]),
                  (f"{pre}.post_attention_layernorm", layer.post_norm[0])]
        named += [(f"{pre}.self_attn.{n}", m.weight) for n, m in (("q_norm", layer.q_norm),
                                                                  ("k_norm", layer.k_norm)) if m is not None]
        named += [(f"{pre}.{n}", norm[0]) for n, norm in (("post_self_attn_layernorm", layer.attn_out_norm),
                                                         ("post_mlp_layernorm", layer.mlp_out_norm))
                  if norm is not None]
    for name, weight in named:
        if weight.dtype != dtype:
            raise ValueError(f"{name}.weight is {weight.dtype}, the model's activations {dtype}: the fused "
                             f"forward's RMSNorm needs one dtype")


def rope_table(rotary_emb: Any, max_positions: int, like: torch.Tensor) -> torch.Tensor | None:
    """``[max_positions, 2 D]`` in ``like``'s dtype and device: RoPE's cos (first ``D``) and sin of every
    position, from the transformers ``rotary_emb`` module itself (its per-position arithmetic is elementwise,
    so a gathered row is bit-identical to computing that position in a step). None when ``max_positions``
    is 0 or the RoPE type changes its frequencies with the sequence length (``dynamic``; ``longrope`` past
    its ``original_max_position_embeddings``: within it transformers always takes the short factors)."""
    rope_type = getattr(rotary_emb, "rope_type", "default")
    if max_positions <= 0 or rope_type == "dynamic":
        return None
    if rope_type == "longrope":
        original = rotary_emb.config.rope_parameters.get("original_max_position_embeddings")
        if original is None or max_positions > int(original):
            return None
    positions = torch.arange(max_positions, device=like.device)[None]
    with torch.no_grad():
        cos, sin = rotary_emb(like[:0], position_ids=positions)
    return torch.cat((cos[0], sin[0]), dim=1).contiguous()


class FusedCausalLM(torch.nn.Module):
    """Callable like the transformers model in ``ModelRunner``: ``forward(input_ids [1, T], position_ids
    [1, T], logits_to_keep, **pdserve kwargs) -> FusedOutput``.

    Args:
        model: a loaded transformers causal LM of ``FUSED_ARCHITECTURES`` (its projection parameters
            become views of merged tensors; the model itself keeps working).
        use_triton: Triton kernels (CUDA, or Triton's interpreter) instead of the torch references.
        gemv_projections: names from ``PROJECTIONS`` computed by ``engine.ops.gemv`` when a step has one
            token (batch-1 decode) and ``use_triton`` is on; others (and every multi-token step) use
            ``torch.nn.functional.linear`` (cuBLAS). ``"silu_down"`` (``GEMV_OPTIONS``): the down
            projection's GEMV takes the gate/up output and applies SiLU·mul itself (``gemv(gated=True)``).
            ``"router"``: the router logits of the sparse layers whose softmax top-k runs as one kernel
            (Qwen3-MoE, Mixtral); other routers run their transformers module.

        max_positions: positions ``[0, max_positions)`` get their RoPE cos/sin computed once by the
            model's own ``rotary_emb`` (``rope_table``) and gathered per step; 0: computed every step.

    Raises:
        ValueError: the model is not supported (``unsupported_reason``), or an unknown projection name.
    """

    def __init__(self, model: Any, use_triton: bool,  # a transformers causal LM
                 gemv_projections: tuple[str, ...] = (), max_positions: int = 0) -> None:
        super().__init__()
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(reason)
        self.model: Any = model
        self.use_triton = use_triton
        # called as (decoder layer index, topk_ids [T, k]) after each sparse layer routes, when set: a
        # host-side probe for eager steps (benchmarks count distinct experts); never set while capturing
        self.route_observer: Callable[[int, torch.Tensor], None] | None = None
        unknown = set(gemv_projections) - set(GEMV_OPTIONS)
        if unknown:
            raise ValueError(f"unknown projections {sorted(unknown)}; choose from {GEMV_OPTIONS}")
        self.gemv_projections = frozenset(gemv_projections)
        inner = model.model
        with torch.no_grad():
            self.fused_layers = [_FusedLayer(layer) for layer in inner.layers]
        self.final_norm = (inner.norm.weight, float(inner.norm.variance_epsilon))
        _check_norm_dtypes(self.fused_layers, self.final_norm[0], inner.embed_tokens.weight.dtype)
        self.rope_table = rope_table(inner.rotary_emb, max_positions, inner.embed_tokens.weight)

    def _norm(self, x: torch.Tensor, norm: tuple[torch.Tensor, float],
              residual: torch.Tensor | None = None) -> torch.Tensor:
        fn = rms_norm if self.use_triton else rms_norm_reference
        return fn(x, norm[0], norm[1], residual)

    def _norm_into(self, x: torch.Tensor, norm: tuple[torch.Tensor, float], residual: torch.Tensor | None,
                   weight: torch.Tensor | Fp8Weight | SplitFp8 | None) -> torch.Tensor | Fp8Activation:
        """``_norm`` of a row block whose only reader is the projection ``weight``: where that projection
        would quantize its input per token (FP8 weights, several rows, on a GPU: ``takes_fp8_activation``),
        the norm quantizes as it normalises (``rms_norm_fp8``: one pass instead of two, the same arithmetic
        up to the order of the row's sum of squares)."""
        if self.use_triton and isinstance(weight, Fp8Weight) and takes_fp8_activation(x, weight):
            q, scale = rms_norm_fp8(x, norm[0], norm[1], residual)
            return Fp8Activation(q, scale, x.dtype)
        return self._norm(x, norm, residual)

    def _head_norms(self, qk: torch.Tensor, q_heads: int, q_norm: Any, k_norm: Any
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-head RMSNorm of the query heads ``qk[:, :q_heads]`` with the transformers module ``q_norm``
        and of the key heads ``qk[:, q_heads:]`` with ``k_norm`` (weights ``[D]``); ``qk [T, heads, D]``.
        Returns ``(q [T, q_heads, D], k [T, heads - q_heads, D])``. With ``use_triton`` one launch for both
        (``qk_rms_norm``: a decode step at batch 1 is bound by launches); else the modules themselves."""
        if not self.use_triton:
            return q_norm(qk[:, :q_heads]), k_norm(qk[:, q_heads:])
        out = qk_rms_norm(qk, q_heads, q_norm.weight, float(q_norm.variance_epsilon), k_norm.weight,
                          float(k_norm.variance_epsilon))
        return out[:, :q_heads], out[:, q_heads:]

    def _linear(self, name: str, x: torch.Tensor | Fp8Activation, weight: torch.Tensor | Fp8Weight | SplitFp8,
                bias: torch.Tensor | None, out: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ weight^T + bias`` (``[T, N]``), written into ``out`` (contiguous ``[T, N]``) when given:
        by the GEMM itself for multi-row float weights (the cuBLAS call ``torch.nn.functional.linear``
        makes) and where ``fp8_linear`` can (FP8 tensor cores, the block kernel), else copied there."""
        if isinstance(x, Fp8Activation):  # from _norm_into, for this very weight
            assert isinstance(weight, Fp8Weight)
            return fp8_linear_quantized(x, weight, bias, out=out)
        if out is not None and isinstance(weight, torch.Tensor) and x.shape[0] > 1:
            if bias is None:
                return torch.mm(x, weight.t(), out=out)
            return torch.addmm(bias, x, weight.t(), out=out)
        if out is not None and isinstance(weight, Fp8Weight):
            return fp8_linear(x, weight, bias, use_kernels=self.use_triton or x.is_cuda, out=out)
        y = self._product(name, x, weight, bias)
        return out.copy_(y) if out is not None else y

    def _product(self, name: str, x: torch.Tensor, weight: torch.Tensor | Fp8Weight | SplitFp8,
                 bias: torch.Tensor | None) -> torch.Tensor:
        if isinstance(weight, SplitFp8):
            return torch.cat([self._product(name, x, part.fp8, part.bias) for part in weight.parts], dim=-1)
        if isinstance(weight, Fp8Weight):
            return fp8_linear(x, weight, bias, use_kernels=self.use_triton or x.is_cuda)
        if x.shape[0] == 1 and self.use_triton and name in self.gemv_projections:
            if name == "router":
                block_n, block_k, warps = ROUTER_GEMV_TILE
                return gemv(x, weight, bias, block_n=block_n, block_k=block_k, num_warps=warps)
            return gemv(x, weight, bias)
        return torch.nn.functional.linear(x, weight, bias)

    def _attention(self, lay: _FusedLayer, x: torch.Tensor | Fp8Activation, cos: torch.Tensor,
                   sin: torch.Tensor, kwargs: dict[str, Any], packed_rows: int | None) -> torch.Tensor:
        backend, meta, d = kwargs[BACKEND_KWARG], kwargs[META_KWARG], lay.head_dim
        t = x.q.shape[0] if isinstance(x, Fp8Activation) else x.shape[0]
        packed = self._packed_qkv(lay, packed_rows, t, x)
        into = packed.view(packed.shape[0], -1)[:t] if packed is not None else None
        qkv = self._linear("qkv", x, lay.qkv_weight, lay.qkv_bias, out=into)  # [T, (H + 2 Hkv) D]
        q = qkv[:, :lay.q_width].view(t, -1, d)
        k = qkv[:, lay.q_width:lay.q_width + lay.kv_width].view(t, -1, d)
        v = qkv[:, lay.q_width + lay.kv_width:].view(t, -1, d)
        if lay.q_norm is not None and lay.k_norm is not None:  # Qwen3: per-head RMSNorm before RoPE
            q, k = self._head_norms(qkv[:, :lay.q_width + lay.kv_width].view(t, -1, d), q.shape[1],
                                    lay.q_norm, lay.k_norm)
        rotary = None
        rot = cos.shape[-1]
        if rot < d or lay.interleaved:  # partial or pairwise rotary: the first ``rot`` dims, before the store
            rotate = apply_rotary if self.use_triton else apply_rotary_reference
            rotate(q[..., :rot], k[..., :rot], cos, sin, interleaved=lay.interleaved)
        elif self.use_triton:  # the triton backend rotates and stores in one kernel (rotary_store_kv)
            rotary = (cos, sin)
        else:
            apply_rotary_reference(q, k, cos, sin)
        out = backend.forward(lay.index, q, k, v, kwargs[CACHE_KWARG], meta, lay.scale, rotary,
                              packed)  # [T, H, D]; meta.layer_hook after the store
        o_proj = lay.attn.o_proj
        return self._linear("o", out.reshape(t, -1), _weight_of(o_proj), o_proj.bias)

    def _packed_rows(self, x: torch.Tensor, kwargs: dict[str, Any]) -> int | None:
        """Once per step: the rows of the buffer the QKV projections are written into where the attention
        backend reads a step's q, k, v in place (``fresh_qkv_rows``: cuDNN for one fresh long prompt,
        which would otherwise copy them into such a buffer), or None. ``x``: the step's ``[T, hidden]``
        embeddings (dtype, device); every layer has the first one's head shape and cache dtype."""
        if not self.fused_layers:
            return None
        lay = self.fused_layers[0]
        d = lay.head_dim
        kv_cache: KVCachePool = kwargs[CACHE_KWARG]
        backend: AttentionBackend = kwargs[BACKEND_KWARG]
        meta: AttentionMetadata = kwargs[META_KWARG]
        return backend.fresh_qkv_rows(meta, lay.q_width // d, lay.kv_width // d, d, x.dtype, x.device,
                                      kv_cache.k_cache(lay.index).dtype)

    def _packed_qkv(self, lay: _FusedLayer, rows: int | None, t: int,
                    x: torch.Tensor | Fp8Activation) -> torch.Tensor | None:
        """The zero-tailed ``[rows, H + 2 Hkv, D]`` buffer this layer's QKV projection is written into
        (``_packed_rows``); None without ``rows``, and for Qwen3's per-head norms, whose q and k are a new
        tensor."""
        if rows is None or lay.q_norm is not None:
            return None
        d = lay.head_dim
        device = x.q.device if isinstance(x, Fp8Activation) else x.device
        packed = torch.empty((rows, lay.q_width // d + 2 * (lay.kv_width // d), d), dtype=x.dtype,
                             device=device)
        packed[t:].zero_()
        return packed

    def _mlp(self, lay: _FusedLayer, x: torch.Tensor | Fp8Activation) -> torch.Tensor:
        ffn = lay.ffn
        if isinstance(ffn, _DenseMLP):
            return self._dense(ffn, x)
        assert isinstance(x, torch.Tensor)  # _norm_into quantizes for a dense MLP only: a router reads x
        if ffn.softmax_topk is not None and (self.use_triton or x.is_cuda):
            renormalize, dtype = ffn.softmax_topk
            logits = self._linear("router", x, ffn.router.weight, None)  # [T, E]
            weights, ids = topk_softmax(logits, ffn.router.top_k, renormalize, dtype or logits.dtype)
        else:
            _, weights, ids = ffn.router(x)  # [T, k] each
        if self.route_observer is not None:
            self.route_observer(lay.index, ids)
        # on CUDA always the kernels: the reference loops over experts on the host (a sync per layer)
        moe = fused_moe if self.use_triton or x.is_cuda else fused_moe_reference
        out = moe(x, ffn.gate_up, ffn.down, weights, ids, scales=ffn.scales)
        if ffn.shared is not None:
            out = out + self._dense(ffn.shared, x)
        return out

    def _dense(self, ffn: _DenseMLP, x: torch.Tensor | Fp8Activation) -> torch.Tensor:
        gate_up = self._linear("gate_up", x, ffn.gate_up_weight, ffn.gate_up_bias)
        down = ffn.down
        down_weight = _weight_of(down)
        if (gate_up.shape[0] == 1 and self.use_triton and "silu_down" in self.gemv_projections
                and isinstance(down_weight, torch.Tensor)):
            return gemv(gate_up, down_weight, down.bias, gated=True)
        # FP8 prefill: SiLU·mul folded into the activation quantizer. A one-row FP8 step runs silu_mul, then
        # the plain FP8 GEMV, except where fp8_gemv_folds_silu measured the GEMV with SiLU·mul folded in
        # faster (an H100)
        if isinstance(down_weight, Fp8Weight) and (gate_up.shape[0] > 1 or (
                gate_up.is_cuda and fp8_gemv_folds_silu(measured_gpu(gate_up.device), down_weight.layout))):
            return fp8_linear(gate_up, down_weight, down.bias, use_kernels=self.use_triton or gate_up.is_cuda,
                              gated=True)
        act = silu_mul(gate_up) if self.use_triton else silu_mul_reference(gate_up)
        return self._linear("down", act, down_weight, down.bias)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                logits_to_keep: int | torch.Tensor = 0, **kwargs: Any) -> FusedOutput:
        """One packed step. ``input_ids``/``position_ids``: int64 ``[1, T]``; ``logits_to_keep``: 0 (all
        rows), ``n`` (the last n) or an int64 index tensor ``[S]``; ``kwargs`` must hold the pdserve
        attention keyword arguments (others, e.g. ``attention_mask``/``use_cache``, are ignored).

        Raises:
            KeyError: the pdserve keyword arguments are missing.
        """
        inner: Any = self.model.model
        residual = inner.embed_tokens(input_ids[0])  # [T, hidden]
        if self.rope_table is not None:  # one gather instead of ~9 elementwise launches per step
            cos_sin = self.rope_table[position_ids[0]]  # [T, 2 D]
            half = cos_sin.shape[1] // 2
            cos, sin = cos_sin[:, :half], cos_sin[:, half:]
        else:
            cos, sin = inner.rotary_emb(residual[None], position_ids=position_ids)
            cos, sin = cos[0], sin[0]  # [T, D]
        layers = self.fused_layers
        # each norm is taken for the projection that reads it (_norm_into: FP8 prefill quantizes there)
        h: torch.Tensor | Fp8Activation = (self._norm_into(residual, layers[0].input_norm, None,
                                                           layers[0].qkv_weight) if layers else residual)
        x = residual
        packed_rows = self._packed_rows(residual, kwargs)
        for i, lay in enumerate(layers):
            x = self._attention(lay, h, cos, sin, kwargs, packed_rows)
            if lay.attn_out_norm is not None:
                x = self._norm(x, lay.attn_out_norm)
            gate_up = lay.ffn.gate_up_weight if isinstance(lay.ffn, _DenseMLP) else None
            x = self._mlp(lay, self._norm_into(x, lay.post_norm, residual, gate_up))
            if lay.mlp_out_norm is not None:
                x = self._norm(x, lay.mlp_out_norm)
            if i + 1 < len(layers):
                h = self._norm_into(x, layers[i + 1].input_norm, residual, layers[i + 1].qkv_weight)
            else:
                x = self._norm(x, self.final_norm, residual)
        if isinstance(logits_to_keep, torch.Tensor):
            x = x[logits_to_keep]
        elif logits_to_keep:
            x = x[-logits_to_keep:]
        head = self.model.lm_head
        return FusedOutput(logits=self._linear("lm_head", x, head.weight, head.bias)[None])
