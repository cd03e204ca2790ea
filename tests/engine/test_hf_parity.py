"""Model parity with Hugging Face transformers: greedy tokens equal and logprobs within 1e-4 of
``generate`` for tiny random Llama/Mistral/Qwen2/Qwen3 models, Phi-3 and GLM-4 (``NEW_DENSE_ARCHS``), the
mixtures of experts Qwen3-MoE, Mixtral and GLM-4.5 (``MOE_ARCHS``), and the real SmolLM2-135M, run as one
continuous batch with prefix-cache hits, chunked prefill, preemption, and the triton backend."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.llm import LLM, RequestOutput
from engine.models.registry import resolve_model
from engine.sampling_params import SamplingParams
from engine.text.tokenizer import load_tokenizer
from tests.engine.test_loader import ARCHS, MOE_ARCHS, NEW_DENSE_ARCHS, save_tiny_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=0)


def make_prompts(seed: int = 0, vocab: int = 256) -> list[list[int]]:
    """22 prompts of 1..41 tokens: random ones, 6 sharing a 13-token prefix, and one exact repeat."""
    rng = random.Random(seed)
    prompts = [
        [rng.randrange(3, vocab) for _ in range(n)] for n in (1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 41)
    ]
    prefix = [rng.randrange(3, vocab) for _ in range(13)]
    prompts += [prefix + [rng.randrange(3, vocab) for _ in range(k)] for k in (0, 1, 3, 4, 8, 20)]
    prompts += [list(prompts[11]), list(prompts[2]), prefix[:9]]
    return prompts


def hf_greedy(model, prompt: list[int], max_tokens: int, eos: int | None) -> tuple[list[int], list[float]]:
    """Greedy continuation and the raw logprob of each chosen token from transformers ``generate``."""
    out = model.generate(
        torch.tensor([prompt]),
        max_new_tokens=max_tokens,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        eos_token_id=eos,
        pad_token_id=0,
    )
    tokens = out.sequences[0, len(prompt) :].tolist()
    logprobs = [
        float(torch.log_softmax(lg[0].float(), -1)[t]) for lg, t in zip(out.logits, tokens, strict=True)
    ]
    return tokens, logprobs


def hf_greedy_batch(
    model, prompts: list[list[int]], max_tokens: int, eos: int
) -> list[tuple[list[int], list[float]]]:
    """``hf_greedy`` for all prompts in one left-padded ``generate`` call (cheaper for a real model);
    each continuation is cut after its first eos."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[eos] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=max_tokens,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        eos_token_id=eos,
        pad_token_id=eos,
    )
    results = []
    for i in range(len(prompts)):
        tokens = out.sequences[i, width:].tolist()
        if eos in tokens:
            tokens = tokens[: tokens.index(eos) + 1]
        logprobs = [float(torch.log_softmax(out.logits[j][i].float(), -1)[t]) for j, t in enumerate(tokens)]
        results.append((tokens, logprobs))
    return results


def assert_matches_hf(
    model,
    prompts: list[list[int]],
    outputs: list[RequestOutput],
    eos: int | None,
    max_tokens: int = MAX_TOKENS,
    batched: bool = False,
) -> None:
    refs = (
        hf_greedy_batch(model, prompts, max_tokens, eos)
        if batched and eos is not None
        else [hf_greedy(model, p, max_tokens, eos) for p in prompts]
    )
    for i, (prompt, out, (tokens, logprobs)) in enumerate(zip(prompts, outputs, refs, strict=True)):
        assert out.token_ids == tokens, f"prompt {i} ({len(prompt)} tokens)"
        assert out.logprobs is not None
        torch.testing.assert_close(torch.tensor(out.logprobs), torch.tensor(logprobs), atol=1e-4, rtol=0)


def count_preemptions(llm: LLM) -> list[int]:
    """Wrap the scheduler's ``schedule`` to count preempted sequences per step (instance attribute)."""
    counts: list[int] = []
    original = llm.core.scheduler.schedule

    def schedule():
        out = original()
        counts.append(len(out.preempted))
        return out

    llm.core.scheduler.schedule = schedule  # type: ignore[method-assign]
    return counts


