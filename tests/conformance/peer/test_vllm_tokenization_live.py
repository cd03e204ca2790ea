"""vLLM's tokenizer-endpoint cases (``tests/entrypoints/serve/tokenize/test_tokenization.py``), ported
to both live gateways serving the embedded SmolLM2: ``/tokenize`` (text, chat, chat with tools, token
strings) and ``/detokenize`` against the model's own Hugging Face tokenizer. vLLM's ``/tokenizer_info``
(behind its ``--enable-tokenizer-info-endpoint``) has no pdserve counterpart. Each case names its peer
test."""

from __future__ import annotations

from functools import partial
from typing import Any

import httpx
import pytest

from pdserve.live_system import MODEL, SystemPair
from tests.conformance.peer.common import disagg, together

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
CONVERSATION: Any = [{"role": "user", "content": "Hi there!"},
                     {"role": "assistant", "content": "Nice to meet you!"},
                     {"role": "user", "content": "Can I ask a question? vllm1"}]
WEATHER: Any = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                                 "parameters": {"type": "object",
                                                                "properties": {"city": {"type": "string"}}}}}


def _post(live: SystemPair, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """``body`` to ``path`` on each gateway; asserts both answer 200 alike and returns the answer."""
    auth = {"Authorization": f"Bearer {live.api_key}"}
    urls = [url for url, _ in live.pairs()]
    replies = together(*(partial(httpx.post, f"{url}{path}", json=body, headers=auth, timeout=30)
                         for url in urls))
    for url, r in zip(urls, replies, strict=True):
        assert r.status_code == 200, (url, r.text)
    answers = [r.json() for r in replies]
    assert all(a == answers[0] for a in answers), answers
    return answers[0]


def _context(live: SystemPair) -> int:
    limit = (disagg(live).models.retrieve(MODEL).model_extra or {})["max_model_len"]
    assert isinstance(limit, int)
    return limit


# from vllm serve/tokenize/test_tokenization.py::test_tokenize_completions
def test_tokenize_completions(live: SystemPair, hf_tokenizer: Any) -> None:
    prompt = "vllm1 This is a test prompt."
    for special in (False, True):
        ids = hf_tokenizer.encode(prompt, add_special_tokens=special)
        got = _post(live, "/tokenize", {"model": MODEL, "prompt": prompt, "add_special_tokens": special})
        assert got["tokens"] == ids and got["count"] == len(ids)
        assert got["max_model_len"] == _context(live) and got.get("token_strs") is None


# from vllm serve/tokenize/test_tokenization.py::test_tokenize_chat
def test_tokenize_chat(live: SystemPair, hf_tokenizer: Any) -> None:
    for generation in (False, True):
        for special in (False, True):
            rendered = hf_tokenizer.apply_chat_template(CONVERSATION, add_generation_prompt=generation,
                                                        tokenize=False)
            ids = hf_tokenizer.encode(rendered, add_special_tokens=special)
            flags = {"add_generation_prompt": generation, "add_special_tokens": special}
            got = _post(live, "/tokenize", {"model": MODEL, "messages": CONVERSATION, **flags})
            assert got["tokens"] == ids and got["count"] == len(ids), (generation, special)
            assert got["max_model_len"] == _context(live) and got.get("token_strs") is None


# from vllm serve/tokenize/test_tokenization.py::test_tokenize_chat_with_tools
def test_tokenize_chat_with_tools(live: SystemPair, hf_tokenizer: Any) -> None:
    """The tools are rendered as a chat completion renders them (SmolLM2's template has no tools: the
    gateway's fallback prompt), so ``/tokenize`` counts what ``usage.prompt_tokens`` counts."""
    ask: Any = [{"role": "user", "content": "Weather in Paris?"}]
    for generation in (False, True):
        for special in (False, True):
            flags = {"add_generation_prompt": generation, "add_special_tokens": special}
            got = _post(live, "/tokenize", {"model": MODEL, "messages": ask, "tools": [WEATHER], **flags})
            plain = _post(live, "/tokenize", {"model": MODEL, "messages": ask, **flags})
            assert got["count"] == len(got["tokens"]) > plain["count"]
            assert "get_weather" in hf_tokenizer.decode(got["tokens"])
    c = disagg(live)
    usage = c.chat.completions.create(model=MODEL, messages=ask, tools=[WEATHER], max_tokens=1).usage
    assert usage is not None
    got = _post(live, "/tokenize", {"model": MODEL, "messages": ask, "tools": [WEATHER]})
    assert usage.prompt_tokens == got["count"]


# from vllm serve/tokenize/test_tokenization.py::test_tokenize_with_return_token_strs
def test_tokenize_with_return_token_strs(live: SystemPair, hf_tokenizer: Any) -> None:
    prompt = "This is a token_strs test prompt! vllm1"
    got = _post(live, "/tokenize", {"model": MODEL, "prompt": prompt, "return_token_strs": True})
    ids = hf_tokenizer.encode(prompt, add_special_tokens=True)
    assert got["tokens"] == ids and got["count"] == len(ids) and got["max_model_len"] == _context(live)
    assert got["token_strs"] == hf_tokenizer.convert_ids_to_tokens(ids)


# from vllm serve/tokenize/test_tokenization.py::test_detokenize
def test_detokenize(live: SystemPair, hf_tokenizer: Any) -> None:
    prompt = "This is a test prompt. vllm1"
    ids = hf_tokenizer.encode(prompt, add_special_tokens=False)
    assert _post(live, "/detokenize", {"model": MODEL, "tokens": ids}) == {"prompt": prompt}
