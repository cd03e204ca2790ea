"""FP8 experts of the mixtures of experts (Qwen3-MoE, Mixtral, GLM-4.5): the module, its checkpoint
tensors and its dummy weights.

``Fp8Experts`` replaces a transformers ``*Experts`` module (stacked ``gate_up_proj [E, 2 I, H]`` and
``down_proj [E, H, I]``) with float8_e4m3fn weights of the same shapes and float32 scales
(``engine.ops.fused_moe_fp8``): per ``(bn, bk)`` tile for block-scaled checkpoints, else per output row.
Checkpoints store one tensor per expert and projection (``mlp.experts.{e}.gate_proj.weight`` with its
``weight_scale_inv``; Mixtral's ``block_sparse_moe.experts.{e}.w1/w3/w2``); ``expert_key`` maps such a
name to its slice of the stacked tensors, and ``ExpertLoader`` copies each tensor into it (a float
tensor quantized per row on load under ``--quantization fp8``), then names whatever no file provided.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from engine.models.quant_config import Fp8Scheme
from engine.ops.fp8_weight import FP8_DTYPE
from engine.ops.fused_moe import fused_moe, fused_moe_reference
from engine.ops.fused_moe_fp8 import ExpertScales, quantize_experts, scale_shape

# per-expert projection names: Qwen3-MoE / GLM-4.5, and Mixtral's w1 (gate), w3 (up), w2 (down)
_PARTS = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down", "w1": "gate", "w3": "up", "w2": "down"}
_PER_EXPERT = re.compile(r"^(?P<mod>.+\.experts)\.(?P<e>\d+)\.(?P<proj>\w+)\."
                         r"(?P<leaf>weight|weight_scale_inv|weight_scale|input_scale)$")
_STACKED = re.compile(r"^(?P<mod>.+\.experts)\.(?P<proj>gate_up_proj|down_proj)$")


def checkpoint_name(key: str) -> str:
    """A checkpoint tensor name as the transformers module tree spells it (Mixtral's ``block_sparse_moe``
    is ``mlp``)."""
    return key.replace(".block_sparse_moe.", ".mlp.")


@dataclass(frozen=True)
class ExpertKey:
    """Where a checkpoint tensor goes in an ``Fp8Experts``: module name, expert (None: all, a stacked
    tensor), part (``gate``, ``up``, ``down``, ``gate_up``) and leaf (``weight``, ``weight_scale``,
    ``weight_scale_inv``, ``input_scale``)."""

    module: str
    expert: int | None
    part: str
    leaf: str


def expert_key(key: str) -> ExpertKey | None:
    """The ``ExpertKey`` of checkpoint tensor ``key`` (after ``checkpoint_name``), or None when it is not
    an expert tensor."""
    m = _PER_EXPERT.match(key)
    if m is not None and m["proj"] in _PARTS:
        return ExpertKey(m["mod"], int(m["e"]), _PARTS[m["proj"]], m["leaf"])
    m = _STACKED.match(key)
    if m is not None:
        return ExpertKey(m["mod"], None, "gate_up" if m["proj"] == "gate_up_proj" else "down", "weight")
    return None


class Fp8Experts(torch.nn.Module):
    """FP8 expert weights: ``forward(hidden [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]``
    as transformers' experts modules, through ``engine.ops.fused_moe`` (kernels on CUDA, the reference
    on a CPU).

    Parameters: ``gate_up_proj`` float8_e4m3fn ``[E, 2 I, H]``, ``down_proj`` ``[E, H, I]``, and their
    float32 ``*_scale`` (``engine.ops.fused_moe_fp8.scale_shape`` with ``block``).

    Raises:
        ValueError: block-scaled with ``I`` not a multiple of ``bn`` (gate and up are separate tensors in
            checkpoints, so their scale tiles cannot be stacked), or ``bk`` not a multiple of 16 (the
            kernels' weight tiles must each lie in one column of scale tiles).
    """

    def __init__(self, num_experts: int, hidden: int, inter: int, block: tuple[int, int] | None,
                 device: torch.device | str) -> None:
        super().__init__()
        if block is not None and inter % block[0]:
            raise ValueError(f"block-scaled FP8 experts of width {inter}: not a multiple of the block height "
                             f"{block[0]}")
        if block is not None and block[1] % 16:
            raise ValueError(f"block-scaled FP8 experts: the block width {block[1]} is not a multiple of 16")
        self.num_experts, self.hidden, self.inter, self.block = num_experts, hidden, inter, block

        def param(shape: tuple[int, ...], dtype: torch.dtype) -> torch.nn.Parameter:
            return torch.nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)

        self.gate_up_proj = param((num_experts, 2 * inter, hidden), FP8_DTYPE)
        self.gate_up_proj_scale = param(scale_shape(num_experts, 2 * inter, hidden, block), torch.float32)
        self.down_proj = param((num_experts, hidden, inter), FP8_DTYPE)
        self.down_proj_scale = param(scale_shape(num_experts, hidden, inter, block), torch.float32)

    @property
    def scales(self) -> ExpertScales:
        """The scales as ``fused_moe`` takes them."""
        return ExpertScales(self.gate_up_proj_scale.data, self.down_proj_scale.data, self.block)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        moe = fused_moe if hidden_states.is_cuda else fused_moe_reference
        return moe(hidden_states, self.gate_up_proj, self.down_proj, top_k_weights, top_k_index,
                   scales=self.scales)

    def rows(self, part: str) -> tuple[torch.Tensor, torch.Tensor, int, int]:
        """``(weight, scale, first row, rows)`` of ``part`` (``gate``/``up``/``gate_up``/``down``): the
        stacked tensors and the rows ``part`` covers in them."""
        if part == "down":
            return self.down_proj.data, self.down_proj_scale.data, 0, self.hidden
        first = self.inter if part == "up" else 0
        return (self.gate_up_proj.data, self.gate_up_proj_scale.data, first,
                2 * self.inter if part == "gate_up" else self.inter)

    @torch.no_grad()
    def fill(self, part: str, expert: int | None, weight: torch.Tensor) -> None:
        """Quantize a float ``weight`` (``[rows, K]`` of one expert, or ``[E, rows, K]`` when ``expert`` is
        None) into ``part``'s rows, with this module's scale layout."""
        w, s, first, rows = self.rows(part)
        experts = slice(None) if expert is None else slice(expert, expert + 1)
        stacked = weight if expert is None else weight[None]
        q, scale = quantize_experts(stacked.to(w.device), self.block)
        w[experts, first:first + rows].copy_(q)
        div = 1 if self.block is None else self.block[0]
        s[experts, first // div:(first + rows + div - 1) // div].copy_(scale)


def replace_experts(model: torch.nn.Module, scheme: Fp8Scheme, device: torch.device | str) -> list[str]:
    """Swap every ``*.mlp.experts`` module that ``scheme`` does not ignore for an ``Fp8Experts`` of its
    shape on ``device`` (``"meta"`` while building). Returns the names swapped."""
    swapped = []
    for name, module in list(model.named_modules()):
        up = getattr(module, "gate_up_proj", None)
        if not name.endswith(".experts") or not isinstance(up, torch.Tensor) or up.dim() != 3:
            continue
        if scheme.is_ignored(name):
            continue
        e, two_i, h = up.shape
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name), attr, Fp8Experts(e, h, two_i // 2, scheme.block, device))
        swapped.append(name)
    return swapped


@torch.no_grad()
def init_dummy_experts(mod: Fp8Experts, dtype: torch.dtype, gen: torch.Generator) -> None:
    """Dummy expert weights as ``loader.init_dummy_weights`` draws them (normal(0, 0.02) in ``dtype``),
    one expert's projection at a time on the module's device, quantized into place: the largest float
    tensor alive is one expert's ``[2 I, H]``."""
    device = mod.gate_up_proj.device
    for e in range(mod.num_experts):
        for part, shape in (("gate_up", (2 * mod.inter, mod.hidden)), ("down", (mod.hidden, mod.inter))):
            w = torch.empty(shape, dtype=dtype, device=device).normal_(0.0, 0.02, generator=gen)
            mod.fill(part, e, w)


class ExpertLoader:
    """Copies checkpoint expert tensors into the ``Fp8Experts`` of a model and tracks what arrived."""

    def __init__(self, modules: dict[str, Fp8Experts], scheme: Fp8Scheme) -> None:
        self.modules, self.scheme = modules, scheme
        self.seen: set[tuple[str, int, str, str]] = set()  # (module, expert, gate/up/down, weight/scale)

    @torch.no_grad()
    def load(self, key: ExpertKey, name: str, tensor: torch.Tensor) -> bool:
        """Place ``tensor`` (checkpoint name ``name``); False when ``key.module`` is no ``Fp8Experts``.

        Raises:
            ValueError: a shape that does not fit, a float weight in an FP8 checkpoint, an ``input_scale``
                (static activation scales are not supported for experts), each named."""
        mod = self.modules.get(key.module)
        if mod is None:
            return False
        if key.leaf == "input_scale":
            raise ValueError(f"{name}: static activation scales (input_scale) for FP8 experts are not "
                             "supported")
        w, s, first, rows = mod.rows(key.part)
        experts = range(mod.num_experts) if key.expert is None else [key.expert]
        if key.expert is not None and key.expert >= mod.num_experts:
            raise ValueError(f"{name}: expert {key.expert} of a module with {mod.num_experts}")
        parts = ("gate", "up") if key.part == "gate_up" else (key.part,)
        if key.leaf == "weight":
            want = (rows, w.shape[2]) if key.expert is not None else (mod.num_experts, rows, w.shape[2])
            if tuple(tensor.shape) != want:
                raise ValueError(f"{name} has shape {list(tensor.shape)}, expected {list(want)}")
            if tensor.dtype == FP8_DTYPE:
                target = w[key.expert] if key.expert is not None else w
                target[..., first:first + rows, :].copy_(tensor)
            elif self.scheme.from_checkpoint:
                raise ValueError(f"{name} is {tensor.dtype}, but the checkpoint's quantization_config says "
                                 "FP8")
            else:
                mod.fill(key.part, key.expert, tensor)
                self.seen.update((key.module, e, p, "scale") for e in experts for p in parts)
            self.seen.update((key.module, e, p, "weight") for e in experts for p in parts)
            return True
        self._load_scale(mod, key, name, tensor.float(), s, first, rows)
        self.seen.update((key.module, e, p, "scale") for e in experts for p in parts)
        return True

    def _load_scale(self, mod: Fp8Experts, key: ExpertKey, name: str, scale: torch.Tensor, s: torch.Tensor,
                    first: int, rows: int) -> None:
        if key.expert is None:
            raise ValueError(f"{name}: stacked expert scales are not read (checkpoints store them per "
                             "expert)")
        if mod.block is not None:
            div = mod.block[0]
            want = (rows // div, s.shape[2])
            if tuple(scale.shape) != want:
                raise ValueError(f"{name}: block scale of shape {list(scale.shape)}, expected {list(want)}")
            s[key.expert, first // div:(first + rows) // div].copy_(scale)
        elif scale.numel() == 1:  # per-tensor: every row of the projection takes it
            s[key.expert, first:first + rows].fill_(float(scale.reshape(())))
        elif scale.numel() == rows:
            s[key.expert, first:first + rows].copy_(scale.reshape(-1))
        else:
            raise ValueError(f"{name}: weight scale of shape {list(scale.shape)} for {rows} rows: expected "
                             "one value or one per row")

    def missing(self) -> list[str]:
        """Checkpoint-style names of the expert tensors no file provided."""
        out = []
        names = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
        for mname, mod in self.modules.items():
            for e in range(mod.num_experts):
                for part in ("gate", "up", "down"):
                    for leaf in ("weight", "scale"):
                        if (mname, e, part, leaf) not in self.seen:
                            suffix = "weight" if leaf == "weight" else "weight_scale_inv"
                            out.append(f"{mname}.{e}.{names[part]}.{suffix}")
        return out
