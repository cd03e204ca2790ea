"""vLLM's request-validation cases, ported to the live disaggregated gateway serving the embedded
SmolLM2: ``logit_bias`` and ``stop_token_ids`` against the vocabulary
(``chat_completion/test_chat_logit_bias_validation.py``, ``test_chat_stop_token_ids_validation.py``),
prompts (``completion/test_prompt_validation.py``, ``test_empty_prompt_list.py``), the chat echo
extensions (``chat_completion/test_chat_echo.py``) and an explicit ``tool_choice: null``
(``chat_completion/test_tool_choice_null.py``: unit tests of vLLM's request model there, requests over
HTTP here), all under vLLM's ``tests/entrypoints/openai/``. A
request that is wrong, or asks for a vLLM extension pdserve does not implement, must be a 400 naming
the field. Each case names its peer test."""

from __future__ import annotations

from functools import partial
from typing import Any

import pytest

from pdserve.live_system import MODEL, SystemPair
from tests.conformance.helpers import leak_check
from tests.conformance.peer.common import disagg, refused, together

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
ASK: Any = [{"role": "user", "content": "Testing validation"}]


def _chat(live: SystemPair, **kw: Any) -> Any:
    kw.setdefault("messages", ASK)
    kw.setdefault("max_tokens", 3)
    return disagg(live).chat.completions.create(model=MODEL, **kw)


# from vllm chat_completion/test_chat_logit_bias_validation.py::test_chat_logit_bias_valid
def test_chat_logit_bias_valid(live: SystemPair, hf_tokenizer: Any) -> None:
    r = _chat(live, logit_bias={str(len(hf_tokenizer) - 1): 1.0})
    assert r.choices[0].message.content is not None


# from vllm chat_completion/test_chat_logit_bias_validation.py::test_chat_logit_bias_invalid
def test_chat_logit_bias_invalid(live: SystemPair, hf_tokenizer: Any) -> None:
    vocab = len(hf_tokenizer)
    err = refused(lambda: _chat(live, logit_bias={str(vocab + 1): 1.0}), "logit_bias")
    assert str(vocab + 1) in err.message and str(vocab) in err.message, err.message


# from vllm chat_completion/test_chat_logit_bias_validation.py::test_chat_logit_bias_non_integer_key
def test_chat_logit_bias_non_integer_key(live: SystemPair) -> None:
    err = refused(lambda: _chat(live, logit_bias={"not_a_token_id": 50}), "logit_bias")
    assert "not_a_token_id" in str(err), err.message


# from vllm chat_completion/test_chat_logit_bias_validation.py::test_chat_logit_bias_non_numeric_value
def test_chat_logit_bias_non_numeric_value(live: SystemPair) -> None:
    refused(lambda: _chat(live, logit_bias={"1": "not_a_number"}), "logit_bias")


# from vllm chat_completion/test_chat_logit_bias_validation.py::test_chat_logit_bias_multiple_non_integer_keys
def test_chat_logit_bias_multiple_non_integer_keys(live: SystemPair) -> None:
    err = refused(lambda: _chat(live, logit_bias={"bad1": 50.0, "bad2": 20.0}), "logit_bias")
    assert "bad1" in str(err) and "bad2" in str(err), err.message


# from vllm chat_completion/test_chat_stop_token_ids_validation.py::test_chat_stop_token_ids_valid
def test_chat_stop_token_ids_valid(live: SystemPair, hf_tokenizer: Any) -> None:
    r = _chat(live, extra_body={"stop_token_ids": [len(hf_tokenizer) - 1]})
    assert r.choices[0].message.content is not None


# from vllm chat_completion/test_chat_stop_token_ids_validation.py::test_chat_stop_token_ids_out_of_vocab
def test_chat_stop_token_ids_out_of_vocab(live: SystemPair, hf_tokenizer: Any) -> None:
    vocab = len(hf_tokenizer)
    err = refused(lambda: _chat(live, extra_body={"stop_token_ids": [vocab + 1]}), "stop_token_ids")
    assert str(vocab + 1) in err.message and str(vocab) in err.message, err.message


# from vllm chat_completion/test_chat_stop_token_ids_validation.py::test_chat_stop_token_ids_negative
def test_chat_stop_token_ids_negative(live: SystemPair) -> None:
    refused(lambda: _chat(live, extra_body={"stop_token_ids": [-1]}), "stop_token_ids")


# from vllm completion/test_prompt_validation.py::test_empty_prompt
def test_empty_prompt(live: SystemPair) -> None:
    """No prompt and vLLM's ``prompt_embeds`` (not pdserve's): a 400 naming the unknown field."""
    c = disagg(live)
    refused(lambda: c.completions.create(model=MODEL, prompt="", max_tokens=5,
                                         extra_body={"prompt_embeds": []}), "prompt_embeds")


