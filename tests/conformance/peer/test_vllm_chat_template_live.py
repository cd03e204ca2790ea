"""vLLM's chat-template cases (``tests/entrypoints/openai/test_chat_template.py``), the client-side part,
ported to both live gateways serving the embedded SmolLM2. The peer renders its own ChatML template file
through its internal renderer; here the served model's own template (also ChatML) renders the peer's
three messages through ``/tokenize`` (``messages``, ``add_generation_prompt``), read back through
``/detokenize``, and is compared with the model's Hugging Face tokenizer. vLLM's
``continue_final_message`` and per-request ``chat_template`` are not pdserve fields: a chat completion
carrying either is a 400 naming it. The peer's three ``load_chat_template`` cases test vLLM's
``--chat-template`` file/literal loader, which pdserve does not have (see README.md). Each case names its
peer test."""

from __future__ import annotations

from functools import partial
from typing import Any

import httpx
import pytest

from pdserve.live_system import MODEL, SystemPair
from tests.conformance.peer.common import colo, disagg, refused, together

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
TEST_MESSAGES: Any = [{"role": "user", "content": "Hello"},
                      {"role": "assistant", "content": "Hi there!"},
                      {"role": "user", "content": "What is the capital of"}]


def _post(live: SystemPair, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """``body`` to ``path`` on each gateway at once; asserts each answers 200; returns the answers."""
    auth = {"Authorization": f"Bearer {live.api_key}"}
    urls = [url for url, _ in live.pairs()]
    replies = together(*(partial(httpx.post, f"{url}{path}", json=body, headers=auth, timeout=30)
                         for url in urls))
    for url, r in zip(urls, replies, strict=True):
        assert r.status_code == 200, (url, r.text)
    return [r.json() for r in replies]


# from vllm test_chat_template.py::test_get_gen_prompt (the add_generation_prompt true / false cases)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_get_gen_prompt(live: SystemPair, hf_tokenizer: Any, add_generation_prompt: bool) -> None:
    expected = hf_tokenizer.apply_chat_template(TEST_MESSAGES, add_generation_prompt=add_generation_prompt,
                                                tokenize=False)
    tokenized = _post(live, "/tokenize", {"model": MODEL, "messages": TEST_MESSAGES,
                                          "add_generation_prompt": add_generation_prompt})
    assert all(t["tokens"] == tokenized[0]["tokens"] for t in tokenized)
    [text, _] = [d["prompt"] for d in _post(live, "/detokenize", {"model": MODEL,
                                                                 "tokens": tokenized[0]["tokens"]})]
    assert text == expected
    # the peer's ChatML structure: each turn in <|im_start|>role ... <|im_end|>, then the assistant's
    # opening only when a generation prompt is asked for
    turns = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in TEST_MESSAGES)
    assert text.endswith(turns + ("<|im_start|>assistant\n" if add_generation_prompt else ""))


# from vllm test_chat_template.py::test_get_gen_prompt (the continue_final_message case)
def test_continue_final_message_is_refused(live: SystemPair) -> None:
    messages = [*TEST_MESSAGES, {"role": "assistant", "content": "The capital of"}]
    for client in (disagg(live), colo(live)):
        refused(partial(client.chat.completions.create, model=MODEL, messages=messages, max_tokens=2,
                        extra_body={"continue_final_message": True}),
                "continue_final_message")


# from vllm test_chat_template.py::test_get_gen_prompt (its chat_template taken from the request)
def test_request_chat_template_is_refused(live: SystemPair) -> None:
    refused(partial(disagg(live).chat.completions.create, model=MODEL, messages=TEST_MESSAGES, max_tokens=2,
                    extra_body={"chat_template": "{{ messages }}"}), "chat_template")
