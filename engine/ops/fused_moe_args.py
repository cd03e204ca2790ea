"""Argument checks and small helpers shared by the fused MoE paths (``engine.ops.fused_moe``, grouped
GEMMs; ``engine.ops.fused_moe_gemv``, matrix-vector products) and their reference."""

from __future__ import annotations

import torch

from engine.ops.fused_moe_fp8 import ExpertScales, check_scale


def check_args(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, topk_weights: torch.Tensor,
           topk_ids: torch.Tensor, scales: ExpertScales | None = None) -> None:
    if x.dim() != 2 or w_gate_up.dim() != 3 or w_down.dim() != 3:
        raise ValueError(f"x must be [T, H], w_gate_up [E, 2 I, H], w_down [E, H, I]; got {tuple(x.shape)}, "
                         f"{tuple(w_gate_up.shape)}, {tuple(w_down.shape)}")
    e, two_i, h = w_gate_up.shape
    if two_i % 2 or h != x.shape[1] or tuple(w_down.shape) != (e, h, two_i // 2):
        raise ValueError(f"expert weights do not fit x {tuple(x.shape)}: w_gate_up {tuple(w_gate_up.shape)}, "
                         f"w_down {tuple(w_down.shape)}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0] or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_ids and topk_weights must both be [T={x.shape[0]}, k]; got "
                         f"{tuple(topk_ids.shape)}, {tuple(topk_weights.shape)}")
    if scales is not None:
        check_scale(w_gate_up, scales.gate_up, scales.block, "w_gate_up")
        check_scale(w_down, scales.down, scales.block, "w_down")
        if scales.block is not None and (two_i // 2) % scales.block[0]:
            raise ValueError(f"block-scaled w_gate_up: I={two_i // 2} is not a multiple of the block height "
                             f"{scales.block[0]} (the gate's last scale tile would hold up rows)")
        if scales.block is not None and scales.block[1] % 16:
            raise ValueError(f"block-scaled experts: the block width {scales.block[1]} is not a multiple of "
                             f"16 (the grouped kernels' weight tiles, at least 16 inputs, must each lie in "
                             f"one column of scale tiles)")
    elif x.dtype != w_gate_up.dtype or x.dtype != w_down.dtype:
        raise ValueError(f"x and the expert weights need one dtype; got {x.dtype}, {w_gate_up.dtype}, "
                         f"{w_down.dtype}")
    if x.stride(1) != 1 or w_gate_up.stride(2) != 1 or w_down.stride(2) != 1:
        raise ValueError("x and the expert weights need a contiguous last dim")


def flat(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a contiguous 1-D tensor of its own dtype: a view when it is already contiguous (no copy
    kernel per layer: the kernels widen bf16/fp16 routing weights to float32 as they load them)."""
    flat = t.reshape(-1)
    return flat if flat.is_contiguous() else flat.contiguous()


def scale_mode(scales: ExpertScales | None) -> int:
    """The kernels' ``SCALE``: 0 unquantized weights, 1 FP8 with per-row scales, 2 FP8 with block scales."""
    return 0 if scales is None else 1 if scales.block is None else 2
