"""transformers ``generate``, the peer the engine's tokens/s are divided by, timed as the engine is.

One call of ``hf_rates`` is one repeat: a 1-token ``generate`` (its time is the prefill) and an
``new_tokens``-token ``generate`` of the same equal-length batch (its extra time over the first is the
decode of ``new_tokens - 1`` tokens per sequence), greedy, ``min_new_tokens`` pinning the length, each
between two device synchronisations on the host clock. ``generate`` is much slower on its first call
(an H200, Llama-3-8B shapes, batch 1: 16.9 then 41.3 tok/s), so the caller warms it up with the same
number of untimed calls as the engine (``bench.timing.interleaved``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from bench.common import random_prompts, sync
from engine.models.hf_attention import install_paged_attention


@dataclass(frozen=True)
class Rates:
    """One repeat's tokens/s: ``prefill`` (prompt tokens / seconds to the first token) and ``decode``
    (tokens after the first / their seconds)."""

    prefill: float
    decode: float


@torch.inference_mode()
def hf_rates(model: Any, prompts: list[list[int]], new_tokens: int,
             clock: Callable[[], float] = time.perf_counter) -> Rates:
    """One repeat of transformers ``generate`` on ``prompts`` (equal lengths), see the module docstring.
    Raises ValueError for ``new_tokens`` < 2, RuntimeError when the decode time comes out non-positive
    (the two calls' noise larger than the decode itself: raise ``new_tokens``)."""
    if new_tokens < 2:
        raise ValueError(f"new_tokens must be >= 2 (a prefill token and a decode one), got {new_tokens}")
    ids = torch.tensor(prompts, device=next(model.parameters()).device)
    kwargs: dict[str, Any] = dict(do_sample=False, pad_token_id=0)
    sync(ids.device)
    started = clock()
    model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kwargs)
    sync(ids.device)
    prefill_s = clock() - started
    started = clock()
    model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kwargs)
    sync(ids.device)
    decode_s = clock() - started - prefill_s
    if decode_s <= 0:
        raise RuntimeError(f"decode time {decode_s:.3g} s is not positive: raise new_tokens ({new_tokens})")
    return Rates(ids.numel() / prefill_s, len(prompts) * (new_tokens - 1) / decode_s)


def hf_decode(core: Any, batch: int, context: int, new_tokens: int) -> float:
    """Decode tokens/s of transformers ``generate`` on the engine's own model object (its weights),
    switched to SDPA attention for the call and back to the engine's paged attention after; prompts of
    ``context`` random tokens (seed 7)."""
    model = core.runner.model
    model.set_attn_implementation("sdpa")
    try:
        prompts = random_prompts(batch, context, core.runner.vocab_size, seed=7)
        return hf_rates(model, prompts, new_tokens).decode
    finally:
        install_paged_attention(model)
