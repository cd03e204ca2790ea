"""The cuDNN path for a long prompt with no cached context (engine/ops/cudnn_attention.py): which steps take
it (CPU), and on a GPU its output against the plain-torch reference and the paged Triton kernel, its
determinism, and the triton backend's dispatch."""

from __future__ import annotations

import pytest
import torch

from engine.ops.cudnn_attention import (
    CUDNN_MAX_TOKENS,
    CUDNN_MIN_TOKENS,
    causal_attention_reference,
    cudnn_causal_attention,
    fresh_prefill_rows,
    fresh_prefill_shape,
    fresh_prefill_usable,
    warm_cudnn_plans,
)

CUDA = torch.cuda.is_available()
HOPPER = CUDA and torch.cuda.get_device_capability() >= (9, 0)


def test_only_one_fresh_long_prompt_takes_the_cudnn_path() -> None:
    n = CUDNN_MIN_TOKENS
    assert fresh_prefill_shape(1, 0, n, n)
    assert fresh_prefill_shape(1, 0, 4 * n, 4 * n)
    assert not fresh_prefill_shape(1, 0, n - 1, n - 1)  # short
    assert fresh_prefill_shape(1, 0, CUDNN_MAX_TOKENS, CUDNN_MAX_TOKENS)
    assert not fresh_prefill_shape(1, 0, CUDNN_MAX_TOKENS + 1, CUDNN_MAX_TOKENS + 1)  # past the warmed plans
    assert not fresh_prefill_shape(1, 0, n, n + 16)  # cached context
    assert not fresh_prefill_shape(2, 0, n, n)  # two sequences
    assert not fresh_prefill_shape(2, 1, n, n)  # a decode row beside it
    q = torch.zeros(n, 4, 64, dtype=torch.bfloat16)
    assert not fresh_prefill_usable(q, 4, torch.bfloat16, 1, 0, n, n)  # not on a GPU
    assert warm_cudnn_plans(4, 4, 64, torch.bfloat16, torch.device("cpu"), 4 * n) == 0


def test_reference_is_causal_and_grouped() -> None:
    """The reference against a per-head loop of SDPA with each KV head repeated for its query heads."""
    gen = torch.Generator().manual_seed(1)
    t, h, hkv, d = 37, 8, 2, 16
    q, k, v = (torch.randn(t, x, d, generator=gen) for x in (h, hkv, hkv))
    got = causal_attention_reference(q, k, v, d ** -0.5)
    for head in range(h):
        kv = head // (h // hkv)
        want = torch.nn.functional.scaled_dot_product_attention(
            q[:, head][None], k[:, kv][None], v[:, kv][None], is_causal=True, scale=d ** -0.5)[0]
        torch.testing.assert_close(got[:, head], want, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not HOPPER, reason="cuDNN fused attention on a Hopper GPU")
@pytest.mark.parametrize("heads,kv_heads", [(32, 8), (16, 16)])
def test_cudnn_matches_reference_and_repeats_its_bits(heads: int, kv_heads: int) -> None:
    gen = torch.Generator().manual_seed(2)
    t, d = 2048 + 17, 128
    q, k, v = (torch.randn(t, x, d, generator=gen).to("cuda", torch.bfloat16)
               for x in (heads, kv_heads, kv_heads))
    out = cudnn_causal_attention(q, k, v, d ** -0.5)
    ref = causal_attention_reference(q, k, v, d ** -0.5)
    assert out.shape == q.shape and out.is_contiguous()
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)
    assert torch.equal(out, cudnn_causal_attention(q, k, v, d ** -0.5))


