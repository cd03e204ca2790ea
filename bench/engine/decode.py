"""Decode tokens/s of an ``EngineCore``, entered as a decode worker enters requests (no prefill run).

``enter_decodes`` puts ``batch`` greedy sequences whose ``context`` tokens of KV have "landed"
(``Scheduler.add_waiting_for_kv`` + ``kv_landed``; the KV contents do not change the speed);
``timed_decode`` runs them to the end and counts exactly the tokens of the steps it timed:

- one warm-up step, untimed, with asynchronous scheduling switched off for it, so that no step is
  launched ahead while the clock is stopped (engine/async_step.py: with it on, a step also launches the
  next one, whose tokens the following call returns);
- the device synchronised, the clock started, then every step until no request is left, each step's
  returned tokens counted, the device synchronised, the clock stopped.

A step launched inside the timed window is counted and only those: with asynchronous scheduling the
first timed call launches its own step and the next, so every token it and the later calls return comes
from work issued after the clock started.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sized
from typing import Protocol

import torch

from bench.common import random_prompts, sync
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence


class DecodeEngine(Protocol):
    """What ``timed_decode`` uses of ``EngineCore``."""

    async_scheduling: bool

    def step(self) -> Sized: ...
    def has_unfinished(self) -> bool: ...
    def check_no_leaks(self) -> None: ...


def enter_decodes(core: object, batch: int, context: int, max_tokens: int, tag: str) -> None:
    """``batch`` greedy ``ignore_eos`` sequences of ``context`` random prompt tokens (ids ``{tag}-{i}``)
    with their KV landed and first token 5, ready for decode steps. Raises RuntimeError when the KV
    cache has too few free blocks."""
    sched, vocab = core.scheduler, core.runner.vocab_size  # type: ignore[attr-defined]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, prompt in enumerate(random_prompts(batch, context, vocab, seed=context + batch)):
        seq = Sequence(f"{tag}-{i}", prompt, params, time.monotonic(), core.eos_token_ids)  # type: ignore[attr-defined]
        if not sched.add_waiting_for_kv(seq):
            raise RuntimeError(f"no KV blocks for batch {batch} x {context} tokens: raise --num-blocks")
        sched.kv_landed(seq.request_id, first_token=5)


def timed_decode(core: DecodeEngine, device: torch.device,
                 clock: Callable[[], float] = time.perf_counter) -> tuple[int, float]:
    """Run the entered requests to the end (module docstring); returns (tokens returned by the timed
    steps, seconds). Ends with the engine's leak check (AssertionError on a leak)."""
    mode = core.async_scheduling
    core.async_scheduling = False
    try:
        core.step()
    finally:
        core.async_scheduling = mode
    sync(device)
    started, tokens = clock(), 0
    while core.has_unfinished():
        tokens += len(core.step())
    sync(device)
    seconds = clock() - started
    core.check_no_leaks()
    return tokens, seconds


def decode_rate(core: object, batch: int, context: int, new_tokens: int) -> float:
    """Decode tokens/s of ``batch`` sequences with ``context`` tokens of KV each, ``new_tokens`` output
    tokens (the first one given), in the engine's current mode (graphs or eager, asynchronous scheduling
    on or off). Raises RuntimeError without enough KV blocks."""
    enter_decodes(core, batch, context, new_tokens, f"d{time.monotonic_ns()}")
    tokens, seconds = timed_decode(core, core.runner.device)  # type: ignore[arg-type,attr-defined]
    return tokens / seconds
