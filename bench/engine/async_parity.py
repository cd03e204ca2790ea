"""Greedy parity of asynchronous scheduling on one engine (``bench.engine.throughput --parity-batches``).

A benchmark-side check, run on the GPU next to the speed figures: the same greedy requests give the same
tokens with ``EngineCore.async_scheduling`` on and off (CPU tests: tests/engine/test_async_scheduling.py).
"""

from __future__ import annotations

import time

from bench.common import random_prompts
from engine.engine_core import EngineCore
from engine.sampling_params import SamplingParams


def async_parity(core: EngineCore, batch: int, new_tokens: int) -> bool:
    """True when ``batch`` greedy requests (64-token prompts, prefilled for real) get the same tokens
    with asynchronous scheduling as without, on the same engine."""
    runs = []
    prompts = random_prompts(batch, 64, core.runner.vocab_size, seed=batch)
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    for mode in (False, True):
        core.async_scheduling = mode
        got: dict[int, list[int]] = {i: [] for i in range(batch)}
        ids = {f"p{mode:d}-{i}-{time.monotonic_ns()}": i for i in range(batch)}
        for rid, i in ids.items():
            core.add_request(rid, prompts[i], params)
        while core.has_unfinished():
            for out in core.step():
                got[ids[out.request_id]].append(out.token_id)
        core.check_no_leaks()
        runs.append(got)
    core.async_scheduling = False
    return runs[0] == runs[1]
