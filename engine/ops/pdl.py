"""Programmatic dependent launch (PDL) for pdserve's Triton kernels on Hopper and newer GPUs.

A decode step of Llama-3-8B at batch 1 is ~330 short kernels in one CUDA graph; between two dependent
kernels the GPU drains the first, flushes its writes and only then launches the second, a gap of a few
microseconds each (docs/benchmarks/engine.md). With PDL (CUDA Programming Guide, "Programmatic
Dependent Launch and Synchronization"; PTX ``griddepcontrol``) a kernel launched with the
programmatic-stream-serialization attribute may start as soon as every program of the kernel before it
has executed ``griddepcontrol.launch_dependents``, and blocks in ``griddepcontrol.wait`` until that
kernel has completed and its memory is visible. Its launch and prologue then overlap the tail of its
predecessor.

The rule every kernel here follows (``gdc_enter``): nothing that the kernel just before may write is read,
and nothing at all is written, before ``griddepcontrol.wait``; right after it the kernel lets its own
successor launch. Data no kernel writes during a step (weights) may be loaded before the wait
(``engine.ops.gemv`` prefetches its first weight tile there). So may data written by a kernel further
back, provided the kernel just before is one of these (it executes ``launch_dependents`` only after its
own wait has returned, i.e. after every kernel before it has completed) or was launched without PDL (then
this kernel launches only after it has completed). The CUDA guide promises visibility only after
``griddepcontrol.wait``; such data is therefore read through L2 (``cache_modifier=".cg"``), where a
completed kernel's writes are, never from an L1 line an earlier kernel left on the SM (the matrix-vector
MoE down kernel reads the expert ids, written before the gate/up kernel, this way). Because every PDL
kernel waits for its predecessor before it can finish, a chain of them stays ordered like plain stream
order; a kernel that is not PDL-aware (cuBLAS, torch) before or after one is ordered as usual, and a PDL
kernel right after it is not launched early at all.

``pdl_kwargs(tensor)`` gives the launch arguments: ``USE_GDC`` (a ``tl.constexpr`` of each kernel) and
Triton's ``launch_pdl`` compile option, both on only for a one-row launch (``tensor.shape[0] == 1``: every
kernel here is given its step's token-major input, so this means a one-token step, i.e. batch-1 decode)
of a CUDA tensor on a device of compute capability >= 9.0, outside the Triton interpreter, while the
process switch (``set_pdl``; ``ModelConfig.pdl``) is on. Measured on an H200 (Llama-3-8B shapes,
docs/benchmarks/engine.md): batch-1 decode 80.0 -> 83.3 % of the HBM roofline with PDL, but batches
8 and 32, where cuBLAS GEMMs sit between the Triton kernels, 1-2 points slower in three runs out of three;
hence one-row launches only.

One exception, by predecessor (``pdl_kwargs(..., late_after=)``): the decode attention's split kernel is
launched *without* the early launch when the previous ``pdl_kwargs`` call of the process was a one-row
PDL launch of a GEMV (Llama's and Mistral's QKV projection; Qwen3's per-head norm sits between the two;
within one captured graph host order is stream order, and a torch or cuBLAS kernel in between would
already keep the split from launching early). It then starts when the GEMV has completed; its
``griddepcontrol.wait`` returns at once and it still lets its own successor launch early. Measured on an
H200 (batch-1 decode graph, 1k context, best of 5 x 50 replays, 3 alternated rounds, 2026-12-04):
Llama-3-8B shape 4 131 -> 4 087 us a step in bf16 (~1.4 us a layer) and 2 836 -> 2 806 us with FP8
weights (~0.9 us a layer), 1.01x both; after Qwen3's head norm the late launch was 1.3 % slower, and
launching any other kernel of these models late was 0.4-5.6 % slower (the first input RMSNorm: no
change). Likely, not profiled: launched early, the split kernel's programs take SM slots while the
GEMV's last programs still stream weights.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

GEMV_KERNELS = frozenset({"gemv", "fp8_gemv"})
"""The ``kernel`` names the one-row GEMVs give ``pdl_kwargs`` (``engine.ops.gemv.gemv``, the row-blocked
``engine.ops.fp8_gemv.fp8_gemv``, which a one-row QKV projection runs): the predecessors after which the
decode split kernel is launched late."""


@dataclass
class _Launches:
    """The process switch and the name of the last launch ``pdl_kwargs`` was asked for ("" when that
    launch was not a PDL one): host launch order is stream order within one captured graph."""

    enabled: bool = True
    last: str = ""


_state = _Launches()


def set_pdl(enabled: bool) -> None:
    """Turn programmatic dependent launch on or off for kernels launched from now on in this process
    (the model runner applies ``ModelConfig.pdl`` before it captures its CUDA graphs)."""
    _state.enabled = bool(enabled)


def pdl_enabled() -> bool:
    """The process switch set by ``set_pdl`` (default on)."""
    return _state.enabled


@functools.cache
def _device_supports(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) >= (9, 0)


def pdl_active(t: torch.Tensor) -> bool:
    """Whether a kernel whose token-major input is ``t`` is launched with PDL: the switch is on, ``t`` has
    one row (a one-token step), is on a CUDA device of compute capability >= 9.0 (Hopper) and the Triton
    interpreter is off."""
    if not (_state.enabled and t.is_cuda and t.dim() > 0 and t.shape[0] == 1):
        return False
    if os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return _device_supports(t.device.index if t.device.index is not None else torch.cuda.current_device())


def pdl_kwargs(t: torch.Tensor, kernel: str = "",
               late_after: frozenset[str] = frozenset()) -> dict[str, bool]:
    """Extra keyword arguments for a Triton launch of a kernel taking ``USE_GDC: tl.constexpr``:
    ``{"USE_GDC": True, "launch_pdl": True}`` when ``pdl_active(t)``, else ``{"USE_GDC": False}``; but
    ``{"USE_GDC": True}`` (no early launch, module docstring) when the previous call was for a PDL
    launch named in ``late_after``. ``kernel``: this launch's name, remembered for the next call."""
    previous, _state.last = _state.last, ""
    if pdl_active(t):
        _state.last = kernel
        if previous in late_after:
            return {"USE_GDC": True}
        return {"USE_GDC": True, "launch_pdl": True}
    return {"USE_GDC": False}


@triton.jit
def gdc_enter(USE_GDC: tl.constexpr):  # type: ignore[no-untyped-def]  # Triton helper
    """Wait for the predecessor, then let the successor launch; only loads the rule above allows come
    before it in a kernel."""
    if USE_GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()

