"""SGLang's OpenAI-server cases (``test/srt/openai_server/basic/test_openai_server.py``), ported to the
live disaggregated gateway serving the embedded SmolLM2 (with 3 tokens where the peer asks 32). The
peer's completion grid (echo × logprobs × list input × n × token-id input) and chat grid (logprobs × n)
are kept, streamed and not; the answers about France are asserted as structure. SGLang's own request
fields (``regex``, ``continue_final_message``) get pdserve's documented 400 naming them; the
``/v1/responses`` cases wait for that endpoint. SGLang's rerank and embedding classes have no pdserve
counterpart (a generation server). Each case names its peer test."""

from __future__ import annotations

import json
import re
from functools import partial
from typing import Any

import httpx
import openai
import pytest

from pdserve.live_system import MODEL, SystemPair
from tests.conformance.helpers import leak_check
from tests.conformance.peer.common import disagg, refused, together

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
PROMPT = "The capital of France is"
ASK: Any = [{"role": "system", "content": "You are a helpful AI assistant"},
            {"role": "user", "content": "What is the capital of France? Answer in a few words."}]
# (list input, n, token-id input): a pairwise cover of the peer's 2 × 2 × 2 grid (every pair of values
# of every two factors occurs), each with both echo values and both logprobs values
GRID = [(True, 1, False), (True, 2, True), (False, 1, True), (False, 2, False)]


def _prompt(hf: Any, list_input: bool, token_input: bool) -> tuple[Any, int, int]:
    """(prompt argument, prompt tokens in all, prompts) for one grid point."""
    one: Any = hf.encode(PROMPT) if token_input else PROMPT
    tokens = len(hf.encode(PROMPT))
    return ([one, one], 2 * tokens, 2) if list_input else (one, tokens, 1)


# from sglang basic/test_openai_server.py::TestOpenAIServer.test_completion
@pytest.mark.parametrize("echo,logprobs", [(False, None), (False, 5), (True, None), (True, 5)])
def test_completion(live: SystemPair, hf_tokenizer: Any, echo: bool, logprobs: int | None) -> None:
    c = disagg(live)
    points = [(where, *_prompt(hf_tokenizer, where[0], where[2])) for where in GRID]
    answers = together(*(partial(c.completions.create, model=MODEL, prompt=prompt, temperature=0,
                                 max_tokens=2, echo=echo, logprobs=logprobs, n=where[1])
                         for where, prompt, _, _ in points))
    for (where, _, n_prompt, prompts), r in zip(points, answers, strict=True):
        assert len(r.choices) == prompts * where[1], where
        if echo:
            assert r.choices[0].text.startswith(PROMPT), (where, r.choices[0].text)
        if logprobs:
            lp = r.choices[0].logprobs
            assert lp is not None and lp.tokens and lp.top_logprobs and lp.token_logprobs, where
            assert isinstance(lp.tokens[0], str) and isinstance(lp.top_logprobs[1], dict)
            assert len(lp.top_logprobs[1]) > 0
            if not echo:
                assert lp.token_logprobs[0] is not None
        assert r.id and r.created and r.usage is not None
        assert r.usage.prompt_tokens == n_prompt, (where, r.usage)
        assert r.usage.completion_tokens > 0 and r.usage.total_tokens > 0
    leak_check(live)


def _stream_completion(c: Any, prompt: Any, n: int, echo: bool, logprobs: int | None) -> tuple[set[int], Any]:
    """Consume one streamed completion, checking each chunk as the peer does; returns (choice indexes
    seen, the usage chunk's usage)."""
    seen: set[int] = set()
    usage = None
    for chunk in c.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=2, echo=echo,
                                      logprobs=logprobs, n=n, stream=True,
                                      stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
            continue
        ch = chunk.choices[0]
        first = ch.index not in seen
        if logprobs and (ch.text or not ch.finish_reason):
            assert ch.logprobs is not None and ch.logprobs.tokens
            assert isinstance(ch.logprobs.tokens[0], str)
            if not (first and echo):
                assert ch.logprobs.top_logprobs and isinstance(ch.logprobs.top_logprobs[0], dict)
                assert len(ch.logprobs.top_logprobs[0]) > 0
        if first and echo:
            assert ch.text.startswith(PROMPT), ch.text
        seen.add(ch.index)
        assert chunk.id and chunk.created
    return seen, usage


