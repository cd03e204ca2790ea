"""The OpenAI surface beyond sampling, against the live system: ``logit_bias`` on both paths (the
prefill worker samples the first token, the decode worker the rest: a bias must reach both), the
prefix-cache hits in ``usage.prompt_tokens_details.cached_tokens``, and the model card, ``/tokenize``
and ``/detokenize`` against the model's own Hugging Face tokenizer. Every test ends with a KV leak
check on both gateways."""

from __future__ import annotations

import uuid
from typing import Any

import httpx
import pytest

from pdserve.live_system import MODEL, SystemPair
from tests.conformance.conftest import Quad
from tests.conformance.helpers import ENDPOINTS, MESSAGES, Endpoint, client, leak_check

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
PROMPT = {"chat": {"messages": [{"role": "user", "content": "Tell me a story."}]},
          "completions": {"prompt": "Once upon a time"}}


def _token(hf: Any, text: str) -> int:
    (token_id,) = hf(text, add_special_tokens=False)["input_ids"]
    return int(token_id)


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_logit_bias_forces_and_bans_tokens(live: SystemPair, quad: Quad, hf_tokenizer: Any,
                                           endpoint: Endpoint) -> None:
    forced = _token(hf_tokenizer, " zebra")
    for sampling in ({"temperature": 0}, {"temperature": 1.0, "seed": 3}):
        out = quad(endpoint, **PROMPT[endpoint], max_tokens=4, logit_bias={str(forced): 100}, **sampling)
        assert out.texts() == [" zebra" * 4], sampling  # first token (prefill) and the rest (decode)
    lp: dict[str, Any] = {"logprobs": True, "top_logprobs": 0} if endpoint == "chat" else {"logprobs": 0}
    greedy = quad(endpoint, **PROMPT[endpoint], max_tokens=3, temperature=0, **lp)
    first = greedy.choices[0].logprobs[0][0]
    ids = [i for i in range(len(hf_tokenizer)) if hf_tokenizer.decode([i]) == first]
    banned = quad(endpoint, **PROMPT[endpoint], max_tokens=3, temperature=0, logit_bias=dict.fromkeys(
        map(str, ids), -100), **lp)
    assert banned.choices[0].logprobs[0][0] != first, (first, banned.texts())
    leak_check(live)


def test_cached_prompt_tokens_in_usage(live: SystemPair) -> None:
    """A repeated prompt of several KV blocks is served from the prefix cache the second time."""
    # 4 blocks of 16 tokens and more, under the live gateways' --max-prompt-tokens 100
    prompt = f"{uuid.uuid4().hex} " + "The quick brown fox jumps over the lazy dog. " * 6
    for url, _ in live.pairs():
        c = client(url, live.api_key)
        first, again = (c.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0)
                        for _ in range(2))
        assert first.usage is not None and again.usage is not None
        assert first.usage.prompt_tokens_details is not None and again.usage.prompt_tokens_details is not None
        assert first.usage.prompt_tokens_details.cached_tokens == 0, url
        cached = again.usage.prompt_tokens_details.cached_tokens
        assert 16 <= cached < again.usage.prompt_tokens and cached % 16 == 0, (url, cached)
    leak_check(live)


def test_model_card_tokenize_detokenize(live: SystemPair, hf_tokenizer: Any) -> None:
    auth = {"Authorization": f"Bearer {live.api_key}"}
    text = "The capital of France is"
    rendered = hf_tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    chat_ids = hf_tokenizer(rendered, add_special_tokens=False)["input_ids"]
    for url, _ in live.pairs():
        card = client(url, live.api_key).models.retrieve(MODEL)
        assert card.id == MODEL and card.model_extra is not None
        limit = card.model_extra["max_model_len"]  # the workers' context length in tokens
        assert isinstance(limit, int) and limit >= 2048
        assert httpx.get(f"{url}/v1/models/other", headers=auth, timeout=10).status_code == 404
        r = httpx.post(f"{url}/tokenize", json={"model": MODEL, "prompt": text}, headers=auth, timeout=10)
        ids = hf_tokenizer(text)["input_ids"]
        assert r.json() == {"count": len(ids), "max_model_len": limit, "tokens": ids}
        r = httpx.post(f"{url}/tokenize", json={"messages": MESSAGES}, headers=auth, timeout=10)
        assert r.json()["tokens"] == chat_ids
        usage = client(url, live.api_key).chat.completions.create(model=MODEL, messages=MESSAGES,  # type: ignore[arg-type]
                                                                    max_tokens=1).usage
        assert usage is not None and usage.prompt_tokens == len(chat_ids)
        r = httpx.post(f"{url}/detokenize", json={"tokens": chat_ids}, headers=auth, timeout=10)
        assert r.json() == {"prompt": hf_tokenizer.decode(chat_ids)}
        assert httpx.post(f"{url}/tokenize", json={"prompt": text}, timeout=10).status_code == 401
    leak_check(live)
