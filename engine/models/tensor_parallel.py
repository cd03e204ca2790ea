"""Megatron-style tensor parallelism of the dense decoder (Shoeybi et al., 2019, "Megatron-LM: Training
Multi-Billion Parameter Language Models Using Model Parallelism", section 3), over the fused forward.

Each tensor parallel rank builds the transformers model from a per-rank config (``local_config``: its
share of query heads, KV heads, MLP width and vocabulary) and reads only its slice of each checkpoint
tensor (``shard_spec``). The split, for ``tp`` ranks and rank ``r``:

- column-parallel (output rows split, no communication): q/k/v projections by head (rank ``r`` holds
  query heads ``[r H/tp, (r+1) H/tp)``; KV heads ``[r Hkv/tp, (r+1) Hkv/tp)``, or, when
  ``Hkv < tp``, the one KV head ``r // (tp / Hkv)`` its query heads use, replicated over
  ``tp / Hkv`` ranks) and gate/up by MLP column;
- row-parallel (input columns split, one all-reduce of the output): ``o_proj`` and ``down_proj``; their
  biases, whole on every rank, are added once after the sum;
- vocab-parallel embedding (rows ``[r V', (r+1) V')`` with ``V' = ceil(V / tp)``, rows past ``V`` zero;
  each rank embeds the ids it holds, zeros elsewhere, one all-reduce) and LM head (rank ``r``'s ``V'``
  logits, all-gathered so every rank holds the full ``[S, V]`` rows; rank 0 samples from them);
- everything else (RMSNorm weights, Qwen3's per-head q/k norms, RoPE) is replicated.

Each rank's paged KV cache holds its KV heads only (``local_config(...).num_key_value_heads``).
Mixtures of experts are refused (``check_tensor_parallel``).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel
from transformers.initialization import no_init_weights

from engine.config import ModelConfig
from engine.distributed import TensorParallel
from engine.models.context_limits import check_rope_scaling, check_sliding_window
from engine.models.fused_model import FusedCausalLM, SplitFp8
from engine.models.loader import (
    _check_safetensors,
    init_dummy_weights,
    load_hf_config,
    resolve_dtype,
)
from engine.models.mtp import is_mtp_key, log_skipped, mtp_layers
from engine.models.registry import is_dummy_alias, resolve_model, tensor_parallel_problem
from engine.ops.fp8_gemm import Fp8Activation
from engine.ops.fp8_weight import Fp8Weight


def head_dim_of(cfg: PretrainedConfig) -> int:
    """Elements per attention head (``head_dim``, else ``hidden_size // num_attention_heads``)."""
    return int(getattr(cfg, "head_dim", None) or int(cfg.hidden_size) // int(cfg.num_attention_heads))


def num_kv_heads_of(cfg: PretrainedConfig) -> int:
    """KV heads of the whole model (``num_key_value_heads``, else ``num_attention_heads``)."""
    return int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)


def check_tensor_parallel(cfg: PretrainedConfig, size: int) -> None:
    """Refuse a model ``size`` ranks cannot split (``registry.tensor_parallel_problem``'s rules, on the
    loaded config).

    Raises:
        ValueError: a mixture of experts or an architecture outside ``LLAMA_LIKE_ARCHITECTURES``, query
            heads or MLP width not divisible by ``size``, or KV heads
            neither divisible by ``size`` nor dividing it; the message names the numbers.
    """
    fields = {"architectures": getattr(cfg, "architectures", None),
              "num_attention_heads": int(cfg.num_attention_heads),
              "num_key_value_heads": num_kv_heads_of(cfg),
              "intermediate_size": getattr(cfg, "intermediate_size", None)}
    if (why := tensor_parallel_problem(fields, size)) is not None:
        raise ValueError(why)


def local_config(cfg: PretrainedConfig, size: int) -> PretrainedConfig:
    """The config of one rank's share: ``H/size`` query heads, ``max(Hkv/size, 1)`` KV heads,
    ``intermediate_size/size``, ``ceil(V/size)`` vocabulary rows, ``head_dim`` stated explicitly, no
    ``pad_token_id`` (transformers makes it the embedding's ``padding_idx``, which must lie in the rank's
    rows; serving needs none: ``engine.models.loader.drop_pad_outside_vocab``)."""
    local = copy.deepcopy(cfg)
    local.head_dim = head_dim_of(cfg)
    local.num_attention_heads = int(cfg.num_attention_heads) // size
    local.num_key_value_heads = max(num_kv_heads_of(cfg) // size, 1)
    local.intermediate_size = int(cfg.intermediate_size) // size
    local.vocab_size = math.ceil(int(cfg.vocab_size) / size)
    local.pad_token_id = None  # no padding index: the shard's rows are not the vocabulary's (and may lack it)
    return local


@dataclass(frozen=True)
class ShardSpec:
    """Rank's slice of one tensor: ``length`` entries of dim ``dim`` from ``start`` (entries at or past
    ``limit`` do not exist in the checkpoint: the vocabulary's padding, left zero)."""

    dim: int
    start: int
    length: int
    limit: int


def shard_spec(name: str, cfg: PretrainedConfig, tp: TensorParallel) -> ShardSpec | None:
    """How rank ``tp.rank`` slices the checkpoint tensor ``name`` of the whole model ``cfg``; None when it
    holds the whole tensor (norms, row-parallel biases)."""
    size, rank = tp.size, tp.rank
    d = head_dim_of(cfg)
    heads, kv = int(cfg.num_attention_heads), num_kv_heads_of(cfg)
    width, vocab = int(cfg.intermediate_size), int(cfg.vocab_size)
    leaf = name.rsplit(".", 2)[-2:]  # [module, weight|bias]
    module, kind = leaf[0], leaf[-1]
    if module == "q_proj":
        per = heads // size * d
        return ShardSpec(0, rank * per, per, heads * d)
    if module in ("k_proj", "v_proj"):
        if kv >= size:
            per = kv // size * d
            return ShardSpec(0, rank * per, per, kv * d)
        return ShardSpec(0, rank // (size // kv) * d, d, kv * d)  # replicated KV head
    if module in ("gate_proj", "up_proj"):
        per = width // size
        return ShardSpec(0, rank * per, per, width)
    if module == "o_proj" and kind == "weight":
        per = heads // size * d
        return ShardSpec(1, rank * per, per, heads * d)
    if module == "down_proj" and kind == "weight":
        per = width // size
        return ShardSpec(1, rank * per, per, width)
    if module in ("embed_tokens", "lm_head"):
        per = math.ceil(vocab / size)
        return ShardSpec(0, rank * per, per, vocab)
    return None


def _read_shard(handle: Any, key: str, spec: ShardSpec | None) -> torch.Tensor:
    """The rank's slice of ``key`` from an open safetensors file, zero-padded past ``spec.limit``."""
    if spec is None:
        return handle.get_tensor(key)
    sl = handle.get_slice(key)
    end = min(spec.start + spec.length, spec.limit)
    part = sl[spec.start:end] if spec.dim == 0 else sl[:, spec.start:end]
    missing = spec.length - (end - spec.start)
    if missing > 0:  # vocabulary padding of the last rank
        pad = list(part.shape)
        pad[spec.dim] = missing
        part = torch.cat([part, part.new_zeros(pad)], dim=spec.dim)
    return part


def load_sharded_model(model_config: ModelConfig, tp: TensorParallel,
                       device: torch.device) -> tuple[PreTrainedModel, PretrainedConfig]:
    """Build rank ``tp.rank``'s share of the model on ``device`` and read only its slices of the weights.

    Dummy weights (``load_format="dummy"`` or a shape-only alias) are drawn per rank from
    ``model_config.seed`` (so a sharded dummy model is not the same function as the unsharded one).

    Returns:
        ``(model, hf_config)``: the per-rank transformers model (eval mode, no grad) and the whole
        model's config.

    Raises:
        ValueError: from ``check_tensor_parallel``, the loader's checks, or a checkpoint whose tensors do
            not match the model (one with no place in it, one missing: ``_load_shards``, named).
        FileNotFoundError: unknown model or no weights.
    """
    path = resolve_model(model_config.model)
    cfg = load_hf_config(path)
    check_sliding_window(cfg, model_config.max_model_len)
    check_rope_scaling(cfg, model_config.max_model_len)
    check_tensor_parallel(cfg, tp.size)
    dtype = resolve_dtype(model_config.dtype, cfg, device)
    with torch.device(device), no_init_weights():
        model: Any = AutoModelForCausalLM.from_config(local_config(cfg, tp.size), dtype=dtype)
    if getattr(cfg, "tie_word_embeddings", False):  # one tensor, the rank's vocabulary rows of both
        model.lm_head.weight = model.model.embed_tokens.weight
    if model_config.load_format == "dummy" or is_dummy_alias(model_config.model):
        init_dummy_weights(model, model_config.seed)
    else:
        _load_shards(model, cfg, tp, path)
    model.eval()
    model.requires_grad_(False)
    return model, cfg


@torch.no_grad()
def _load_shards(model: Any, cfg: PretrainedConfig, tp: TensorParallel, path: Path) -> None:
    """Copy rank ``tp.rank``'s slice of every checkpoint tensor into ``model``. Tensors of the
    multi-token-prediction layers (``engine.models.mtp``) are skipped with one INFO line, older
    checkpoints' ``rotary_emb.inv_freq`` buffers ignored.

    Raises:
        ValueError: a checkpoint tensor with no place in the model (before any is read), a slice of the
            wrong shape, or a parameter no file provides (each named).
    """
    params = dict(model.named_parameters(remove_duplicate=False))
    files = _check_safetensors(path)
    mtp = mtp_layers(cfg)
    names = [k for keys in files.values() for k in keys]
    unexpected = sorted(k for k in names if k not in params and not k.endswith("rotary_emb.inv_freq")
                        and not is_mtp_key(k, mtp))
    if unexpected:
        raise ValueError(f"checkpoint {path}: {len(unexpected)} tensors have no place in the model, e.g. "
                         f"{unexpected[:5]}")
    skipped = sum(1 for k in names if is_mtp_key(k, mtp))
    if skipped:
        log_skipped(skipped, mtp)
    filled: set[str] = set()
    for f in files:
        with safe_open(str(f), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 (a safe_open handle is not a dict)
                param = params.get(key)
                if param is None:  # an MTP layer's tensor or an inv_freq buffer (checked above)
                    continue
                part = _read_shard(handle, key, shard_spec(key, cfg, tp))
                if tuple(part.shape) != tuple(param.shape):
                    raise ValueError(f"{f.name}: {key} slice has shape {tuple(part.shape)}, rank "
                                     f"{tp.rank} of {tp.size} expects {tuple(param.shape)}")
                param.copy_(part)
                filled.add(key)
    tied = {n for n, p in params.items() for m, q in params.items() if m in filled and p is q}
    missing = sorted(set(params) - filled - tied)
    if missing:
        raise ValueError(f"checkpoint {path} lacks {missing[:5]} (tensor parallel rank {tp.rank})")


class VocabParallelEmbedding(torch.nn.Module):
    """Rank's rows ``[start, start + V')`` of the embedding: ids outside them embed to zero, then the
    ranks' results are summed (each id is held by exactly one rank).

    ``forward(ids [T] int64) -> [T, hidden]`` in the weight's dtype.
    """

    def __init__(self, weight: torch.nn.Parameter, start: int, tp: TensorParallel) -> None:
        super().__init__()
        self.weight = weight
        self.start = start
        self.tp = tp

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        held = (local >= 0) & (local < self.weight.shape[0])
        out = torch.nn.functional.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight)
        out.masked_fill_(~held[..., None], 0.0)
        return self.tp.all_reduce(out)


class TensorParallelCausalLM(FusedCausalLM):
    """``FusedCausalLM`` over one rank's share of the model: the row-parallel projections (``o``,
    ``down``) all-reduce their output, the LM head all-gathers its vocabulary slices into
    ``[S, vocab_size]`` logits on every rank, and the embedding is vocab-parallel.

    Args:
        model: the per-rank transformers model of ``load_sharded_model``.
        tp: this rank's state (``tp.distributed``; at size 1 forced, the collectives still run).
        vocab_size: the whole model's vocabulary (the gathered logits are cut to it).
        use_triton, gemv_projections, max_positions: as ``FusedCausalLM``; ``"silu_down"`` is dropped
            (its GEMV bypasses the row-parallel reduction).

    Raises:
        ValueError: as ``FusedCausalLM``.
    """

    def __init__(self, model: Any, tp: TensorParallel, vocab_size: int, use_triton: bool,
                 gemv_projections: tuple[str, ...] = (), max_positions: int = 0) -> None:
        inner = model.model
        rows = int(inner.embed_tokens.weight.shape[0])
        inner.embed_tokens = VocabParallelEmbedding(inner.embed_tokens.weight, tp.rank * rows, tp)
        super().__init__(model, use_triton, tuple(p for p in gemv_projections if p != "silu_down"),
                         max_positions)
        self.tp = tp
        self.vocab_size = vocab_size

    def _linear(self, name: str, x: torch.Tensor | Fp8Activation, weight: torch.Tensor | Fp8Weight | SplitFp8,
                bias: torch.Tensor | None, out: torch.Tensor | None = None) -> torch.Tensor:
        if out is not None:  # a column-parallel projection (QKV) written into the attention's buffer
            return super()._linear(name, x, weight, bias, out=out)
        if name in ("o", "down"):
            y = self.tp.all_reduce(super()._linear(name, x, weight, None))
            return y if bias is None else y + bias
        if name == "lm_head":
            return self.tp.all_gather_last(super()._linear(name, x, weight, bias))[..., :self.vocab_size]
        return super()._linear(name, x, weight, bias)
