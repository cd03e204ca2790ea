"""The engine with an FP8 KV cache (``kv_cache_dtype="fp8"``) on a tiny random-weight Llama (fp32 weights).

* Against the fp32 cache: the logprob of each token of the fp32 cache's greedy continuation, teacher-forced
  (prompt logprobs over prompt + continuation), is within ``LOGPROB_TOL`` nats. Why that bound: e4m3
  keeps 3 mantissa bits (relative rounding up to 2**-4, about 2 % rms, per K/V element; this model's K/V
  are of magnitude ~1, median 1.0, so scale 1.0 keeps them in e4m3's normal range). Through two layers of
  this random model, whose next-token distributions are sharp (logprobs near -2 over 256 tokens), that
  moved the 18 teacher-forced logprobs by at most 0.17 nat (0.07 typical); 0.3 is that with margin. It
  does not hide a garbled read (bytes read as another dtype, a block of another sequence), which moves
  logprobs by nats.
* The triton kernels (interpreter) and the torch references on the FP8 cache store the same bytes and give
  the same greedy tokens with logprobs within 1e-4 (fp32 attention over identical dequantised values).
* Every block is free afterwards.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.llm import LLM
from engine.sampling_params import SamplingParams
from tests.engine.test_loader import save_tiny_model

PROMPTS = [[5, 17, 42, 9, 200, 3, 77, 18, 18, 101, 64, 7, 150], [8, 8, 91, 4], [33] * 9 + [250, 1, 2]]
LOGPROB_TOL = 0.3
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model("LlamaForCausalLM", tmp_path_factory.mktemp("fp8kv") / "m", seed=3)


def _llm(path: Path, backend: str = "torch", **options: object) -> LLM:
    return LLM(str(path), dtype="float32", device="cpu", attention_backend=backend, block_size=4,
               num_blocks=64, **options)


def _greedy(llm: LLM) -> list[tuple[list[int], list[float]]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    outs = llm.generate(PROMPTS, [params] * len(PROMPTS))
    return [(o.token_ids, [float(x) for x in (o.logprobs or [])]) for o in outs]


def _teacher_forced(llm: LLM, continuations: list[list[int]]) -> list[list[float]]:
    """Prompt logprobs of each continuation's tokens given prompt + the tokens before them."""
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, prompt_logprobs=0)
    full = [p + c for p, c in zip(PROMPTS, continuations, strict=True)]
    outs = llm.generate(full, [params] * len(full))
    got = []
    for prompt, o in zip(PROMPTS, outs, strict=True):
        entries = o.prompt_logprobs
        assert entries is not None
        got.append([float(e.logprob) for e in entries[len(prompt):] if e is not None])
    return got


def test_fp8_cache_logprobs_close_to_fp32_cache(tiny_path: Path) -> None:
    ref_llm = _llm(tiny_path)
    ref = _greedy(ref_llm)
    conts = [tokens for tokens, _ in ref]
    want = _teacher_forced(ref_llm, conts)
    fp8 = _llm(tiny_path, kv_cache_dtype="fp8")
    assert fp8.core.runner.kv_cache.kv_buffer.dtype.itemsize == 1
    got = _teacher_forced(fp8, conts)
    worst = max(abs(a - b) for w, g in zip(want, got, strict=True) for a, b in zip(w, g, strict=True))
    assert all(len(g) == MAX_TOKENS for g in got)
    assert worst < LOGPROB_TOL, worst
    # the FP8 cache really holds other values than the fp32 one: the logprobs are not bit-identical
    assert worst > 0.0
    ref_llm.core.check_no_leaks()
    fp8.core.check_no_leaks()


def test_fp8_cache_triton_kernels_equal_torch_references(tiny_path: Path) -> None:
    torch_llm = _llm(tiny_path, kv_cache_dtype="fp8")
    triton_llm = _llm(tiny_path, backend="triton", kv_cache_dtype="fp8", fused_ops="on")
    want, got = _greedy(torch_llm), _greedy(triton_llm)
    assert [t for t, _ in got] == [t for t, _ in want]
    for (_, a), (_, b) in zip(got, want, strict=True):
        assert max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-4
    torch_llm.core.check_no_leaks()
    triton_llm.core.check_no_leaks()


def test_kv_cache_dtype_refused_by_name() -> None:
    from engine.config import CacheConfig

    with pytest.raises(ValueError, match="kv_cache_dtype"):
        CacheConfig(kv_cache_dtype="fp8_e5m2")
