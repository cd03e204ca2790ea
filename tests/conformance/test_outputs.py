"""Response contents against the live system: exact usage (prompt tokens = the model's own tokenizer's
count of the templated prompt; completion tokens = the generated tokens, one logprob entry each),
``max_tokens`` / ``max_completion_tokens``, ``ignore_eos``, logprobs with top-N, ``echo``,
``stream_options.include_usage``, and the four prompt forms of completions. Every request runs four ways
(disaggregated/colocated × streamed/not, exactly equal: the ``quad`` fixture); each test ends with a KV
leak check on both gateways."""

from __future__ import annotations

from typing import Any

import pytest

from pdserve.live_system import SystemPair
from tests.conformance.conftest import Quad
from tests.conformance.helpers import ENDPOINTS, MESSAGES, Endpoint, LogprobEntry, call, client, leak_check

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
PROMPT = "The capital of France is"
EOS_TEXT = "<|im_end|>"


def prompt_of(endpoint: Endpoint, text: str = PROMPT) -> dict[str, Any]:
    return {"messages": MESSAGES} if endpoint == "chat" else {"prompt": text}


def lp(endpoint: Endpoint, top: int) -> dict[str, Any]:
    return {"logprobs": True, "top_logprobs": top} if endpoint == "chat" else {"logprobs": top}


def n_prompt_tokens(hf: Any, endpoint: Endpoint, text: str = PROMPT) -> int:
    """Prompt tokens as transformers counts them (chat: the rendered template, no special tokens added)."""
    if endpoint == "chat":
        rendered = hf.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
        return len(hf(rendered, add_special_tokens=False)["input_ids"])
    return len(hf(text)["input_ids"])


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_usage_exact_at_length(live: SystemPair, quad: Quad, hf_tokenizer: Any, endpoint: Endpoint) -> None:
    out = quad(endpoint, **prompt_of(endpoint), max_tokens=6, temperature=0, extra_body={"ignore_eos": True},
               **lp(endpoint, 1))
    n = n_prompt_tokens(hf_tokenizer, endpoint)
    assert out.usage == (n, 6, n + 6)
    (c,) = out.choices
    assert c.finish_reason == "length" and len(c.logprobs) == 6
    assert "".join(e[0] for e in c.logprobs) == c.text
    leak_check(live)


def test_eos_counted_ignore_eos_and_max_completion_tokens(live: SystemPair, quad: Quad, hf_tokenizer: Any
                                                          ) -> None:
    plain = quad("chat", max_tokens=14, temperature=0, logprobs=True, top_logprobs=0)
    (c,) = plain.choices
    n = n_prompt_tokens(hf_tokenizer, "chat")
    assert c.finish_reason == "stop" and c.logprobs[-1][0] == EOS_TEXT, "control: greedy must end at eos"
    assert plain.usage == (n, len(c.logprobs), n + len(c.logprobs)) and len(c.logprobs) < 14
    assert "".join(e[0] for e in c.logprobs[:-1]) == c.text
    forced = quad("chat", max_tokens=14, temperature=0, extra_body={"ignore_eos": True})
    assert forced.usage == (n, 14, n + 14) and forced.choices[0].finish_reason == "length"
    assert forced.choices[0].text.startswith(c.text)
    # max_completion_tokens cuts at 3 tokens, well before the eos above (with max_tokens: the same value)
    assert len(c.logprobs) > 3, "control: the greedy answer must run past 3 tokens"
    out = quad("chat", max_tokens=3, max_completion_tokens=3, temperature=0, logprobs=True, top_logprobs=0)
    assert out.usage is not None and out.usage[1] == 3 and out.choices[0].finish_reason == "length"
    assert out.choices[0].logprobs == c.logprobs[:3]
    # the eos as the max_tokens-th token is still a stop: the worker checks eos before the length
    at_eos = quad("chat", max_tokens=len(c.logprobs), temperature=0)
    assert at_eos.choices[0].finish_reason == "stop" and at_eos.usage == plain.usage
    assert at_eos.choices[0].text == c.text
    leak_check(live)


