"""Sampling parameters against the live system, on chat and completions, each request run four ways
(disaggregated/colocated × streamed/not, all exactly equal — see the ``quad`` fixture).

Each parameter is shown to take effect: filters that must reduce sampling to greedy (``top_k=1``, a tiny
``top_p``, ``top_p`` 0, ``min_p=1``) do, while plain seeded sampling of the same request does not; seeds
reproduce and differ from each other; ``n`` seeded choices reproduce (not compared with single requests of
seed ``seed + i``: batched bf16 logits differ from a lone sequence's, which can flip a sampled tail token —
seen at token 5 of 6 at temperature 1.5); penalties change the greedy output of a repetitive prompt; stop
strings cut the greedy text before their first occurrence; ``user`` is accepted and changes nothing, as do
nulls for optional fields (their defaults). Tests share requests where one serves several checks (the greedy
story is the filters' target and ``user``'s baseline). Every test ends with a KV leak check on both
gateways.
"""

from __future__ import annotations

from typing import Any

import pytest

from pdserve.live_system import SystemPair
from tests.conformance.conftest import Quad
from tests.conformance.helpers import ENDPOINTS, Endpoint, Outcome, leak_check

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
STORY: dict[str, dict[str, Any]] = {
    "chat": {"messages": [{"role": "user", "content": "Tell me a story."}]},
    "completions": {"prompt": "Once upon a time"}}
REPEAT: dict[str, dict[str, Any]] = {  # prompts whose greedy output repeats itself
    "chat": {"messages": [{"role": "user", "content": "Write the word 'cat' ten times."}]},
    "completions": {"prompt": "List of colors: red, red, red,"}}
# bf16 logits (the embedded model's dtype) move by one ulp — 0.0625 at |logit| in [8, 16), 0.125 up to
# 32 — when the batch around a sequence changes; n > 1 choices decode batched and their KV lands at
# timing-dependent steps, so their logprobs are compared within two ulps (tokens and text stay exact).
BATCHED_LOGPROB_TOL = 0.25


def story(quad: Quad, endpoint: Endpoint, **kw: Any) -> Outcome:
    return quad(endpoint, **STORY[endpoint], max_tokens=5, **kw)


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_filters_seeds_and_user(live: SystemPair, quad: Quad, endpoint: Endpoint) -> None:
    """Filters that must reduce sampling to greedy do; seeds reproduce (each request runs four ways) and
    differ from each other; moderate filters with a seed produce text; ``user`` and nulls (defaults) change
    nothing."""
    greedy = story(quad, endpoint, temperature=0)
    sampled = story(quad, endpoint, temperature=1.5, seed=7).texts()
    assert sampled != greedy.texts(), "control: plain seeded sampling must differ from greedy here"
    for name, extra in (("top_k", {"extra_body": {"top_k": 1}}), ("top_p", {"top_p": 1e-6}),
                        ("top_p 0", {"top_p": 0}), ("min_p", {"extra_body": {"min_p": 1.0}})):
        assert story(quad, endpoint, temperature=1.5, seed=7, **extra).texts() == greedy.texts(), name
    assert story(quad, endpoint, temperature=1.5, seed=1).texts() != sampled, (
        "different seeds must give different samples")
    combined = story(quad, endpoint, temperature=0.9, top_p=0.9, seed=3,
                     extra_body={"top_k": 20, "min_p": 0.05})
    assert combined.choices[0].text and combined.usage is not None and combined.usage[1] >= 1
    # null (the client sends None as null) for an optional field is its default
    tagged = story(quad, endpoint, temperature=0, user="conformance-user", top_p=None, presence_penalty=None)
    assert tagged.texts() == greedy.texts() and tagged.usage == greedy.usage
    leak_check(live)


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_n_with_seed(live: SystemPair, quad: Quad, endpoint: Endpoint) -> None:
    many = story(quad, endpoint, temperature=1.5, seed=11, n=3, tol=BATCHED_LOGPROB_TOL,  # reproducible
                 **_lp(endpoint))
    assert [c.index for c in many.choices] == [0, 1, 2]
    assert len(set(many.texts())) > 1, "n samples must not all be the same"
    assert many.usage is not None and many.usage[1] == sum(len(c.logprobs) for c in many.choices)
    leak_check(live)


def _lp(endpoint: Endpoint) -> dict[str, Any]:
    return {"logprobs": True, "top_logprobs": 0} if endpoint == "chat" else {"logprobs": 0}


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_penalties_change_greedy_output(live: SystemPair, quad: Quad, endpoint: Endpoint) -> None:
    """Each penalty changes the greedy output of a repetitive prompt; on completions presence and
    frequency part too (presence penalises a repeated token once, frequency once per occurrence)."""
    kw: dict[str, Any] = {**REPEAT[endpoint], "max_tokens": 8, "temperature": 0}
    plain = quad(endpoint, **kw).texts()
    penalized = {name: quad(endpoint, **kw, **penalty).texts() for name, penalty in (
        ("presence", {"presence_penalty": 2.0}), ("frequency", {"frequency_penalty": 2.0}),
        ("repetition", {"extra_body": {"repetition_penalty": 1.8}}))}
    for name, texts in penalized.items():
        assert texts != plain, f"{name} penalty left the greedy output unchanged"
    if endpoint == "completions":
        assert penalized["frequency"] != penalized["presence"]
    leak_check(live)


def _words(text: str) -> list[str]:
    return [w for w in text.split() if len(w) >= 2]


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_stop_string_and_list(live: SystemPair, quad: Quad, endpoint: Endpoint) -> None:
    prompt = STORY[endpoint]
    ref = quad(endpoint, **prompt, max_tokens=10, temperature=0,
               extra_body={"ignore_eos": True}).choices[0].text
    words = _words(ref)
    assert len(words) >= 3, ref
    one = quad(endpoint, **prompt, max_tokens=10, temperature=0, stop=words[2],
               extra_body={"ignore_eos": True})
    assert (one.choices[0].text, one.choices[0].finish_reason) == (ref[: ref.index(words[2])], "stop")
    first = min(words[1:3], key=ref.index)
    both = quad(endpoint, **prompt, max_tokens=10, temperature=0, stop=[words[2], words[1]],
                extra_body={"ignore_eos": True})
    assert (both.choices[0].text, both.choices[0].finish_reason) == (ref[: ref.index(first)], "stop")
    leak_check(live)
