"""Sampler tests: filters and penalties against transformers' logits processors, seeded sampling
(deterministic, batch-independent, distributed like softmax), raw logprobs, bad input."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from engine.sampler import (
    Sampler,
    SamplingRow,
    apply_filters,
    apply_penalties,
    mix32,
    seeded_uniform,
)
from engine.sampling_params import SamplingParams

V = 64


def _row(params: SamplingParams, seed: int = 0, pos: int = 0, prompt=(1, 2), output=(), eos=()):
    return SamplingRow(params, seed, pos, list(prompt), list(output), tuple(eos))


def _logits(b: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(b, V, generator=torch.Generator().manual_seed(seed)) * 3


def _py_mix32(x: int) -> int:
    x &= 0xFFFFFFFF
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x68E31DA5) & 0xFFFFFFFF
    return x ^ (x >> 16)


def test_mix32_matches_pure_python_reference():
    xs = [0, 1, 2, 12345, 0xFFFFFFFF, 0x80000000, 987654321]
    got = mix32(torch.tensor(xs, dtype=torch.int64)).tolist()
    assert got == [_py_mix32(x) for x in xs]


def test_seeded_uniform_in_open_interval_and_roughly_uniform():
    u = seeded_uniform(torch.arange(64), torch.zeros(64, dtype=torch.int64), 4096)
    assert u.shape == (64, 4096) and u.dtype == torch.float32
    assert float(u.min()) > 0.0 and float(u.max()) < 1.0
    assert abs(float(u.mean()) - 0.5) < 0.01
    assert abs(float(u.var()) - 1 / 12) < 0.003


def test_greedy_is_argmax():
    logits = _logits(5)
    rows = [_row(SamplingParams(temperature=0.0))] * 5
    out = Sampler()(logits, rows)
    assert [r.token_id for r in out] == logits.argmax(-1).tolist()
    assert all(r.logprob is None and r.top_logprobs is None for r in out)


def test_filters_match_transformers_warpers():
    logits = _logits(1, seed=3)
    cases: list[tuple[SamplingParams, list[Any]]] = [
        (SamplingParams(temperature=0.7, top_k=5), [TemperatureLogitsWarper(0.7), TopKLogitsWarper(5)]),
        (SamplingParams(temperature=1.3, top_p=0.6), [TemperatureLogitsWarper(1.3), TopPLogitsWarper(0.6)]),
        (SamplingParams(temperature=1.0, min_p=0.2), [MinPLogitsWarper(0.2)]),
        (
            SamplingParams(top_k=10, top_p=0.8, min_p=0.05),
            [TopKLogitsWarper(10), TopPLogitsWarper(0.8), MinPLogitsWarper(0.05)],
        ),
    ]
    for params, warpers in cases:
        ours = apply_filters(logits, [_row(params)])
        ref = logits.clone()
        for w in warpers:
            ref = w(torch.zeros(1, 1, dtype=torch.long), ref)
        assert torch.equal(torch.isinf(ours), torch.isinf(ref)), params
        kept = ~torch.isinf(ref)
        torch.testing.assert_close(ours[kept], ref[kept])


def test_top_p_zero_keeps_only_the_most_probable_token():
    """``top_p`` 0 (OpenAI's range is [0, 1]): the nucleus shrinks to the most probable token, so every seed
    samples the argmax; a row beside it with another ``top_p`` is filtered as transformers' warper does."""
    logits = _logits(4, seed=5)
    zero = SamplingParams(temperature=1.5, top_p=0.0)
    rows = [_row(zero), _row(SamplingParams(temperature=1.3, top_p=0.6)), _row(zero), _row(zero)]
    ours = apply_filters(logits, rows)
    for i in (0, 2, 3):
        assert torch.isfinite(ours[i]).sum() == 1 and int(ours[i].argmax()) == int(logits[i].argmax())
    ids = torch.zeros(1, 1, dtype=torch.long)
    ref = TopPLogitsWarper(0.6)(ids, TemperatureLogitsWarper(1.3)(ids, logits[1:2].clone()))
    assert torch.equal(torch.isinf(ours[1:2]), torch.isinf(ref))
    for seed in range(8):
        params = SamplingParams(temperature=2.0, top_p=0.0, seed=seed)
        out = Sampler()(logits, [_row(params)] * 4)
        assert [r.token_id for r in out] == logits.argmax(-1).tolist(), seed


def test_repetition_penalty_matches_transformers_over_prompt_and_output():
    logits = _logits(2, seed=4)
    params = SamplingParams(repetition_penalty=1.7)
    rows = [_row(params, prompt=[3, 5, 5], output=[7]), _row(params, prompt=[0], output=[63, 9])]
    ours = apply_penalties(logits, rows)
    proc = RepetitionPenaltyLogitsProcessor(1.7)
    ref0 = proc(torch.tensor([[3, 5, 5, 7]]), logits[:1].clone())
    ref1 = proc(torch.tensor([[0, 63, 9]]), logits[1:].clone())
    torch.testing.assert_close(ours, torch.cat([ref0, ref1]))


def test_presence_and_frequency_penalties_openai_semantics():
    logits = _logits(1, seed=5)
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    ours = apply_penalties(logits, [_row(params, prompt=[1, 1, 2], output=[4, 4, 4, 6])])
    expected = logits.clone()
    expected[0, 4] -= 3 * 0.25 + 0.5
    expected[0, 6] -= 1 * 0.25 + 0.5
    torch.testing.assert_close(ours, expected)  # prompt tokens 1, 2 untouched


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    logits = torch.zeros(2, V)
    logits[:, 7] = 10.0  # eos would win
    logits[:, 9] = 5.0  # stop token id next
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=(9,), max_tokens=5)
    out = Sampler()(logits, [_row(params, output=[1], eos=[7]), _row(params, output=[1, 2], eos=[7])])
    assert out[0].token_id not in (7, 9)
    assert out[1].token_id == 7


