"""Load a causal LM from a Hugging Face directory (safetensors) or with random ("dummy") weights.

transformers provides the config and model classes (no layer is rewritten here). Supported
architectures: ``registry.SUPPORTED_ARCHITECTURES``. Dummy weights are allocated without the default
(slow) initialisation and filled in place with normal(0, 0.02) from a seeded generator, norms with 1 and
biases with 0 — fast enough for Llama-3-8B shapes on a GPU. FP8 models (an FP8 checkpoint, or
``quantization="fp8"``) are built and loaded by ``engine.models.fp8``.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel
from transformers.initialization import no_init_weights

from engine.config import ModelConfig
from engine.models.context_limits import check_rope_scaling, check_sliding_window
from engine.models.fp8 import build_fp8_model, init_dummy_fp8, load_fp8_weights
from engine.models.mtp import is_mtp_key, layer_index, log_skipped, mtp_layers
from engine.models.quant_config import fp8_scheme
from engine.models.registry import is_dummy_alias, read_model_config, resolve_model

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device: str) -> torch.device:
    """``"auto"`` → ``cuda`` when available else ``cpu``; ``"cpu"``, ``"cuda"`` and ``"cuda:N"`` as named.

    Raises:
        ValueError: another string, or a CUDA device that is not there (no CUDA device visible, or an index
            past the visible ones), naming it.
    """
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cpu":
        return torch.device("cpu")
    kind, colon, index = device.partition(":")
    if kind != "cuda" or (colon and not index.isdigit()):
        raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {device!r}")
    if not torch.cuda.is_available():
        raise ValueError(f"device {device!r}: no CUDA device is visible (torch.cuda.is_available() is False)")
    count = torch.cuda.device_count()
    if index and int(index) >= count:
        raise ValueError(f"device {device!r}: {count} CUDA device(s) visible, cuda:0..cuda:{count - 1}")
    return torch.device(device)


def resolve_dtype(dtype: str, hf_config: PretrainedConfig, device: torch.device | None = None) -> torch.dtype:
    """``"auto"`` → float32 on the CPU (half-precision matmuls there are slow and their rounding makes
    results depend on the batch); on a GPU the checkpoint's dtype (``config.dtype``) when it is bf16 or
    fp16, else bfloat16.

    Raises:
        ValueError: ``dtype`` is not ``auto``, ``float32``, ``bfloat16`` or ``float16``.
    """
    if dtype == "auto":
        if device is None or device.type == "cpu":
            return torch.float32
        found = getattr(hf_config, "dtype", None)
        if isinstance(found, str):
            found = _DTYPES.get(found)
        return found if found in (torch.bfloat16, torch.float16) else torch.bfloat16
    if dtype not in _DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; use one of auto, {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


def load_hf_config(path: Path, quantization: str | None = None) -> PretrainedConfig:
    """Read and check ``path/config.json`` (``registry.read_model_config``, with the ``quantization``
    flag) before any weight is read.

    Raises:
        FileNotFoundError: no ``config.json`` in ``path``.
        ValueError: the file is not valid JSON; ``UnsupportedModelError`` (a ``ValueError``): the
            architecture or the quantization method is not supported.
    """
    read_model_config(path, quantization)
    return drop_pad_outside_vocab(AutoConfig.from_pretrained(str(path)))


def drop_pad_outside_vocab(hf_config: PretrainedConfig) -> PretrainedConfig:
    """``hf_config`` with a ``pad_token_id`` outside ``[0, vocab_size)`` set to None (in place; returned).

    transformers' decoders pass ``pad_token_id`` to ``nn.Embedding`` as its ``padding_idx``, which asserts
    that it lies in the vocabulary; a config without the key takes the architecture's default (GLM-4:
    151329, Phi-3: 32000) whatever its vocabulary, so a GLM-4 config with 49152 tokens could not be built.
    Serving needs no padding index: it only keeps that row's gradient at zero in training (and zeroes the row
    at initialisation, which loaded or dummy weights overwrite); the lookup is the same. Nothing else here
    reads ``pad_token_id`` (the gateway's padding, if any, is its tokenizer's). An id inside the vocabulary
    is kept. Said once at INFO (transformers itself warns of such an id when it reads the config)."""
    pad, vocab = getattr(hf_config, "pad_token_id", None), getattr(hf_config, "vocab_size", None)
    if isinstance(pad, int) and isinstance(vocab, int) and not 0 <= pad < vocab:
        logger.info("pad_token_id=%d is outside the vocabulary (vocab_size=%d): not used (serving needs no "
                    "padding index)", pad, vocab)
        hf_config.pad_token_id = None
    return hf_config


def checkpoint_files(path: Path) -> list[Path]:
    """The safetensors files of ``path`` that hold the transformers checkpoint, as transformers picks them:
    the files of ``model.safetensors.index.json``'s ``weight_map`` when there is one, else
    ``model.safetensors``, else every ``*.safetensors`` file except ``consolidated*.safetensors`` (the
    original-format copy Mistral's repositories ship beside the transformers shards). Sorted.

    Raises:
        FileNotFoundError: no such file, or a file the index names is absent.
    """
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted({path / name for name in json.loads(index.read_text())["weight_map"].values()})
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise FileNotFoundError(f"{index} names files that are absent: {absent[:5]}")
        return files
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    files = sorted(f for f in path.glob("*.safetensors") if not f.name.startswith("consolidated"))
    if not files:
        raise FileNotFoundError(f"model directory {path} has no *.safetensors weights")
    return files


def _check_safetensors(path: Path) -> dict[Path, list[str]]:
    """The checkpoint's safetensors files (``checkpoint_files``), each with its tensor names, after opening
    each header.

    Raises:
        FileNotFoundError: no checkpoint file.
        ValueError: a file is corrupt or truncated (named in the message).
    """
    files = checkpoint_files(path)
    names: dict[Path, list[str]] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as handle:
                keys = list(handle.keys())
                if keys:  # reading one tensor catches files truncated after a valid header
                    handle.get_slice(keys[-1])[:]
        except (SafetensorError, OSError, RuntimeError, ValueError) as exc:
            raise ValueError(f"corrupt safetensors file {f}: {exc}") from exc
        names[f] = keys
    return names


def _load_checkpoint(path: Path, hf_config: PretrainedConfig, dtype: torch.dtype,
                     device: torch.device) -> PreTrainedModel:
    """A bf16/fp16/fp32 checkpoint through transformers' ``from_pretrained``, refusing what it would only
    log: a checkpoint tensor the model has no place for, a parameter no file provides, a shape mismatch.
    Tensors of the multi-token-prediction layers (``engine.models.mtp``) are skipped with one INFO line;
    ``rotary_emb.inv_freq`` buffers of older checkpoints (recomputed from the config) are ignored.

    Algorithm: transformers' loading report (``output_loading_info=True``: missing, unexpected and
    mismatched keys after its own renaming and tied-weight handling), plus the tensor names of the
    safetensors headers for what transformers' per-model ignore patterns hide (e.g. GLM-4.5's fixed
    ``model.layers.46`` / ``model.layers.92``): any layer index at or past ``num_hidden_layers`` that is
    not an MTP layer is refused.

    Raises:
        ValueError: naming the checkpoint directory and the first few offending tensor names.
    """
    names = [k for keys in _check_safetensors(path).values() for k in keys]
    mtp = mtp_layers(hf_config)
    num_layers = int(getattr(hf_config, "num_hidden_layers", 0) or 0)
    past_decoder = [k for k in names if (i := layer_index(k)) is not None and i >= num_layers
                    and i not in mtp]
    if past_decoder:
        raise ValueError(f"checkpoint {path}: {len(past_decoder)} tensors have no place in the model, e.g. "
                         f"{sorted(past_decoder)[:5]} (layers at or past num_hidden_layers={num_layers}, "
                         f"not declared by num_nextn_predict_layers)")
    loaded: Any = AutoModelForCausalLM.from_pretrained(str(path), config=hf_config, dtype=dtype,
                                                       device_map=str(device), output_loading_info=True)
    model: PreTrainedModel = loaded[0]
    report = loaded[1]  # transformers' LoadStateDictInfo.to_dict()
    unexpected_keys: set[str] = report["unexpected_keys"]
    missing_keys: set[str] = report["missing_keys"]
    mismatched_keys: set[tuple[str, tuple[int, ...], tuple[int, ...]]] = report["mismatched_keys"]
    unexpected = sorted(k for k in unexpected_keys
                        if not k.endswith("rotary_emb.inv_freq") and not is_mtp_key(k, mtp))
    if unexpected:
        raise ValueError(f"checkpoint {path}: {len(unexpected)} tensors have no place in the model, e.g. "
                         f"{unexpected[:5]}")
    missing = sorted(missing_keys)
    if missing:
        raise ValueError(f"checkpoint {path} lacks {len(missing)} tensors of the model, e.g. {missing[:5]}")
    mismatched = sorted(mismatched_keys)
    if mismatched:
        shown = [f"{k}: checkpoint {list(a)}, model {list(b)}" for k, a, b in mismatched[:5]]
        raise ValueError(f"checkpoint {path}: {len(mismatched)} tensors have the wrong shape, e.g. {shown}")
    skipped = sum(1 for k in names if is_mtp_key(k, mtp))
    if skipped:
        log_skipped(skipped, mtp)
    return model


@torch.no_grad()
def init_dummy_weights(model: torch.nn.Module, seed: int) -> None:
    """Fill every parameter in place: matrices ~ normal(0, 0.02), norm weights 1, other vectors 0."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, param in model.named_parameters():
        if param.dim() >= 2:
            param.normal_(0.0, 0.02, generator=gen)
        elif "norm" in name:
            param.fill_(1.0)
        else:
            param.zero_()