# from sglang basic/test_openai_server.py::TestOpenAIServer.test_completion_stream
@pytest.mark.parametrize("echo,logprobs", [(False, None), (False, 5), (True, None), (True, 5)])
def test_completion_stream(live: SystemPair, hf_tokenizer: Any, echo: bool, logprobs: int | None) -> None:
    c = disagg(live)
    points = [(where, *_prompt(hf_tokenizer, where[0], where[2])) for where in GRID]
    answers = together(*(partial(_stream_completion, c, prompt, where[1], echo, logprobs)
                         for where, prompt, _, _ in points))
    for (where, _, _, prompts), (seen, usage) in zip(points, answers, strict=True):
        assert seen == set(range(prompts * where[1])), (where, seen)
        assert usage is not None and usage.prompt_tokens > 0 and usage.completion_tokens > 0
    leak_check(live)


# from sglang basic/test_openai_server.py::TestOpenAIServer.test_chat_completion
@pytest.mark.parametrize("logprobs", [None, 5])
@pytest.mark.parametrize("n", [1, 2])
def test_chat_completion(live: SystemPair, logprobs: int | None, n: int) -> None:
    r = disagg(live).chat.completions.create(model=MODEL, messages=ASK, temperature=0, max_tokens=3, n=n,
                                             logprobs=bool(logprobs), top_logprobs=logprobs)
    if logprobs:
        lp = r.choices[0].logprobs
        assert lp is not None and lp.content
        assert isinstance(lp.content[0].top_logprobs[0].token, str)
        assert len(lp.content[0].top_logprobs) == logprobs
    assert len(r.choices) == n
    assert r.choices[0].message.role == "assistant" and isinstance(r.choices[0].message.content, str)
    assert r.id and r.created and r.usage is not None
    assert r.usage.prompt_tokens > 0 and r.usage.completion_tokens > 0 and r.usage.total_tokens > 0


# from sglang basic/test_openai_server.py::TestOpenAIServer.test_chat_completion_stream
@pytest.mark.parametrize("logprobs", [None, 5])
@pytest.mark.parametrize("n", [1, 2])
def test_chat_completion_stream(live: SystemPair, logprobs: int | None, n: int) -> None:
    seen: set[int] = set()
    finishes: dict[int, int] = {}
    usage = None
    for chunk in disagg(live).chat.completions.create(model=MODEL, messages=ASK, temperature=0, max_tokens=3,
                                                      n=n, logprobs=bool(logprobs), top_logprobs=logprobs,
                                                      stream=True, stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
            continue
        ch = chunk.choices[0]
        if ch.finish_reason is not None:
            finishes[ch.index] = finishes.get(ch.index, 0) + 1
        if ch.index not in seen:
            assert ch.delta.role == "assistant", "the first chunk of a choice carries the role"
            seen.add(ch.index)
            continue
        if logprobs and ch.delta.content:
            assert ch.logprobs is not None and ch.logprobs.content
            assert isinstance(ch.logprobs.content[0].top_logprobs[0].token, str)
            assert len(ch.logprobs.content[0].top_logprobs) == logprobs
        assert isinstance(ch.delta.content, str) or ch.delta.tool_calls or ch.finish_reason
        assert chunk.id and chunk.created
    assert seen == set(range(n))
    assert finishes == dict.fromkeys(range(n), 1), "exactly one finish_reason per choice"
    assert usage is not None and usage.prompt_tokens > 0 and usage.completion_tokens > 0


# from sglang basic/test_openai_server.py::TestOpenAIServer.test_regex
def test_regex(live: SystemPair) -> None:
    """SGLang's top-level ``regex`` is a 400 naming it; the same regex through vLLM's
    ``structured_outputs`` (the field pdserve implements) gives the JSON the peer parses."""
    pattern = r"""\{\n   "name": "[\w]{1,12}",\n   "population": [\d]{1,9}\n\}"""
    c = disagg(live)
    _, r = together(partial(refused, partial(c.chat.completions.create, model=MODEL, messages=ASK,
                                             temperature=0, max_tokens=40, extra_body={"regex": pattern}),
                            "regex"),
                    partial(c.chat.completions.create, model=MODEL, messages=ASK, temperature=0,
                            max_tokens=40, extra_body={"structured_outputs": {"regex": pattern}}))
    text = r.choices[0].message.content
    assert text is not None and re.fullmatch(pattern, text), text
    obj = json.loads(text)
    assert isinstance(obj["name"], str) and isinstance(obj["population"], int)
    leak_check(live)


# from sglang basic/test_openai_server.py::TestOpenAIServer.test_penalty
def test_penalty(live: SystemPair) -> None:
    r = disagg(live).chat.completions.create(model=MODEL, messages=ASK, temperature=0, max_tokens=8,
                                             frequency_penalty=1.0)
    assert isinstance(r.choices[0].message.content, str)


# from sglang basic/test_openai_server.py::TestOpenAIServer.test_response_prefill
def test_response_prefill_is_refused(live: SystemPair) -> None:
    """``continue_final_message`` (continue the last assistant message) is not pdserve's: a 400 naming it,
    not an answer that silently starts a new message."""
    c = disagg(live)
    messages: Any = [{"role": "user", "content": "Describe a lamp as JSON."},
                     {"role": "assistant", "content": "{\n"}]
    refused(lambda: c.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=4,
                                              extra_body={"continue_final_message": True}),
            "continue_final_message")