_TINY: dict[str, tuple[Path, torch.nn.Module]] = {}


def _tiny(arch: str, factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    """One saved tiny model per architecture for the whole module, with its HF reference model."""
    if arch not in _TINY:
        path = save_tiny_model(arch, factory.mktemp(arch) / "m", seed=1)
        _TINY[arch] = path, AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    return _TINY[arch]


@pytest.fixture(scope="module", params=ARCHS)
def tiny(request, tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    return _tiny(request.param, tmp_path_factory)


# Chunking and preemption are scheduler/runner paths shared by every architecture: Llama plus Qwen3
# (q/k norms, explicit head_dim) keep the file fast.
@pytest.fixture(scope="module", params=["LlamaForCausalLM", "Qwen3ForCausalLM"])
def tiny_subset(request, tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    return _tiny(request.param, tmp_path_factory)


def _llm(path: Path, **options) -> LLM:
    return LLM(
        str(path),
        dtype="float32",
        device="cpu",
        attention_backend=options.pop("backend", "torch"),
        block_size=4,
        **options,
    )


def test_greedy_batch_with_prefix_hits_matches_hf(tiny):
    path, model = tiny
    llm = _llm(path, num_blocks=512)
    prompts = make_prompts()
    first = llm.generate(prompts, GREEDY)
    assert_matches_hf(model, prompts, first, eos=2)
    second = llm.generate(prompts[::-1], GREEDY)  # every full block now hits the prefix cache
    assert [o.token_ids for o in second] == [o.token_ids for o in first[::-1]]
    assert sum(o.num_cached_tokens for o in second) >= sum(len(p) // 4 * 4 for p in prompts) - 4 * len(
        prompts
    )
    assert any(o.num_cached_tokens > 0 for o in second)
    llm.core.check_no_leaks()


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_moe_greedy_batch_with_prefix_hits_matches_hf(arch, tmp_path_factory):
    """A mixture of experts (transformers' modules, paged attention) in one continuous batch, then again
    with every full block a prefix-cache hit: 8 of the prompts (two sharing a prefix, one a prefix of
    those), 6 tokens each, to keep the per-prompt ``generate`` reference cheap."""
    path, model = _tiny(arch, tmp_path_factory)
    llm = _llm(path, num_blocks=256)
    prompts = make_prompts()[::3]
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=0)
    first = llm.generate(prompts, params)
    assert_matches_hf(model, prompts, first, eos=2, max_tokens=6)
    second = llm.generate(prompts[::-1], params)
    assert [o.token_ids for o in second] == [o.token_ids for o in first[::-1]]
    again = torch.tensor([lp for o in second for lp in o.logprobs or []])
    torch.testing.assert_close(again, torch.tensor([lp for o in first[::-1] for lp in o.logprobs or []]),
                               atol=1e-4, rtol=0)
    assert sum(o.num_cached_tokens for o in second) >= sum(len(p) // 4 * 4 - 4 for p in prompts if len(p) > 4)
    llm.core.check_no_leaks()


@pytest.mark.parametrize("fused_ops", ["off", "on"])
@pytest.mark.parametrize("arch", NEW_DENSE_ARCHS)
def test_new_dense_greedy_batch_with_prefix_hits_matches_hf(arch, fused_ops, tmp_path_factory):
    """Phi-3 and GLM-4, through transformers' modules and through the fused forward (torch references),
    fp32, in one continuous batch with a chunked prefill, then again with every full block a prefix-cache
    hit: greedy tokens and logprobs equal transformers'."""
    path, model = _tiny(arch, tmp_path_factory)
    llm = _llm(path, num_blocks=256, fused_ops=fused_ops, max_num_batched_tokens=32)
    assert (llm.core.runner.net is llm.core.runner.model) == (fused_ops == "off")
    prompts = make_prompts()[::3]
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=0)
    first = llm.generate(prompts, params)
    assert_matches_hf(model, prompts, first, eos=2, max_tokens=6)
    second = llm.generate(prompts[::-1], params)
    assert [o.token_ids for o in second] == [o.token_ids for o in first[::-1]]
    again = torch.tensor([lp for o in second for lp in o.logprobs or []])
    torch.testing.assert_close(again, torch.tensor([lp for o in first[::-1] for lp in o.logprobs or []]),
                               atol=1e-4, rtol=0)
    assert sum(o.num_cached_tokens for o in second) >= sum(len(p) // 4 * 4 - 4 for p in prompts if len(p) > 4)
    llm.core.check_no_leaks()


def test_chunked_prefill_matches_hf(tiny_subset):
    path, model = tiny_subset
    llm = _llm(path, num_blocks=512, max_num_batched_tokens=7)
    prompts = make_prompts(seed=2)
    outs = llm.generate(prompts, GREEDY)
    assert_matches_hf(model, prompts, outs, eos=2)
    assert any(o.num_cached_tokens > 0 for o in outs)  # later admissions hit earlier prompts' blocks
    llm.core.check_no_leaks()


def test_preemption_matches_hf(tiny_subset):
    path, model = tiny_subset
    llm = _llm(path, num_blocks=24, enable_prefix_caching=False)  # 96 token slots for ~600 tokens
    preempted = count_preemptions(llm)
    prompts = make_prompts(seed=3)
    outs = llm.generate(prompts, GREEDY)
    assert sum(preempted) > 0
    assert_matches_hf(model, prompts, outs, eos=2)
    llm.core.check_no_leaks()


def test_triton_backend_matches_hf(tmp_path):
    """The triton kernels in one batch under a 16-token budget: a 31-token prompt chunked over several
    steps beside decode rows, and a 9-token prefix of the first prompt (14 tokens, computed in the first
    step) hitting its two cached blocks."""
    path = save_tiny_model("Qwen3ForCausalLM", tmp_path / "m", seed=4)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    llm = _llm(path, num_blocks=128, backend="triton", max_num_batched_tokens=16)
    every = make_prompts(seed=4)
    prompts = [every[14], every[0], every[11], every[21]]
    assert [len(p) for p in prompts] == [14, 1, 31, 9] and prompts[3] == prompts[0][:9]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4, logprobs=0))
    assert_matches_hf(model, prompts, outs, eos=2, max_tokens=4)
    assert outs[3].num_cached_tokens == 8
    llm.core.check_no_leaks()


SMOL_TEXTS = [
    "The capital of France is",
    "Hello",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "1, 2, 3, 4,",
    "The quick brown fox",
    "Water boils at",
    "My favourite colour is",
    "In 1492, Columbus",
    "The meaning of life is",
    "Translate to French: cheese",
    "import numpy as np\n",
    "A list of fruits: apple, banana,",
    "The largest planet in the solar system is",
    "Q: What is 2+2?\nA:",
    "Roses are red,",
    "The speed of light is about",
    "Machine learning is a field of",
    "Paris is the capital of",
    "The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is Rome. "
    "The capital of Spain is",
]


@pytest.mark.slow
def test_smollm2_greedy_matches_hf():
    path = resolve_model("smollm2-135m")  # converted once into the user cache, reused afterwards
    tok = load_tokenizer(path)
    prompts = [tok.encode(t) for t in SMOL_TEXTS]
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    llm = LLM("smollm2-135m", dtype="float32", device="cpu", attention_backend="torch", num_blocks=256)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6, logprobs=0))
    assert len(prompts) >= 20
    assert_matches_hf(model, prompts, outs, eos=2, max_tokens=6, batched=True)
    assert outs[0].text.startswith(" Paris")
    again = llm.generate([prompts[-1]], SamplingParams(temperature=0.0, max_tokens=6))[0]
    assert again.num_cached_tokens == len(prompts[-1]) // 16 * 16 > 0
    assert again.token_ids == outs[-1].token_ids
    llm.core.check_no_leaks()