def test_min_tokens_masks_every_eos_id_of_a_model_listing_several():
    logits = torch.zeros(2, V)
    logits[:, 7], logits[:, 11], logits[:, 13], logits[:, 20] = 10.0, 9.0, 8.0, 1.0
    params = SamplingParams(temperature=0.0, min_tokens=2, max_tokens=5)
    out = Sampler()(logits, [_row(params, output=[1], eos=[7, 11, 13]),
                             _row(params, output=[1, 2], eos=[7, 11, 13])])
    assert [o.token_id for o in out] == [20, 7]


def test_seeded_sampling_is_deterministic_and_batch_independent():
    logits = _logits(6, seed=6)
    params = [SamplingParams(temperature=1.0, seed=s) for s in range(6)]
    rows = [_row(p, seed=p.seed or 0, pos=3) for p in params]
    batched = [r.token_id for r in Sampler()(logits, rows)]
    alone = [Sampler()(logits[i : i + 1], [rows[i]])[0].token_id for i in range(6)]
    shuffled_idx = [5, 2, 0, 4, 1, 3]
    shuffled = Sampler()(logits[shuffled_idx], [rows[i] for i in shuffled_idx])
    assert batched == alone
    assert [shuffled[shuffled_idx.index(i)].token_id for i in range(6)] == batched
    # mixing greedy rows into the batch changes nothing for the sampled rows
    mixed = Sampler()(torch.cat([logits, logits[:1]]), [*rows, _row(SamplingParams(temperature=0.0))])
    assert [r.token_id for r in mixed[:6]] == batched


def test_seeded_sampling_follows_softmax_distribution():
    probs = torch.tensor([0.5, 0.25, 0.125, 0.125])
    logits = torch.full((1, V), -1e9)
    logits[0, :4] = probs.log()
    n = 4000
    counts = torch.zeros(4)
    sampler = Sampler()
    rows = [_row(SamplingParams(temperature=1.0), seed=11, pos=p) for p in range(n)]
    toks = sampler(logits.expand(n, V), rows)
    for r in toks:
        counts[r.token_id] += 1
    # binomial std of a frequency at n=4000 is <= 0.008; allow 4 sigma
    assert torch.allclose(counts / n, probs, atol=0.032), counts / n


def test_different_seeds_give_different_streams():
    logits = torch.zeros(1, V)
    a = [Sampler()(logits, [_row(SamplingParams(), seed=1, pos=p)])[0].token_id for p in range(20)]
    b = [Sampler()(logits, [_row(SamplingParams(), seed=2, pos=p)])[0].token_id for p in range(20)]
    assert a != b


def test_top_k_one_and_min_p_one_are_greedy():
    logits = _logits(4, seed=8)
    for params in (
        SamplingParams(top_k=1, seed=3),
        SamplingParams(min_p=1.0, seed=3),
        SamplingParams(top_p=1e-6, seed=3),
    ):
        out = Sampler()(logits, [_row(params, seed=3, pos=i) for i in range(4)])
        assert [r.token_id for r in out] == logits.argmax(-1).tolist()


def test_logprobs_are_raw_log_softmax_with_top_n():
    logits = _logits(2, seed=9)
    raw = logits.log_softmax(-1)
    params = [
        SamplingParams(temperature=0.5, logprobs=3, repetition_penalty=2.0, seed=1),
        SamplingParams(temperature=0.0, logprobs=0),
    ]
    out = Sampler()(logits, [_row(params[0], seed=1), _row(params[1])])
    assert out[0].logprob is not None and out[1].logprob is not None
    assert math.isclose(out[0].logprob, float(raw[0, out[0].token_id]), abs_tol=1e-6)
    assert math.isclose(out[1].logprob, float(raw[1].max()), abs_tol=1e-6)
    top = out[0].top_logprobs
    assert top is not None
    vals, ids = raw[0].topk(3)
    assert [t for t, _ in top] == ids.tolist()
    assert all(math.isclose(lp, v, abs_tol=1e-6) for (_, lp), v in zip(top, vals.tolist(), strict=True))
    assert out[1].top_logprobs is None


def test_bad_logits_shape_raises():
    with pytest.raises(ValueError, match="len\\(rows\\)=2"):
        Sampler()(torch.zeros(3, V), [_row(SamplingParams())] * 2)
    with pytest.raises(ValueError, match="must be"):
        Sampler()(torch.zeros(V), [_row(SamplingParams())])