# from vllm completion/test_prompt_validation.py::test_out_of_vocab_token_ids
def test_out_of_vocab_token_ids(live: SystemPair) -> None:
    c = disagg(live)
    err = refused(lambda: c.completions.create(model=MODEL, prompt=[999999], max_tokens=5, temperature=0),
                  "prompt")
    # the peer matches vLLM's wording ("out of vocabulary"); pdserve's names the id and the valid range
    assert "999999" in err.message and "[0, 49152)" in err.message, err.message


# from vllm completion/test_empty_prompt_list.py::test_empty_prompt_list_rejected
def test_empty_prompt_list_rejected(live: SystemPair) -> None:
    c = disagg(live)
    refused(lambda: c.completions.create(model=MODEL, prompt=[], max_tokens=2), "prompt")


# from vllm completion/test_empty_prompt_list.py::test_nonempty_prompt_list_ok
def test_nonempty_prompt_list_ok(live: SystemPair) -> None:
    r = disagg(live).completions.create(model=MODEL, prompt=["hello"], max_tokens=2, temperature=0)
    assert len(r.choices) == 1 and r.choices[0].index == 0


# from vllm chat_completion/test_chat_echo.py::test_chat_session_with_echo_and_continue_final_message
@pytest.mark.parametrize("echo", [True, False])
def test_chat_echo_and_continue_final_message_are_refused(live: SystemPair, echo: bool) -> None:
    """vLLM's chat ``echo`` / ``continue_final_message`` / ``add_generation_prompt`` request fields are not
    pdserve's: a 400 naming the first, not an answer that ignores them."""
    messages: Any = [{"role": "user", "content": "tell me a saying"},
                     {"role": "assistant", "content": "An apple a day"}]
    refused(lambda: _chat(live, messages=messages, extra_body={"echo": echo, "continue_final_message": True,
                                                               "add_generation_prompt": False}), "echo")


# from vllm chat_completion/test_chat_echo.py::test_top_logprobs
def test_top_logprobs_whole_vocabulary_is_refused(live: SystemPair) -> None:
    """vLLM's ``top_logprobs: -1`` (the whole vocabulary) is outside OpenAI's 0..20: a 400 naming it."""
    refused(lambda: _chat(live, logprobs=True, top_logprobs=-1), "top_logprobs")
    leak_check(live)


TOOLS: Any = [{"type": "function", "function": {"name": "get_weather",
                                                "parameters": {"type": "object", "properties": {}}}}]
WEATHER_ASK: Any = [{"role": "user", "content": "Weather in Paris?"}]


# from vllm chat_completion/test_tool_choice_null.py::
#   test_null_tool_choice_defaults_to_auto_like_an_absent_one
def test_null_tool_choice_defaults_to_auto_like_an_absent_one(live: SystemPair) -> None:
    kw: dict[str, Any] = {"messages": WEATHER_ASK, "tools": TOOLS, "temperature": 0, "max_tokens": 8}
    omitted, null, auto = together(partial(_chat, live, **kw),
                                   partial(_chat, live, extra_body={"tool_choice": None}, **kw),
                                   partial(_chat, live, tool_choice="auto", **kw))
    answers = [(r.choices[0].message.content, r.choices[0].finish_reason,
                [(t.function.name, t.function.arguments) for t in r.choices[0].message.tool_calls or []])
               for r in (omitted, null, auto)]
    assert answers[0] == answers[1] == answers[2], answers


# from vllm chat_completion/test_tool_choice_null.py::
#   test_null_tool_choice_without_tools_matches_an_absent_one
def test_null_tool_choice_without_tools_matches_an_absent_one(live: SystemPair) -> None:
    omitted, null = together(partial(_chat, live, temperature=0),
                             partial(_chat, live, temperature=0, extra_body={"tool_choice": None}))
    assert null.choices[0].message.content == omitted.choices[0].message.content


# from vllm chat_completion/test_tool_choice_null.py::
#   test_null_tool_choice_does_not_conflict_with_structured_outputs
def test_null_tool_choice_does_not_conflict_with_structured_outputs(live: SystemPair) -> None:
    extra = {"tool_choice": None, "structured_outputs": {"json": {"type": "object"}}}
    r = _chat(live, max_tokens=8, extra_body=extra)
    assert r.choices[0].message.content.startswith("{")


# from vllm chat_completion/test_tool_choice_null.py::test_invalid_tool_choice_is_still_rejected
@pytest.mark.parametrize("tool_choice,tools", [("bogus", TOOLS), ("auto", None)],
                         ids=["bogus", "auto-no-tools"])
def test_invalid_tool_choice_is_still_rejected(live: SystemPair, tool_choice: str, tools: Any) -> None:
    extra: dict[str, Any] = {"tool_choice": tool_choice} | ({"tools": tools} if tools else {})
    refused(partial(_chat, live, extra_body=extra), "tool_choice")


# from vllm chat_completion/test_tool_choice_null.py::test_explicit_none_tool_choice_is_untouched
def test_explicit_none_tool_choice_is_untouched(live: SystemPair) -> None:
    r = _chat(live, messages=WEATHER_ASK, tools=TOOLS, tool_choice="none", temperature=0, max_tokens=8)
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason in ("stop", "length")
    leak_check(live)
