"""The host KV tier in a whole engine (the embedded SmolLM2, fp32 on the CPU, a device pool of 12 blocks):
a prompt's prefix evicted from the device pool by other prompts comes back from the tier, and the greedy
answer served from it equals the fresh one. With the prefill grid (``prefill_grid``) the tokens and
logprobs are bit-identical; without it the second request computes a shorter suffix (other GEMM shapes)
and only the tokens are compared, the logprobs within 1e-4 (measured differences: a few 1e-6, as for a
device-cache hit, tests/engine/test_prefix_determinism.py). Each test ends with a leak check."""

from __future__ import annotations

import pytest
import torch

from engine.kv_host_tier import KVHostTier
from engine.llm import LLM, RequestOutput
from engine.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")
NUM_BLOCKS = 12
BLOCK_BYTES = 30 * 2 * 16 * 3 * 64 * 4  # SmolLM2-135M, fp32: 30 layers, K and V, 16 tokens, 3 heads x 64


def ids(seed: int, n: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return [int(t) for t in torch.randint(100, 20000, (n,), generator=gen)]


def run(llm: LLM, prompt: list[int], max_tokens: int = 3) -> RequestOutput:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=1, ignore_eos=True)
    return llm.generate([prompt], params)[0]


@pytest.mark.parametrize(("grid", "hit"), [(32, 128), (0, 144)], ids=["grid", "no-grid"])
def test_a_prefix_evicted_to_the_host_gives_the_fresh_answer(grid: int, hit: int) -> None:
    llm = LLM("smollm2-135m", dtype="float32", device="cpu", attention_backend="torch", num_blocks=NUM_BLOCKS,
              prefill_grid=grid, host_kv_bytes=64 * BLOCK_BYTES)
    tier = llm.core.host_tier
    assert isinstance(tier, KVHostTier) and tier.num_blocks == 64
    prompt = ids(3, 146)
    fresh = run(llm, prompt)
    run(llm, ids(10, 180), max_tokens=1)  # every one of the 12 blocks: the first prompt's are evicted
    assert tier.stats.saved_blocks >= hit // 16
    hits_before = tier.stats.hits
    again = run(llm, prompt)
    assert (fresh.num_cached_tokens, again.num_cached_tokens) == (0, hit)
    assert tier.stats.hits - hits_before == hit // 16  # every cached block came from the host tier
    assert again.token_ids == fresh.token_ids
    assert again.logprobs is not None and fresh.logprobs is not None
    if grid:
        assert again.logprobs == fresh.logprobs
        assert again.top_logprobs == fresh.top_logprobs
    else:
        assert max(abs(a - b) for a, b in zip(again.logprobs, fresh.logprobs, strict=True)) < 1e-4
    llm.core.check_no_leaks()
    tier.check()