# from sglang basic/test_openai_server.py::TestOpenAIServer.test_model_list
def test_model_list(live: SystemPair) -> None:
    models = list(disagg(live).models.list())
    assert len(models) == 1 and models[0].id == MODEL
    assert isinstance((models[0].model_extra or {}).get("max_model_len"), int)


# from sglang basic/test_openai_server.py::TestOpenAIServer.test_retrieve_model
def test_retrieve_model(live: SystemPair) -> None:
    c = disagg(live)
    card = c.models.retrieve(MODEL)
    assert card.id == MODEL and (card.model_extra or {}).get("root") == MODEL
    with pytest.raises(openai.NotFoundError):
        c.models.retrieve("non-existent-model")


def _responses(live: SystemPair, **kw: Any) -> Any:
    return disagg(live).responses.create(model=MODEL, input=PROMPT, temperature=0, top_p=1.0, **kw)


# from sglang basic/test_openai_server.py::TestOpenAIServerv1Responses.test_response
def test_response(live: SystemPair) -> None:
    r = _responses(live, max_output_tokens=4)
    assert r.id and r.object == "response" and r.created_at and r.model == MODEL
    assert isinstance(r.output, list) and r.status in ("completed", "incomplete")
    assert r.usage is not None and r.usage.input_tokens > 0 and r.usage.output_tokens > 0
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.error is None and isinstance(r.output_text, str)


# from sglang basic/test_openai_server.py::TestOpenAIServerv1Responses.test_response_stream
def test_response_stream(live: SystemPair) -> None:
    """The peer's model ends within its budget and the stream ends with ``response.completed``; SmolLM2
    cut at ``max_output_tokens`` ends, as OpenAI does, with ``response.incomplete`` (README.md,
    ``POST /v1/responses``), which the SDK's ``responses.stream`` helper does not accept as an end: the
    events are read from ``responses.create(stream=True)`` and both ends checked."""
    kinds: list[str] = []
    text = ""
    final: Any = None
    for event in disagg(live).responses.create(model=MODEL, input=PROMPT, temperature=0, max_output_tokens=4,
                                               stream=True):
        kinds.append(event.type)
        if event.type == "response.output_text.delta":
            text += event.delta
        if event.type in ("response.completed", "response.incomplete"):
            final = event.response
    assert kinds[0] == "response.created" and "response.in_progress" in kinds
    assert final is not None and kinds[-1] == f"response.{final.status}", kinds
    if final.status == "incomplete":
        assert final.incomplete_details.reason == "max_output_tokens"
    assert text == final.output_text and final.usage is not None and final.usage.output_tokens > 0


# from sglang basic/test_openai_server.py::TestOpenAIServerv1Responses.test_error
def test_responses_error(live: SystemPair) -> None:
    r = httpx.post(f"{live.disagg_url}/v1/responses", headers={"Authorization": f"Bearer {live.api_key}"},
                   json={"model": MODEL, "input": "Hi", "previous_response_id": "bad"}, timeout=30)
    assert r.status_code == 400, r.text
    assert {"message", "type", "code"} <= set(r.json()["error"])


# from sglang basic/test_openai_server.py::TestOpenAIServerv1Responses.test_penalty
def test_responses_penalty(live: SystemPair) -> None:
    """SGLang takes ``frequency_penalty`` on ``/v1/responses``; OpenAI's Responses API has no such field
    and pdserve answers any field outside the documented list with a 400 naming it (README.md,
    ``POST /v1/responses``); the penalty itself is served on chat (``test_penalty``)."""
    r = httpx.post(f"{live.disagg_url}/v1/responses", headers={"Authorization": f"Bearer {live.api_key}"},
                   json={"model": MODEL, "input": "Introduce Paris.", "temperature": 0,
                         "max_output_tokens": 2, "frequency_penalty": 1.0}, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "frequency_penalty" and error["type"] == "invalid_request_error", error