def _build_dummy(hf_config: PretrainedConfig, dtype: torch.dtype, device: torch.device, seed: int) -> Any:
    with torch.device(device), no_init_weights():
        model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    init_dummy_weights(model, seed)
    return model


def load_model(model_config: ModelConfig) -> tuple[PreTrainedModel, PretrainedConfig]:
    """Load ``model_config.model`` (alias or HF directory) as an eval-mode model on its device.

    Returns:
        ``(model, hf_config)``; the model's parameters have the resolved dtype and device.

    Raises:
        FileNotFoundError: unknown alias / path, missing config.json or weights.
        ValueError: unsupported architecture or quantization method, a sliding window shorter than
            ``max_model_len``, LongRoPE past its original context (``check_rope_scaling``), bad dtype or
            load_format, corrupt safetensors, checkpoint tensors that do not match the model (a tensor
            with no place in it, a parameter no file provides, a shape mismatch: ``_load_checkpoint``,
            ``engine.models.fp8.load_fp8_weights``).
    """
    if model_config.load_format not in ("auto", "dummy"):
        raise ValueError(f"load_format {model_config.load_format!r} is not supported; use auto or dummy")
    path = resolve_model(model_config.model)
    hf_config = load_hf_config(path, model_config.quantization)
    check_sliding_window(hf_config, model_config.max_model_len)
    check_rope_scaling(hf_config, model_config.max_model_len)
    device = resolve_device(model_config.device)
    dtype = resolve_dtype(model_config.dtype, hf_config, device)
    dummy = model_config.load_format == "dummy" or is_dummy_alias(model_config.model)  # auto: no weights
    scheme = fp8_scheme(read_model_config(path, model_config.quantization), model_config.quantization)
    if scheme is not None:  # FP8 projections (engine/models/fp8.py)
        model = build_fp8_model(hf_config, scheme, dtype, device)
        if dummy:
            init_dummy_fp8(model, model_config.seed)
        else:
            load_fp8_weights(model, list(_check_safetensors(path)), scheme)
    elif dummy:
        model = _build_dummy(hf_config, dtype, device, model_config.seed)
    else:
        model = _load_checkpoint(path, hf_config, dtype, device)
    model.eval()
    model.requires_grad_(False)
    return model, model.config
