"""Which FP8 scheme a model's weights take: from its ``quantization_config`` or from ``--quantization fp8``.

Imports no torch (the launcher checks a model with it before any worker starts).

Checkpoint formats read (``quant_method: "fp8"``):

- block-scaled (the DeepSeek-V3, Qwen3-FP8 and GLM-4.5-FP8 releases): ``weight_block_size: [bn, bk]``,
  ``activation_scheme: "dynamic"``, an FP8 ``weight`` and a float32 ``weight_scale_inv
  [ceil(N / bn), ceil(K / bk)]`` per projection;
- per-tensor (e.g. the FP8 Llama-3 releases made with AutoFP8 / llm-compressor): no block size, FP8
  ``weight``, ``weight_scale`` (one value, or one per output feature) and, with ``activation_scheme:
  "static"``, an ``input_scale``.

``--quantization fp8`` on a bf16/fp16/fp32 checkpoint quantizes each projection per output feature on
load (dynamic per-token activation scales). Only the decoder layers' linear projections (q/k/v/o,
gate/up/down) and the mixtures of experts' experts (engine/models/fp8_moe.py) are FP8; embeddings, norms,
routers and the LM head keep the model dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

QUANTIZATION_METHODS = ("fp8",)
_KNOWN_KEYS = frozenset({"quant_method", "activation_scheme", "fmt", "weight_block_size", "ignored_layers",
                         "modules_to_not_convert", "kv_cache_scheme"})


class QuantizationConfigError(ValueError):
    """A ``quantization_config`` or ``--quantization`` value pdserve cannot honour (named in the message)."""


@dataclass(frozen=True)
class Fp8Scheme:
    """How a model's projections are FP8.

    ``from_checkpoint``: the weights on disk are FP8 (else they are quantized on load, per channel);
    ``block``: ``(bn, bk)`` scale tiles, or None for per-tensor / per-channel scales; ``static_activations``:
    the checkpoint carries ``input_scale`` tensors; ``ignored``: module-name prefixes left unquantized.
    """

    from_checkpoint: bool
    block: tuple[int, int] | None = None
    static_activations: bool = False
    ignored: tuple[str, ...] = ()

    def is_ignored(self, module_name: str) -> bool:
        """Whether ``module_name`` (e.g. ``model.layers.0.mlp.down_proj``) stays unquantized."""
        return any(module_name == p or module_name.startswith(p + ".") or module_name.endswith("." + p)
                   for p in self.ignored)


def _parse_checkpoint(quant: dict[str, Any], where: str) -> Fp8Scheme:
    unknown = sorted(set(quant) - _KNOWN_KEYS)
    if unknown:
        raise QuantizationConfigError(f"quantization_config in {where} has keys pdserve does not read: "
                                      f"{unknown} (known: {sorted(_KNOWN_KEYS)})")
    fmt = quant.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise QuantizationConfigError(f"FP8 format {fmt!r} in {where} is not supported; supported: e4m3")
    if quant.get("kv_cache_scheme") is not None:
        raise QuantizationConfigError(f"kv_cache_scheme in {where}: an FP8 KV cache is not supported")
    scheme = quant.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise QuantizationConfigError(
            f"activation_scheme {scheme!r} in {where} is not supported; supported: dynamic, static")
    block = quant.get("weight_block_size")
    block_t: tuple[int, int] | None = None
    if block is not None:
        if (not isinstance(block, list) or len(block) != 2 or not all(isinstance(b, int) for b in block)
                or block[1] not in (16, 32, 64, 128, 256) or block[0] < 1):
            raise QuantizationConfigError(
                f"weight_block_size {block!r} in {where} is not supported; supported: [bn, bk] with bk a "
                "power of two in 16..256 (e.g. [128, 128])")
        if scheme != "dynamic":
            raise QuantizationConfigError(f"block-scaled FP8 with activation_scheme {scheme!r} in {where} is "
                                          "not supported; supported: dynamic")
        block_t = (block[0], block[1])
    ignored = [*(quant.get("ignored_layers") or []), *(quant.get("modules_to_not_convert") or [])]
    return Fp8Scheme(from_checkpoint=True, block=block_t, static_activations=scheme == "static",
                     ignored=tuple(str(i) for i in ignored))


def fp8_scheme(raw: dict[str, Any], quantization: str | None, where: str = "config.json") -> Fp8Scheme | None:
    """The FP8 scheme of a model from its raw ``config.json`` and the ``--quantization`` flag, or None
    for an unquantized model. A checkpoint already in FP8 keeps its own scheme under ``--quantization
    fp8``.

    Raises:
        QuantizationConfigError: ``quantization`` is not None or ``"fp8"``; a ``quantization_config`` whose
            ``quant_method`` is not ``"fp8"`` or whose fields are not supported (each named).
    """
    if quantization is not None and quantization not in QUANTIZATION_METHODS:
        raise QuantizationConfigError(f"--quantization {quantization!r} is not supported; supported: "
                                      f"{', '.join(QUANTIZATION_METHODS)}")
    quant = raw.get("quantization_config")
    if quant is not None:
        supported = f"supported: quant_method {', '.join(QUANTIZATION_METHODS)}"
        if not isinstance(quant, dict):
            raise QuantizationConfigError(f"quantization_config in {where} is not an object with a "
                                          f"quant_method (got {quant!r}); {supported}")
        if "quant_method" not in quant:
            bnb = " and ".join(k for k in ("load_in_4bit", "load_in_8bit") if k in quant)
            like = f" ({bnb}: it looks like bitsandbytes, which is not supported)" if bnb else ""
            raise QuantizationConfigError(f"quantization_config in {where} has no quant_method{like}; "
                                          f"{supported}")
        method = quant["quant_method"]
        if method not in QUANTIZATION_METHODS:
            raise QuantizationConfigError(
                f"unsupported quantization method {method!r} (quantization_config in {where}); "
                f"supported: {', '.join(QUANTIZATION_METHODS)}")
        return _parse_checkpoint(quant, where)
    if quantization == "fp8":
        return Fp8Scheme(from_checkpoint=False)
    return None
