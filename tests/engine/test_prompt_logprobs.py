"""Prompt logprobs in the engine: equal to a plain float32 ``log_softmax`` of the model's logits over the
whole prompt (transformers forward, no KV cache), chunked or not, batched with other requests, with
the prefix cache skipped for the positions they need; ranks and top-N consistent; no block leaked."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.llm import LLM
from engine.prompt_logprobs import PromptTokenLogprob, prompt_token_logprobs
from engine.sampling_params import SamplingParams
from tests.engine.test_loader import save_tiny_model

PROMPT = [5, 17, 42, 9, 200, 3, 77, 18, 18, 101, 64, 7, 150]


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory) -> Path:
    return save_tiny_model("LlamaForCausalLM", tmp_path_factory.mktemp("plp") / "m", seed=11)


def _llm(path: Path, **options) -> LLM:
    options.setdefault("num_blocks", 128)
    return LLM(str(path), dtype="float32", device="cpu", attention_backend="torch", block_size=4, **options)


def _reference(path: Path, prompt: list[int]) -> torch.Tensor:
    """``[n - 1, vocab]`` float32 logprobs of tokens 1..n-1 from a plain transformers forward."""
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = model(torch.tensor([prompt])).logits[0]
    return logits[:-1].float().log_softmax(dim=-1)


def _check(entries: list[PromptTokenLogprob | None], ref: torch.Tensor, prompt: list[int], top: int) -> None:
    assert entries[0] is None and len(entries) == len(prompt)
    for i, e in enumerate(entries[1:]):
        assert e is not None
        row, token = ref[i], prompt[i + 1]
        assert abs(e.logprob - row[token].item()) < 1e-4
        assert e.rank == int((row > row[token]).sum()) + 1
        vals, ids = row.topk(top)
        assert [t for t, _ in e.top] == ids.tolist()
        assert all(abs(lp - v) < 1e-4 for (_, lp), v in zip(e.top, vals.tolist(), strict=True))


def test_prompt_logprobs_equal_a_full_forward_whole_chunked_and_batched(tiny_path):
    ref = _reference(tiny_path, PROMPT)
    other = [3, 4, 5, 6, 7, 8, 9]
    for options in ({}, {"max_num_batched_tokens": 5}):
        llm = _llm(tiny_path, **options)
        want, plain = llm.generate([PROMPT, other], [
            SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=4, ignore_eos=True),
            SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)])
        assert want.prompt_logprobs is not None and plain.prompt_logprobs is None
        _check(want.prompt_logprobs, ref, PROMPT, 4)
        alone = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))[0]
        assert alone.token_ids == want.token_ids  # asking for them changes no output token
        llm.core.check_no_leaks()


def test_prompt_logprobs_zero_top_and_one_token_prompt(tiny_path):
    llm = _llm(tiny_path)
    out = llm.generate([PROMPT[:5]], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    assert out.prompt_logprobs is not None
    _check(out.prompt_logprobs, _reference(tiny_path, PROMPT[:5]), PROMPT[:5], 0)
    assert all(e is None or e.top == [] for e in out.prompt_logprobs)
    single = llm.generate([[9]], SamplingParams(max_tokens=1, prompt_logprobs=2))[0]
    assert single.prompt_logprobs == [None]
    llm.core.check_no_leaks()


def test_prompt_logprobs_skip_the_prefix_cache(tiny_path):
    llm = _llm(tiny_path, enable_prefix_caching=True)
    first = llm.generate([PROMPT], SamplingParams(max_tokens=1))[0]
    again = llm.generate([PROMPT], SamplingParams(max_tokens=1))[0]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens == 12  # the cache holds the prompt
    with_lp = llm.generate([PROMPT], SamplingParams(max_tokens=1, prompt_logprobs=1))[0]
    assert with_lp.num_cached_tokens == 0
    assert with_lp.prompt_logprobs is not None
    _check(with_lp.prompt_logprobs, _reference(tiny_path, PROMPT), PROMPT, 1)
    llm.core.check_no_leaks()


def test_prompt_token_logprobs_chunks_agree_and_bad_shapes_raise():
    torch.manual_seed(0)
    logits = torch.randn(7, 50, dtype=torch.float16)
    targets = torch.randint(0, 50, (7,))
    whole = prompt_token_logprobs(logits, targets, 3)
    assert prompt_token_logprobs(logits, targets, 3, rows_per_chunk=2) == whole
    ref = logits.float().log_softmax(-1)
    for i, e in enumerate(whole):
        assert abs(e.logprob - ref[i, targets[i]].item()) < 1e-6
        assert e.rank == int((ref[i] > ref[i, targets[i]]).sum()) + 1
    with pytest.raises(ValueError, match="rows"):
        prompt_token_logprobs(logits, targets[:3], 3)
    with pytest.raises(ValueError, match="rows_per_chunk"):
        prompt_token_logprobs(logits, targets, 3, rows_per_chunk=0)
