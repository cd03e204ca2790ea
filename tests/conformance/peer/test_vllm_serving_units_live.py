"""vLLM unit tests of its serving classes whose concern a client can see, ported as HTTP requests to the
live disaggregated gateway serving the embedded SmolLM2 (vLLM builds its request and response objects
directly; here the same property is asserted on what the server answers):

- ``chat_completion/test_non_object_body_validation.py``: a JSON body that is not an object (a string,
  a list, a number, null, or not JSON) is a 4xx, never a 500; ``cache_salt`` (a vLLM field pdserve does
  not have) is a 400 naming it.
- ``chat_completion/test_system_fingerprint_none.py``: with no fingerprint, ``system_fingerprint`` is
  absent from the body (not serialized as null), on chat and completions.
- ``completion/test_completion_text_offset.py``: with a stop string holding text back, the streamed
  ``text_offset`` values equal the non-streamed ones.
- ``completion/test_completion_logprobs.py``: a sampled token that is not among the step's top
  alternatives still gets its own logprob (vLLM once answered null or raised).
- ``completion/test_token_in_token_out.py`` (a server with ``--skip-tokenizer-init``): an echoed
  token-id prompt decodes to its text; ``return_token_ids`` is a 400 naming it.

Each case names its peer test."""

from __future__ import annotations

from functools import partial
from typing import Any

import httpx
import pytest

from pdserve.live_system import MODEL, SystemPair
from tests.conformance.helpers import leak_check
from tests.conformance.peer.common import disagg, refused, together

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
ASK: Any = [{"role": "user", "content": "hello"}]


def _post(live: SystemPair, path: str, content: bytes) -> httpx.Response:
    return httpx.post(f"{live.disagg_url}{path}", content=content, timeout=30,
                      headers={"Authorization": f"Bearer {live.api_key}", "Content-Type": "application/json"})


# from vllm chat_completion/test_non_object_body_validation.py::
#   test_chat_completion_request_rejects_non_object_body
@pytest.mark.parametrize("payload", [b"this is not valid json{{{", b'["not", "an", "object"]', b"42", b"null",
                                     b'"a string"'], ids=["not-json", "list", "number", "null", "string"])
def test_chat_completion_request_rejects_non_object_body(live: SystemPair, payload: bytes) -> None:
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/tokenize"):
        resp = _post(live, path, payload)
        assert 400 <= resp.status_code < 500, (path, resp.status_code, resp.text)
        assert resp.json()["error"]["type"] == "invalid_request_error", (path, resp.text)


# from vllm chat_completion/test_non_object_body_validation.py::
#   test_chat_completion_request_cache_salt_still_validated_on_dict
def test_chat_completion_request_cache_salt_still_validated_on_dict(live: SystemPair) -> None:
    """vLLM refuses an empty ``cache_salt``; pdserve has no ``cache_salt`` at all, so any value is the
    400 naming it (README.md, "Request fields")."""
    refused(lambda: disagg(live).chat.completions.create(model=MODEL, messages=ASK, max_tokens=2,
                                                         extra_body={"cache_salt": ""}), "cache_salt")


# from vllm chat_completion/test_system_fingerprint_none.py::TestChatCompletionFingerprintNone and
#   TestCompletionFingerprintNone (test_key_absent_when_fingerprint_is_none,
#   test_other_fields_unaffected_when_fingerprint_excluded)
def test_system_fingerprint_is_absent(live: SystemPair) -> None:
    auth = {"Authorization": f"Bearer {live.api_key}"}
    chat, comp = together(
        partial(httpx.post, f"{live.disagg_url}/v1/chat/completions", headers=auth, timeout=60,
                json={"model": MODEL, "messages": ASK, "max_tokens": 2}),
        partial(httpx.post, f"{live.disagg_url}/v1/completions", headers=auth, timeout=60,
                json={"model": MODEL, "prompt": "Hi", "max_tokens": 2}))
    for resp in (chat, comp):
        body = resp.json()
        assert resp.status_code == 200, body
        assert "system_fingerprint" not in body
        assert body["model"] == MODEL and len(body["choices"]) == 1
        assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + 2
    leak_check(live)


# from vllm completion/test_completion_text_offset.py::
#   test_stream_text_offset_matches_non_stream_with_stop_holdback
def test_stream_text_offset_matches_non_stream_with_stop_holdback(live: SystemPair) -> None:
    """A stop string that never matches makes the detokenizer hold back text that may begin it, so the
    streamed text lags the tokens; the offsets must still be those of the whole answer."""
    c: Any = disagg(live)
    kw: Any = {"model": MODEL, "prompt": "Hi", "max_tokens": 8, "temperature": 0, "logprobs": 0,
               "stop": ["\n\n\n\n"]}
    whole, chunks = together(partial(c.completions.create, **kw),
                             lambda: list(c.completions.create(stream=True, **kw)))
    lp = whole.choices[0].logprobs
    assert lp is not None and lp.text_offset is not None and lp.tokens is not None
    streamed = [o for ch in chunks for choice in ch.choices if choice.logprobs
                for o in choice.logprobs.text_offset or []]
    assert streamed == lp.text_offset and len(streamed) == 8
    text = whole.choices[0].text
    for token, offset in zip(lp.tokens, lp.text_offset, strict=True):
        assert text[offset:offset + len(token)] == token
    leak_check(live)


# from vllm completion/test_completion_logprobs.py::
#   test_completion_logprobs_handles_sampled_token_absent_from_step
def test_completion_logprobs_handles_sampled_token_absent_from_step(live: SystemPair) -> None:
    """At a high temperature the sampled token is often not the best one; with ``logprobs: 1`` its
    entry still has its own logprob (a float, at most the best alternative's), and ``top_logprobs``
    lists it beside the best one (OpenAI's up to ``logprobs`` + 1 entries)."""
    r = disagg(live).completions.create(model=MODEL, prompt="The weather", max_tokens=8, temperature=2.0,
                                        seed=7, logprobs=1)
    lp = r.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
    assert lp.top_logprobs is not None and len(lp.tokens) == 8
    not_best = 0
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert isinstance(logprob, float) and logprob <= 0 and 1 <= len(top) <= 2
        assert top[token] == logprob and logprob <= max(top.values()) + 1e-5
        not_best += len(top) == 2
    assert not_best > 0, "seed 7 at temperature 2 samples a token that is not the best one"
    leak_check(live)


# from vllm completion/test_token_in_token_out.py::test_token_in_token_out_and_logprobs
def test_token_in_token_out_and_logprobs(live: SystemPair, hf_tokenizer: Any) -> None:
    """The peer's server runs with ``--skip-tokenizer-init`` and answers ``return_token_ids``; pdserve has
    neither (its 400 names the field). What carries over: a token-id prompt echoed decodes back to the
    text it was encoded from."""
    text = "Hello, world! How are you today?"
    ids = list(hf_tokenizer(text)["input_ids"])
    c: Any = disagg(live)
    r = c.completions.create(model=MODEL, prompt=ids, max_tokens=3, temperature=0, echo=True)
    assert r.choices[0].text.startswith(text) and r.choices[0].finish_reason in ("stop", "length")
    refused(lambda: c.completions.create(model=MODEL, prompt=ids, max_tokens=3, echo=True,
                                         extra_body={"return_token_ids": True}), "return_token_ids")
    leak_check(live)