def test_is_plain_greedy_only_without_processing() -> None:
    from engine.sampler import is_plain_greedy

    assert is_plain_greedy(SamplingParams(temperature=0.0), 0)
    assert is_plain_greedy(SamplingParams(temperature=0.0, min_tokens=2, max_tokens=4), 2)
    for params, outputs in [
        (SamplingParams(temperature=0.5), 0),
        (SamplingParams(temperature=0.0, logprobs=0), 0),
        (SamplingParams(temperature=0.0, repetition_penalty=1.1), 0),
        (SamplingParams(temperature=0.0, presence_penalty=0.1), 0),
        (SamplingParams(temperature=0.0, frequency_penalty=0.1), 0),
        (SamplingParams(temperature=0.0, min_tokens=2, max_tokens=4), 1),
    ]:
        assert not is_plain_greedy(params, outputs), params


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_fast_path_equals_full_sampler(dtype) -> None:
    logits = _logits(7, seed=12).to(dtype)
    logits[3, 10] = logits[3, 11] = logits[3].max() + 1  # a tie: both take the first index
    rows = [_row(SamplingParams(temperature=0.0))] * 7
    fast = Sampler.greedy(logits)
    assert fast == [r.token_id for r in Sampler()(logits, rows)]
    assert fast == logits.float().argmax(-1).tolist() and fast[3] == 10
    with pytest.raises(ValueError, match="must be \\[batch, vocab\\]"):
        Sampler.greedy(logits[0])


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_logit_bias_forces_and_bans_tokens_per_row(temperature: float) -> None:
    logits = _logits(3, seed=5)
    forced = int(logits[0].argmin())
    rows = [_row(SamplingParams(temperature=temperature, logit_bias=((forced, 100.0), (10**6, 5.0))), seed=1),
            _row(SamplingParams(temperature=temperature), seed=1),
            _row(SamplingParams(temperature=temperature, logit_bias=((int(logits[2].argmax()), -100.0),)),
                 seed=1)]
    plain = Sampler()(logits, [_row(SamplingParams(temperature=temperature), seed=1)] * 3)
    out = Sampler()(logits, rows)
    assert out[0].token_id == forced  # an id beyond the vocabulary is ignored
    assert out[1].token_id == plain[1].token_id  # a row without bias is untouched by its neighbours'
    assert out[2].token_id != int(logits[2].argmax())
    assert torch.equal(apply_penalties(logits, rows[1:2]), logits)


# seed 0, output position 94: token 29597's hash has its top 24 bits all set, the one cell whose centre
# (2**24 - 0.5) / 2**24 rounds to 1.0 in float32
EDGE_SEED, EDGE_POS, EDGE_TOKEN, EDGE_VOCAB = 0, 94, 29597, 49152


def _edge_hash() -> int:
    """The 32-bit hash ``seeded_uniform`` draws at the edge case (its own formula, in plain Python)."""
    lo, hi = EDGE_SEED & 0xFFFFFFFF, EDGE_SEED >> 32
    row = _py_mix32(_py_mix32(lo ^ _py_mix32(hi + 0x9E3779B9)) ^ EDGE_POS)
    return _py_mix32(row ^ _py_mix32(EDGE_TOKEN + 0x632BE5AB))


def test_seeded_uniform_stays_below_one_at_the_top_hash_cell():
    assert _edge_hash() >> 8 == (1 << 24) - 1  # the case below is the edge
    u = seeded_uniform(torch.tensor([EDGE_SEED]), torch.tensor([EDGE_POS]), EDGE_VOCAB)
    assert float(u.max()) < 1.0 and float(u.min()) > 0.0
    assert float(u[0, EDGE_TOKEN]) == 1.0 - 2.0**-24
    assert torch.isfinite(-torch.log(-torch.log(u))).all()


def test_sampling_at_the_top_hash_cell_keeps_to_the_grammar_mask():
    """Rows: a grammar row at the edge position (only tokens 5 and 9 allowed), a free row at the same
    position, a greedy grammar row. The grammar row must sample an allowed token, never the masked
    token whose noise is the largest."""
    from engine.sampler import GrammarMask

    logits = torch.randn(3, EDGE_VOCAB, generator=torch.Generator().manual_seed(3))
    bitmask = torch.zeros(3, EDGE_VOCAB // 32, dtype=torch.int32)
    for r in (0, 2):
        for t in (5, 9):
            bitmask[r, t // 32] |= 1 << (t % 32)
    mask = GrammarMask(bitmask, [0, 2])
    hot, greedy = SamplingParams(temperature=0.7), SamplingParams(temperature=0.0)
    rows = [_row(hot, EDGE_SEED, EDGE_POS), _row(hot, EDGE_SEED, EDGE_POS), _row(greedy, EDGE_SEED, EDGE_POS)]
    tokens = Sampler.sample_tokens(logits, rows, grammar_mask=mask).tolist()
    assert tokens[0] in (5, 9)
    assert tokens[2] == (5 if logits[2, 5] > logits[2, 9] else 9)
    assert 0 <= tokens[1] < EDGE_VOCAB
