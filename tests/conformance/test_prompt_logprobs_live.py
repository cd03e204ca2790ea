"""Prompt logprobs against the live system: completions ``echo`` with ``logprobs`` (the prompt's tokens
first, the first one null, ``text_offset`` pointing into the echoed text), ``max_tokens: 0`` with echo
(the prompt alone), and vLLM's ``prompt_logprobs``; disaggregated and colocated give identical answers
(``quad``: both gateways, streamed and not). A request asking for them takes nothing from the prefix
cache. Each test ends with a KV leak check on both gateways."""

from __future__ import annotations

from typing import Any

import pytest

from pdserve.live_system import MODEL, SystemPair
from tests.conformance.conftest import Quad
from tests.conformance.helpers import client, leak_check

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
PROMPT = "The capital of France is"
# long enough to fill whole KV blocks, so a repeat finds it in the prefix cache
LONG = "Paris is the capital and largest city of France. It lies on the Seine, in the north of the country."


def _prompt_len(hf: Any, text: str) -> int:
    return len(hf(text)["input_ids"])


def test_echo_with_logprobs_leads_with_the_prompt(live: SystemPair, quad: Quad, hf_tokenizer: Any) -> None:
    out = quad("completions", prompt=PROMPT, max_tokens=3, temperature=0, echo=True, logprobs=2)
    plain = quad("completions", prompt=PROMPT, max_tokens=3, temperature=0, logprobs=2)
    n = _prompt_len(hf_tokenizer, PROMPT)
    (c,) = out.choices
    assert c.text == PROMPT + plain.choices[0].text and out.usage == plain.usage == (n, 3, n + 3)
    assert len(c.logprobs) == n + 3
    # the output's entries are those of the same request without echo, up to float rounding (the LM head
    # then runs over more rows)
    for got, want in zip(c.logprobs[n:], plain.choices[0].logprobs, strict=True):
        assert got[0] == want[0] and got[2] is not None and want[2] is not None
        assert abs((got[1] or 0.0) - (want[1] or 0.0)) < 1e-4
        assert [t for t, _ in got[2]] == [t for t, _ in want[2]]
    assert c.logprobs[0][1:] == (None, None)  # the first prompt token has no prefix
    assert "".join(e[0] for e in c.logprobs[:n]) == PROMPT
    for token, logprob, tops in c.logprobs[1:n]:
        # the 2 best, then the prompt token itself when it is not among them (OpenAI's logprobs + 1)
        assert logprob is not None and logprob <= 0 and tops is not None and (token, logprob) in tops
        assert len(tops) == 2 + (token not in {t for t, _ in tops[:2]})
        assert tops[0][1] >= tops[1][1]
        if token not in {t for t, _ in tops[:2]}:
            assert logprob <= tops[1][1]
    # the last prompt token's logprob is what the model gives it as the output after the same prefix
    ids = hf_tokenizer(PROMPT)["input_ids"]
    nxt = quad("completions", prompt=ids[:-1], max_tokens=1, temperature=0, logprobs=5)
    last, (_, _, after) = c.logprobs[n - 1], nxt.choices[0].logprobs[0]
    assert last[1] is not None and after is not None
    same = [v for t, v in after if t == last[0]]
    if same:
        assert abs(same[0] - last[1]) < 1e-3, (last, after)
    else:
        assert last[1] < min(v for _, v in after), (last, after)  # not among the best 5
    whole = client(live.disagg_url, live.api_key).completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, echo=True, logprobs=1)
    lp = whole.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.text_offset is not None
    for token, offset in zip(lp.tokens, lp.text_offset, strict=True):
        assert whole.choices[0].text[offset:offset + len(token)] == token
    leak_check(live)


def test_max_tokens_zero_with_echo_returns_the_prompt_alone(live: SystemPair, quad: Quad,
                                                            hf_tokenizer: Any) -> None:
    n = _prompt_len(hf_tokenizer, PROMPT)
    out = quad("completions", prompt=PROMPT, max_tokens=0, echo=True, logprobs=0)
    (c,) = out.choices
    assert c.text == PROMPT and c.finish_reason == "length" and out.usage == (n, 0, n)
    assert len(c.logprobs) == n and all(tops == ((t, v),) for t, v, tops in c.logprobs[1:])
    bare = quad("completions", prompt=PROMPT, max_tokens=0, echo=True)
    assert bare.texts() == [PROMPT] and bare.choices[0].logprobs == [] and bare.usage == (n, 0, n)
    leak_check(live)


