"""A prefix-cache hit does not change the answer (engine level, the embedded SmolLM2, fp32 on the CPU).

The same greedy request runs twice through one ``LLM``: the second takes its prefix from the prefix
cache. With the prefill grid (``prefill_grid``) its tokens and logprobs (top-1 included) equal the
first's bit for bit. Without it the second computes only the suffix (GEMMs over fewer rows, attention
over other shapes) and its logprobs move by a few 1e-6: that case runs the same assertions under
``xfail(strict=True)``, so it shows the comparison can fail and fails the suite if it stops failing.
Each test ends with a leak check of the engine's KV blocks. The last test runs the Triton kernels
(through Triton's interpreter) with the grid.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.engine_core import EngineCore
from engine.llm import LLM, RequestOutput
from engine.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")
GRID = 32


def prompt_ids() -> list[int]:
    """146 token ids (seeded): the grid-less hit covers 144 of them, the grid hit 128."""
    gen = torch.Generator().manual_seed(3)
    n = int(torch.randint(40, 200, (1,), generator=gen))
    return [int(t) for t in torch.randint(100, 20000, (n,), generator=gen)]


@pytest.fixture(scope="module")
def engines() -> Iterator[dict[int, LLM]]:
    """One ``LLM`` per prefill grid (0: off), built on first use and closed after the module."""
    made: dict[int, LLM] = {}
    yield made
    for engine in made.values():
        engine.close()


def engine(engines: dict[int, LLM], grid: int) -> LLM:
    if grid not in engines:
        engines[grid] = LLM("smollm2-135m", dtype="float32", device="cpu", attention_backend="torch",
                            num_blocks=64, prefill_grid=grid)
    return engines[grid]


def twice(llm: LLM, prompt: list[int], max_tokens: int) -> tuple[RequestOutput, RequestOutput]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=1, ignore_eos=True)
    first = llm.generate([prompt], params)[0]
    second = llm.generate([prompt], params)[0]
    llm.core.block_manager.check_no_leaks()
    return first, second


@pytest.mark.parametrize(("grid", "hit"), [
    (GRID, 128),
    pytest.param(0, 144, marks=pytest.mark.xfail(
        strict=True, raises=AssertionError,
        reason="no prefill grid: the hit's logprobs differ from the fresh ones by a few 1e-6")),
], ids=["grid", "no-grid"])
def test_second_greedy_request_equals_the_first_bit_for_bit(engines: dict[int, LLM], grid: int,
                                                            hit: int) -> None:
    first, second = twice(engine(engines, grid), prompt_ids(), 3)
    assert (first.num_cached_tokens, second.num_cached_tokens) == (0, hit)
    assert second.token_ids == first.token_ids
    assert second.logprobs == first.logprobs
    assert second.top_logprobs == first.top_logprobs


def test_grid_hit_after_a_longer_prompt_equals_a_fresh_engine(engines: dict[int, LLM]) -> None:
    """A prompt extending a cached one and its output (a second turn) gets the same bits as on an engine
    that never saw the first: the hit covers whole prefill grid chunks only (96 of the first turn's 102
    tokens with KV; its last chunk and its decoded token are computed again)."""
    llm = engine(engines, GRID)
    base = prompt_ids()
    params = SamplingParams(temperature=0.0, max_tokens=3, logprobs=1, ignore_eos=True)
    turn1 = llm.generate([base[:100]], params)[0]
    turn2 = base[:100] + turn1.token_ids + base[100:]
    hit = llm.generate([turn2], params)[0]
    assert hit.num_cached_tokens == 96
    fresh_engine = LLM("smollm2-135m", dtype="float32", device="cpu", attention_backend="torch",
                       num_blocks=64, prefill_grid=GRID)
    try:
        fresh = fresh_engine.generate([turn2], params)[0]
        assert fresh.num_cached_tokens == 0
        assert (hit.token_ids, hit.logprobs, hit.top_logprobs) == (fresh.token_ids, fresh.logprobs,
                                                                   fresh.top_logprobs)
        llm.core.block_manager.check_no_leaks()
        fresh_engine.core.block_manager.check_no_leaks()
    finally:
        fresh_engine.close()


def test_triton_kernels_give_a_grid_hit_the_fresh_bits(tiny_dummy_dir: Path) -> None:
    """The same through the Triton kernels (store, paged prefill and decode attention; Triton's
    interpreter on the CPU), tiny dummy Llama in fp32: the hit's chunks read the cached prefix as the
    fresh run's chunks read the KV of their earlier chunks. 97 tokens: the hit is 96 tokens. There is no
    grid-less case here: under the interpreter (``tl.dot`` summing each output over K in one order,
    tests/interpreter_dot.py) the hit's one-token suffix through the decode kernel can give the fresh
    prompt's bits, so its difference would be a property of the CPU's BLAS, not of the kernels; on a GPU
    it differs (``bench.engine.prefix_grid --grids 0,512``: grid 0, 0 of 8 identical)."""
    core = EngineCore(EngineConfig(
        ModelConfig(str(tiny_dummy_dir), load_format="dummy", dtype="float32", device="cpu",
                    attention_backend="triton"),
        CacheConfig(block_size=16, num_blocks=32), SchedulerConfig(max_num_seqs=2, prefill_grid=GRID)))
    prompt = [(7 * i + 3) % 250 + 3 for i in range(97)]
    params = SamplingParams(temperature=0.0, max_tokens=3, logprobs=1, ignore_eos=True)
    runs = []
    for rid in ("first", "second"):
        seq = core.add_request(rid, prompt, params)
        outs = []
        while core.has_unfinished():
            outs.extend((o.token_id, o.logprob, o.top_logprobs) for o in core.step())
        runs.append((seq.num_cached_tokens, outs))
    (hit1, first), (hit2, second) = runs
    assert (hit1, hit2) == (0, 96) and len(first) == 3
    assert second == first
    core.check_no_leaks()