@pytest.mark.skipif(not HOPPER, reason="cuDNN fused attention on a Hopper GPU")
def test_triton_backend_takes_cudnn_for_a_fresh_long_prompt() -> None:
    """Backend ``forward`` of one fresh 2k-token prompt: with the switch on the output is cuDNN's (equal to
    ``cudnn_causal_attention`` of the rotated q/k), with it off the paged kernel's; both close to each
    other; the cache holds the same K/V either way."""
    from engine.attention.metadata import build_attention_metadata
    from engine.attention.triton_backend import TritonAttentionBackend
    from engine.kv_cache import KVCachePool

    gen = torch.Generator().manual_seed(3)
    t, h, hkv, d, bs = 2048, 32, 8, 128, 16
    pool = KVCachePool(num_layers=1, num_blocks=t // bs + 4, block_size=bs, num_kv_heads=hkv, head_dim=d,
                       dtype=torch.bfloat16, device=torch.device("cuda"))
    meta = build_attention_metadata([list(range(t // bs))], [0], [t], bs, "cuda")
    q, k, v = (torch.randn(t, x, d, generator=gen).to("cuda", torch.bfloat16) for x in (h, hkv, hkv))
    backend = TritonAttentionBackend()
    fused = backend.forward(0, q.clone(), k.clone(), v.clone(), pool, meta, d ** -0.5)
    torch.testing.assert_close(fused, cudnn_causal_attention(q, k, v, d ** -0.5), rtol=0, atol=0)
    backend.cudnn_fresh_prefill = backend.cudnn_paged_prefill = False
    paged = backend.forward(0, q.clone(), k.clone(), v.clone(), pool, meta, d ** -0.5)
    torch.testing.assert_close(fused.float(), paged.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.skipif(not HOPPER, reason="cuDNN fused attention on a Hopper GPU")
def test_plans_are_warmed_per_bucket() -> None:
    """Every 256-token bucket from 1024 up to the budget rounded up: 1300 tokens -> 1024, 1280, 1536."""
    assert warm_cudnn_plans(8, 2, 128, torch.bfloat16, torch.device("cuda"), 1300) == 3
    assert warm_cudnn_plans(8, 2, 128, torch.bfloat16, torch.device("cuda"), 1000) == 0


@pytest.mark.skipif(not HOPPER, reason="cuDNN fused attention on a Hopper GPU")
def test_usable_only_for_a_cache_of_the_model_dtype() -> None:
    """An FP8 KV cache keeps the paged kernel (it attends over the dequantized cache); float32 too."""
    n = CUDNN_MIN_TOKENS
    q = torch.zeros(n, 32, 128, dtype=torch.bfloat16, device="cuda")
    assert fresh_prefill_usable(q, 8, torch.bfloat16, 1, 0, n, n)
    assert not fresh_prefill_usable(q, 8, torch.float8_e4m3fn, 1, 0, n, n)
    assert not fresh_prefill_usable(q.float(), 8, torch.float32, 1, 0, n, n)


def test_packed_buffer_is_checked_before_cudnn_runs() -> None:
    """``packed``: the zero-tailed [T_padded, H + 2 Hkv, D] buffer whose first T rows q, k, v view; other
    tensors are refused by name before any kernel (so this runs on a CPU), and no step is offered one
    where cuDNN does not run (``fresh_prefill_rows``)."""
    t, h, hkv, d = 300, 4, 2, 16
    packed = torch.zeros(512, h + 2 * hkv, d)
    q, k, v = packed[:t, :h], packed[:t, h:h + hkv], packed[:t, h + hkv:]
    with pytest.raises(ValueError, match="packed must be a contiguous"):
        cudnn_causal_attention(q, k, v, 0.25, packed=torch.zeros(300, h + 2 * hkv, d))
    with pytest.raises(ValueError, match="q is not the view"):
        cudnn_causal_attention(q.clone(), k, v, 0.25, packed=packed)
    with pytest.raises(ValueError, match="k is not the view"):
        cudnn_causal_attention(q, k.clone(), v, 0.25, packed=packed)
    with pytest.raises(ValueError, match="q is not the view"):  # the right pointer, other strides
        cudnn_causal_attention(packed.view(-1)[:t * h * d].view(t, h, d), k, v, 0.25, packed=packed)
    with pytest.raises(ValueError, match="v is not the view"):
        cudnn_causal_attention(q, k, packed[:t, h:h + hkv], 0.25, packed=packed)
    n = CUDNN_MIN_TOKENS
    cpu = torch.device("cpu")
    assert fresh_prefill_rows(cpu, torch.bfloat16, 32, 8, 128, torch.bfloat16, 1, 0, n, n) is None


@pytest.mark.skipif(not HOPPER, reason="cuDNN fused attention on a Hopper GPU")
def test_cudnn_over_a_packed_buffer_in_place_equals_the_copying_path() -> None:
    gen = torch.Generator().manual_seed(4)
    t, h, hkv, d = 1500, 32, 8, 128
    rows = fresh_prefill_rows(torch.device("cuda"), torch.bfloat16, h, hkv, d, torch.bfloat16, 1, 0, t, t)
    assert rows == 1536
    packed = torch.zeros(rows, h + 2 * hkv, d, dtype=torch.bfloat16, device="cuda")
    packed[:t] = torch.randn(t, h + 2 * hkv, d, generator=gen).to("cuda", torch.bfloat16)
    q, k, v = packed[:t, :h], packed[:t, h:h + hkv], packed[:t, h + hkv:]
    copied = cudnn_causal_attention(q, k, v, d ** -0.5)
    in_place = cudnn_causal_attention(q, k, v, d ** -0.5, packed=packed)
    assert in_place.is_contiguous() and torch.equal(in_place, copied)


@pytest.mark.skipif(not HOPPER, reason="cuDNN fused attention on a Hopper GPU")
@pytest.mark.parametrize("arch,quantization", [("llama", None), ("qwen2", "fp8")])
def test_engine_prefill_through_the_packed_qkv_buffer_is_bit_identical(arch, quantization, tmp_path,
                                                                      monkeypatch) -> None:
    """A fresh 1300-token prompt through the fused forward in bf16: the QKV projection written into
    cuDNN's buffer gives the logprobs of the projection copied there, bit for bit; bf16 weights
    (``torch.mm`` into the buffer) and FP8 weights with a QKV bias (Qwen2: ``torch._scaled_mm`` into the
    buffer, then the bias added in place)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    from engine.attention.triton_backend import TritonAttentionBackend
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams

    shape = dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=8,
                 num_key_value_heads=2, vocab_size=512, max_position_embeddings=4096, bos_token_id=1,
                 eos_token_id=2, tie_word_embeddings=False)
    cfg = LlamaConfig(head_dim=64, **shape) if arch == "llama" else Qwen2Config(**shape)
    torch.manual_seed(5)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    with torch.no_grad():  # a bias transformers leaves at zero would not show
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
    model.save_pretrained(tmp_path / "m")
    prompt = [int(x) for x in torch.randint(3, 512, (1300,), generator=torch.Generator().manual_seed(6))]
    params = SamplingParams(temperature=0.0, max_tokens=2, logprobs=1)

    def run() -> list:
        llm = LLM(str(tmp_path / "m"), dtype="bfloat16", device="cuda", attention_backend="triton",
                  block_size=16, num_blocks=256, max_num_batched_tokens=2048, enable_prefix_caching=False,
                  quantization=quantization)
        out = llm.generate([prompt], params)
        llm.core.check_no_leaks()
        return out

    rows: list[int | None] = []
    real = TritonAttentionBackend.fresh_qkv_rows
    monkeypatch.setattr(TritonAttentionBackend, "fresh_qkv_rows",
                        lambda self, *a: rows.append(real(self, *a)) or rows[-1])
    in_place = run()
    assert 1536 in rows  # the prompt's step took the buffer
    monkeypatch.setattr(TritonAttentionBackend, "fresh_qkv_rows", lambda self, *a: None)
    copied = run()
    assert in_place[0].token_ids == copied[0].token_ids
    assert in_place[0].logprobs == copied[0].logprobs