def _check_top(entries: list[LogprobEntry], top: int, greedy: bool, endpoint: Endpoint) -> None:
    """Chat: the ``top`` best alternatives. Completions (OpenAI's legacy API): those, and the sampled
    token itself when it is not among them (up to ``top`` + 1 entries)."""
    assert entries
    for token, logprob, tops in entries:
        if endpoint == "completions":
            assert (token, logprob) in tops, (token, tops)
            extra = tops[top:]
            assert len(tops) == top + (token not in dict(tops[:top])) and extra in ((), ((token, logprob),))
            tops = tops[:top]
        assert len(tops) == top, (token, tops)
        assert [v for _, v in tops] == sorted((v for _, v in tops), reverse=True)
        assert all(v <= 0 for _, v in tops) and logprob <= 0
        if greedy:
            assert tops[0] == (token, logprob)
        found = [v for t, v in tops if t == token]
        if found:  # the sampled token's logprob equals its own entry among the top-N
            assert found[0] == logprob, (token, logprob, tops)


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_logprobs_top_n(live: SystemPair, quad: Quad, endpoint: Endpoint) -> None:
    greedy = quad(endpoint, **prompt_of(endpoint), max_tokens=5, temperature=0, **lp(endpoint, 3))
    _check_top(greedy.choices[0].logprobs, 3, greedy=True, endpoint=endpoint)
    sampled = quad(endpoint, **prompt_of(endpoint), max_tokens=5, temperature=1.0, seed=5, **lp(endpoint, 4))
    _check_top(sampled.choices[0].logprobs, 4, greedy=False, endpoint=endpoint)
    bare = quad(endpoint, **prompt_of(endpoint), max_tokens=5, temperature=0, **lp(endpoint, 0))
    pairs = [(t, v) for t, v, _ in greedy.choices[0].logprobs]
    assert [(t, v) for t, v, _ in bare.choices[0].logprobs] == pairs
    # no alternatives: chat lists none, completions the sampled token alone
    assert all(tops == (() if endpoint == "chat" else ((t, v),)) for t, v, tops in bare.choices[0].logprobs)
    off = quad(endpoint, **prompt_of(endpoint), max_tokens=5, temperature=0)
    assert off.choices[0].logprobs == [] and off.texts() == greedy.texts()
    leak_check(live)


def test_echo_prepends_prompt(live: SystemPair, quad: Quad) -> None:
    plain = quad("completions", prompt=PROMPT, max_tokens=5, temperature=0)
    echoed = quad("completions", prompt=PROMPT, max_tokens=5, temperature=0, echo=True)
    assert echoed.texts() == [PROMPT + plain.choices[0].text] and echoed.usage == plain.usage
    leak_check(live)


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_include_usage_only_when_asked(live: SystemPair, endpoint: Endpoint) -> None:
    for url, _ in live.pairs():
        c = client(url, live.api_key)
        kw = {**prompt_of(endpoint), "max_tokens": 3, "temperature": 0}
        whole = call(c, endpoint, False, **kw)
        silent = call(c, endpoint, True, stream_options={"include_usage": False}, **kw)
        asked = call(c, endpoint, True, stream_options={"include_usage": True}, **kw)
        assert silent.usage is None and asked.usage == whole.usage and whole.usage is not None
        assert silent.texts() == asked.texts() == whole.texts()
    leak_check(live)


def test_prompt_forms(live: SystemPair, quad: Quad, hf_tokenizer: Any) -> None:
    texts = [PROMPT, "Once upon a time"]
    ids = [hf_tokenizer(t)["input_ids"] for t in texts]
    singles = [quad("completions", prompt=t, max_tokens=4, temperature=0) for t in texts]
    assert quad("completions", prompt=ids[0], max_tokens=4, temperature=0) == singles[0]
    batch = quad("completions", prompt=texts, max_tokens=4, temperature=0)
    assert [c.index for c in batch.choices] == [0, 1]
    assert batch.texts() == [s.choices[0].text for s in singles]
    usages = [s.usage for s in singles]
    assert batch.usage == tuple(sum(u[k] for u in usages if u is not None) for k in range(3))
    assert batch.usage is not None and batch.usage[0] == len(ids[0]) + len(ids[1])
    assert quad("completions", prompt=ids, max_tokens=4, temperature=0) == batch
    leak_check(live)