def test_vllm_prompt_logprobs_equal_on_both_paths(live: SystemPair, quad: Quad) -> None:
    echoed = quad("completions", prompt=PROMPT, max_tokens=1, temperature=0, echo=True, logprobs=3)
    answers = []
    for url, _ in live.pairs():
        r = client(url, live.api_key).completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0, extra_body={"prompt_logprobs": 3})
        answers.append(r.model_dump()["choices"][0]["prompt_logprobs"])
    assert answers[0] == answers[1]
    shaped = answers[0]
    entries = echoed.choices[0].logprobs
    assert shaped[0] is None and len(shaped) == len(entries) - 1  # the prompt's tokens, not the output's
    for entry, (token, logprob, tops) in zip(shaped[1:], entries[1:-1], strict=True):
        own = entry[next(iter(entry))]  # the prompt token comes first
        assert own["decoded_token"] == token and own["logprob"] == logprob and own["rank"] >= 1
        assert tops is not None and len(entry) == (3 if own["rank"] <= 3 else 4) == len(tops)
        ranked = sorted((v for v in entry.values() if v["rank"] <= 3), key=lambda v: v["rank"])
        assert [(v["decoded_token"], v["logprob"]) for v in ranked] == list(tops[:3])
    leak_check(live)


def test_prompt_logprobs_skip_the_prefix_cache(live: SystemPair) -> None:
    for url, _ in live.pairs():
        c = client(url, live.api_key)
        c.completions.create(model=MODEL, prompt=LONG, max_tokens=1)
        warm = c.completions.create(model=MODEL, prompt=LONG, max_tokens=1)
        details = warm.usage.prompt_tokens_details if warm.usage else None
        assert details is not None and (details.cached_tokens or 0) > 0, "control: the prompt is cached"
        asked = c.completions.create(model=MODEL, prompt=LONG, max_tokens=1, echo=True, logprobs=0)
        details = asked.usage.prompt_tokens_details if asked.usage else None
        assert details is not None and details.cached_tokens == 0
        lp = asked.choices[0].logprobs
        assert lp is not None and lp.token_logprobs is not None
        assert lp.token_logprobs[0] is None and all(v is not None for v in lp.token_logprobs[1:])
    leak_check(live)


def test_vllm_prompt_logprobs_on_chat_are_the_rendered_prompts(live: SystemPair, hf_tokenizer: Any) -> None:
    """vLLM's ``prompt_logprobs`` on chat: the response's ``prompt_logprobs`` (vLLM places them there, not
    per choice) are those of the chat-rendered prompt, the same as completions gives for that prompt's
    token ids, on both paths; ``n: 2`` shares them."""
    messages = [{"role": "user", "content": "Name a color."}]
    rendered = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = list(hf_tokenizer(rendered, add_special_tokens=False)["input_ids"])
    for url, _ in live.pairs():
        c = client(url, live.api_key)
        chat = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=1, temperature=0, n=2,
                                         extra_body={"prompt_logprobs": 2}).model_dump()
        comp = c.completions.create(model=MODEL, prompt=ids, max_tokens=1, temperature=0,
                                    extra_body={"prompt_logprobs": 2}).model_dump()
        shaped = chat["prompt_logprobs"]
        assert all("prompt_logprobs" not in ch for ch in chat["choices"])
        assert shaped is not None and len(shaped) == len(ids) and shaped[0] is None
        assert shaped == comp["choices"][0]["prompt_logprobs"]
        for token, entry in zip(ids[1:], shaped[1:], strict=True):
            assert next(iter(entry)) == str(token) and 2 <= len(entry) <= 3
        plain = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=1).model_dump()
        assert plain.get("prompt_logprobs") is None
    leak_check(live)
