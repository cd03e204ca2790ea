"""Offline ``LLM`` / ``EngineCore`` tests: seeds reproduce across batching and chunking, finish reasons,
logprobs, stop strings (real SmolLM2 tokenizer), bad input raising clearly with every block left free."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import msgspec
import pytest

from engine.llm import LLM, build_engine_config
from engine.sampling_params import SamplingParams
from tests.engine.test_loader import save_tiny_model


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory) -> Path:
    return save_tiny_model("LlamaForCausalLM", tmp_path_factory.mktemp("llm") / "m", seed=5)


def _llm(path: Path, **options) -> LLM:
    options.setdefault("num_blocks", 256)
    return LLM(str(path), dtype="float32", device="cpu", attention_backend="torch", block_size=4, **options)


def _prompts(n: int = 20, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 256) for _ in range(rng.randrange(1, 30))] for _ in range(n)]


def test_same_seed_same_tokens_batched_alone_and_chunked(tiny_path):
    """Seeded sampling with every penalty: one batch of 8 prompts (2..28 tokens), the first 5 alone, and
    the batch again in 5-token chunks draw the same tokens."""
    prompts = _prompts(8)
    params = [
        SamplingParams(
            temperature=1.0,
            top_p=0.95,
            top_k=50,
            max_tokens=8,
            seed=100 + i,
            ignore_eos=True,
            repetition_penalty=1.1,
            presence_penalty=0.3,
            frequency_penalty=0.2,
        )
        for i in range(len(prompts))
    ]
    llm = _llm(tiny_path)
    batched = [o.token_ids for o in llm.generate(prompts, params)]
    alone = [llm.generate([p], [sp])[0].token_ids for p, sp in zip(prompts[:5], params[:5], strict=True)]
    assert alone == batched[:5]
    chunked = _llm(tiny_path, max_num_batched_tokens=5)
    assert [o.token_ids for o in chunked.generate(prompts, params)] == batched
    assert all(len(t) == 8 for t in batched)
    assert len({tuple(t) for t in batched}) > 1
    llm.core.check_no_leaks()
    chunked.core.check_no_leaks()


def test_continued_generation_with_output_offset_repeats_the_unbroken_tokens(tiny_path):
    """A generation continued elsewhere (prompt + its first k tokens, ``output_offset=k``) samples the
    same tokens as the unbroken run: seeded draws hash the output position, penalties count the k."""
    prompts = _prompts(6, seed=3)
    params = [SamplingParams(temperature=1.0, top_k=50, max_tokens=8, min_tokens=6, seed=7 + i,
                             ignore_eos=True, presence_penalty=0.5, frequency_penalty=0.4,
                             repetition_penalty=1.1) for i in range(len(prompts))]
    llm = _llm(tiny_path)
    whole = [o.token_ids for o in llm.generate(prompts, params)]
    for k in (1, 3, 7):
        rest = llm.generate([p + w[:k] for p, w in zip(prompts, whole, strict=True)],
                            [msgspec.structs.replace(sp, max_tokens=8 - k, min_tokens=max(0, 6 - k),
                                                     output_offset=k) for sp in params])
        assert [w[:k] + o.token_ids for w, o in zip(whole, rest, strict=True)] == whole, k
    plain = llm.generate([p + w[:3] for p, w in zip(prompts, whole, strict=True)],
                         [msgspec.structs.replace(sp, max_tokens=5, min_tokens=3) for sp in params])
    assert [w[:3] + o.token_ids for w, o in zip(whole, plain, strict=True)] != whole  # the offset matters
    llm.core.check_no_leaks()


def test_requests_without_seed_get_one(tiny_path):
    llm = _llm(tiny_path)
    seq = llm.core.add_request("r", [5, 6, 7], SamplingParams(max_tokens=2))
    assert isinstance(seq.sampling_params.seed, int)
    while llm.core.has_unfinished():
        llm.core.step()
    llm.core.check_no_leaks()


def test_finish_reasons_and_max_tokens(tiny_path):
    llm = _llm(tiny_path)
    prompt = [10, 20, 30]
    greedy = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))[0]
    assert greedy.finish_reason == "length" and len(greedy.token_ids) == 5
    one = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1))[0]
    assert one.token_ids == greedy.token_ids[:1] and one.finish_reason == "length"
    stop_at = greedy.token_ids[2]
    stopped = llm.generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, stop_token_ids=(stop_at,))
    )[0]
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == greedy.token_ids[: greedy.token_ids.index(stop_at) + 1]
    llm.core.check_no_leaks()


def test_logprobs_shapes(tiny_path):
    llm = _llm(tiny_path)
    out = llm.generate(
        [[4, 5, 6]], SamplingParams(temperature=0.0, max_tokens=4, logprobs=3, ignore_eos=True)
    )[0]
    assert out.logprobs is not None and out.top_logprobs is not None
    assert len(out.logprobs) == len(out.top_logprobs) == 4
    for token, lp, top in zip(out.token_ids, out.logprobs, out.top_logprobs, strict=True):
        assert len(top) == 3 and top[0][0] == token  # greedy: the sampled token is the top-1
        assert abs(top[0][1] - lp) < 1e-6 and top[0][1] >= top[1][1] >= top[2][1]
    off = llm.generate([[4, 5, 6]], SamplingParams(max_tokens=2))[0]
    assert off.logprobs is None and off.top_logprobs is None


def test_bad_input_raises_and_leaves_nothing_queued(tiny_path):
    llm = _llm(tiny_path, max_model_len=32)
    ok = [1, 2, 3]
    cases: list[tuple[Any, Any, str]] = [
        (
            [ok, list(range(3, 40))],
            SamplingParams(),
            "prompt 1: prompt of 37 tokens does not fit max_model_len=32",
        ),
        ([ok, [5, 256]], SamplingParams(), "outside \\[0, vocab_size=256\\)"),
        ([ok, []], SamplingParams(), "prompt is empty"),
        ([ok, ok], [SamplingParams()] * 3, "3 SamplingParams for 2 prompts"),
        (["text"], SamplingParams(), "no tokenizer.json"),
        ([ok, "x", 3.5], SamplingParams(), "prompt 2 must be a string or a list of token ids"),
    ]
    for prompts, params, message in cases:
        with pytest.raises(ValueError, match=message):
            llm.generate(prompts, params)
        assert not llm.core.has_unfinished()
        llm.core.check_no_leaks()
    assert llm.generate(ok, SamplingParams(max_tokens=2))[0].token_ids  # still usable afterwards


def test_bad_options_raise():
    with pytest.raises(ValueError, match="unknown LLM option 'num_gpus'"):
        build_engine_config("m", num_gpus=2)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=-0.1)
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=21)


def test_max_model_len_above_model_limit(tiny_path):
    with pytest.raises(
        ValueError, match="max_model_len=4096 exceeds the model's max_position_embeddings=512"
    ):
        _llm(tiny_path, max_model_len=4096)


def test_abort_mid_generation_frees_blocks(tiny_path):
    llm = _llm(tiny_path)
    core = llm.core
    core.add_request("a", list(range(3, 23)), SamplingParams(max_tokens=50, ignore_eos=True))
    core.add_request("b", list(range(3, 13)), SamplingParams(max_tokens=50, ignore_eos=True))
    for _ in range(3):
        core.step()
    assert core.block_manager.num_free_blocks < core.block_manager.num_blocks
    core.abort_request("a")
    core.abort_request("b")
    core.check_no_leaks()
    assert core.step() == []


@pytest.fixture(scope="module")
def smol() -> LLM:
    return LLM("smollm2-135m", dtype="float32", device="cpu", attention_backend="torch", num_blocks=128)


@pytest.mark.slow
def test_smollm2_text_and_stop_strings(smol):
    plain, stopped = smol.generate(
        ["The capital of France is", "The capital of France is"],
        [
            SamplingParams(temperature=0.0, max_tokens=8),
            SamplingParams(temperature=0.0, max_tokens=8, stop=("\n",)),
        ],
    )
    assert plain.text.startswith(" Paris.") and "\n" in plain.text
    assert stopped.text == plain.text[: plain.text.index("\n")] and stopped.finish_reason == "stop"
    assert stopped.token_ids == plain.token_ids[: len(stopped.token_ids)]
    assert len(stopped.token_ids) < len(plain.token_ids)
    smol.core.check_no_leaks()


def test_runner_layer_hook_and_logits_only_for_sampling_rows(tiny_path):
    llm = _llm(tiny_path, max_num_batched_tokens=10)
    core = llm.core
    core.add_request("long", list(range(3, 20)), SamplingParams(max_tokens=2))  # 17 tokens: 2 chunks
    core.add_request("short", [7, 8], SamplingParams(max_tokens=2))
    first = core.scheduler.schedule()  # "long" gets a 10-token chunk that does not sample
    assert [(s.seq.request_id, s.num_scheduled_tokens, s.samples) for s in first.scheduled] == [
        ("long", 10, False)
    ]
    calls: list[int] = []
    assert core.runner.compute_logits(first, layer_hook=calls.append).shape == (0, 256)
    assert calls == [0, 1]  # once per layer, in order, after its KV store
    core.scheduler.update(first, {})
    second = core.scheduler.schedule()
    calls.clear()
    results = core.runner.execute(second, layer_hook=calls.append)
    assert calls == [0, 1] and set(results) == {"long", "short"}
    core.scheduler.update(second, {rid: r.token_id for rid, r in results.items()})
    while core.has_unfinished():
        core.step()
    core.check_no_leaks()
