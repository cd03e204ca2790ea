"""A request that fails validation gets one 400 naming its first bad field, and its message lists every
error under that field (each bad ``logit_bias`` key), not only the first; other fields' errors stay out
of it."""

from __future__ import annotations

import json
from collections.abc import Mapping

import pydantic
import pytest
from fastapi.exceptions import RequestValidationError
from starlette.requests import Request

from gateway.app import _validation_error
from gateway.errors import APIError
from gateway.openai_requests import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from gateway.responses_api import ReasoningInputItem, ResponsesRequest
from gateway.responses_serving import prepare_response
from gateway.validation_message import MAX_LISTED


def _answer(body: Mapping[str, object], model: type[pydantic.BaseModel] = ChatCompletionRequest) -> \
        dict[str, str]:
    with pytest.raises(pydantic.ValidationError) as info:
        model.model_validate(body)
    errors = [{**e, "loc": ("body", *e["loc"])} for e in info.value.errors()]
    request = Request({"type": "http", "headers": [(b"content-type", b"application/json")]})  # a JSON body
    response = _validation_error(request, RequestValidationError(errors, body=body))
    assert response.status_code == 400
    error: dict[str, str] = json.loads(bytes(response.body))["error"]
    return error


def test_every_bad_key_of_a_field_is_listed() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}],
            "logit_bias": {"bad1": 50.0, "bad2": 20.0}}
    error = _answer(body)
    assert error["param"] == "logit_bias.bad1"
    assert "logit_bias.bad1" in error["message"] and "logit_bias.bad2" in error["message"], error
    error = _answer({**body, "n": 0})  # n comes first: named alone, logit_bias's errors not listed
    assert error["param"] == "n" and "logit_bias" not in error["message"], error


def test_the_list_is_bounded() -> None:
    bias = {f"bad{i}": 1.0 for i in range(3 * MAX_LISTED)}
    error = _answer({"model": "m", "messages": [{"role": "user", "content": "hi"}], "logit_bias": bias})
    assert error["message"].count("logit_bias.bad") == MAX_LISTED


HI = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(("fields", "param"), [
    ({"tool_choice": "sometimes"}, "tool_choice"),  # was tool_choice.literal['none','auto','required']
    ({"tool_choice": {"type": "function"}}, "tool_choice.function"),  # was tool_choice.NamedToolChoice....
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages.0.content.0.type"),  # was messages.0.content.str
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a", "x": 1}]}]},
     "messages.0.content.0.x"),
    ({"messages": [{"role": "user"}]}, "messages.0"),
    ({"stop": 5}, "stop"),
    ({"metadata": {"str": 5}}, "metadata.str"),  # a client's key named like a type stays
    ({"model": None, "messages": None}, "model"),
])
def test_param_is_the_clients_field_path(fields: dict[str, object], param: str) -> None:
    error = _answer({"model": "m", "messages": HI, **fields})
    assert error["param"] == param, error
    assert "literal[" not in error["message"] and "list[" not in error["message"], error


def test_missing_field_is_named() -> None:
    assert _answer({"model": "m"})["param"] == "messages"
    error = _answer({"model": "m", "input": [{"type": "function_call", "call_id": "c"}]}, ResponsesRequest)
    assert error["param"] == "input.0.name" and "input.0.arguments" in error["message"], error


@pytest.mark.parametrize(("item", "param", "code"), [
    ({"role": "assistant", "content": [{"type": "output_text", "text": "a", "bogus": []}]},
     "input.0.content.0.bogus", "unknown_field"),  # was input.str
    ({"type": "nonsense"}, "input.0", None),
    ({"type": "function_call_output", "call_id": "c", "output": 5}, "input.0.output", None),
])
def test_responses_item_errors_name_the_item_field(item: dict[str, object], param: str,
                                                   code: str | None) -> None:
    error = _answer({"model": "m", "input": [item]}, ResponsesRequest)
    assert (error["param"], error["code"]) == (param, code), error
    assert "tagged-union" not in error["message"] and "InputMessage" not in error["message"], error


def test_responses_chat_side_error_names_the_responses_field() -> None:
    """An empty ``input`` fails as the chat request's empty ``messages``: the 400 names ``input``."""
    with pytest.raises(APIError) as info:
        prepare_response(None, ResponsesRequest.model_validate({"model": "m", "input": []}), "r1")  # type: ignore[arg-type]
    assert info.value.param == "input" and info.value.message.startswith("input: "), info.value.message
    assert "messages" not in info.value.message


@pytest.mark.parametrize(("model", "fields", "param", "message"), [
    (ChatCompletionRequest, {"max_tokens": "3"}, "max_tokens", "must be an integer, got a string ('3')"),
    (ChatCompletionRequest, {"n": 2.0}, "n", "must be an integer, got a number (2.0)"),
    (ChatCompletionRequest, {"seed": True}, "seed", "must be an integer, got a boolean (true)"),
    (ChatCompletionRequest, {"stream": "true"}, "stream", "must be a boolean, got a string ('true')"),
    (ChatCompletionRequest, {"logprobs": 1}, "logprobs", "must be a boolean, got an integer (1)"),
    (ChatCompletionRequest, {"temperature": "0.5"}, "temperature", "must be a number, got a string ('0.5')"),
    (ChatCompletionRequest, {"top_p": False}, "top_p", "must be a number, got a boolean (false)"),
    (ChatCompletionRequest, {"stream": True, "stream_options": {"include_usage": "yes"}},
     "stream_options.include_usage", "must be a boolean, got a string ('yes')"),
    (ChatCompletionRequest, {"stop_token_ids": ["2"]}, "stop_token_ids.0",
     "must be an integer, got a string"),
    (ChatCompletionRequest, {"logit_bias": {"17": "1"}}, "logit_bias.17", "must be a number, got a string"),
    (ChatCompletionRequest, {"user": 5}, "user", "must be a string, got an integer (5)"),
    (CompletionRequest, {"logprobs": True}, "logprobs", "must be an integer, got a boolean (true)"),
    (CompletionRequest, {"echo": "false"}, "echo", "must be a boolean, got a string ('false')"),
    (CompletionRequest, {"max_tokens": "16"}, "max_tokens", "must be an integer, got a string ('16')"),
    (ResponsesRequest, {"max_output_tokens": "3"}, "max_output_tokens", "must be an integer, got a string"),
    (ResponsesRequest, {"stream": 1}, "stream", "must be a boolean, got an integer (1)"),
    (TokenizeRequest, {"add_special_tokens": "yes"}, "add_special_tokens", "must be a boolean, got a string"),
    (DetokenizeRequest, {"tokens": [1, "2"]}, "tokens.1", "must be an integer, got a string ('2')"),
])
def test_types_are_strict_and_the_400_says_which_type(model: type[pydantic.BaseModel],
                                                      fields: dict[str, object], param: str,
                                                      message: str) -> None:
    """Nothing is coerced (OpenAI's JSON Schema checks refuse ``"3"`` for an integer too)."""
    base: dict[str, object] = {ChatCompletionRequest: {"model": "m", "messages": HI},
                               CompletionRequest: {"model": "m", "prompt": "x"},
                               ResponsesRequest: {"model": "m", "input": "x"},
                               TokenizeRequest: {"prompt": "x"}, DetokenizeRequest: {}}[model]
    error = _answer({**base, **fields}, model)
    assert error["param"] == param and f"{param}: {message}" in error["message"], error


def test_numbers_take_json_integers_and_logit_bias_keys_are_strings() -> None:
    body = ChatCompletionRequest.model_validate({"model": "m", "messages": HI, "temperature": 1, "top_p": 1,
                                                 "presence_penalty": -1, "logit_bias": {"17": 100}})
    assert (body.temperature, body.top_p, body.presence_penalty) == (1.0, 1.0, -1.0)
    assert body.logit_bias == {17: 100.0}
    resp = ResponsesRequest.model_validate({"model": "m", "input": "x", "temperature": 0})
    assert resp.temperature == 0.0


def test_null_for_an_optional_field_means_its_default() -> None:
    """OpenAI's optional fields are nullable and the ``openai`` client sends ``temperature=None`` as
    ``null``: every field with a default takes it for ``null`` (a new-user trial got a 400 ``must be a
    number, got null`` for ``temperature``, ``n``, ``top_p``, the penalties, ``logprobs`` and ``stream``);
    a required field's ``null`` is still a 400 naming it."""
    nulls = {name: None for name, f in ChatCompletionRequest.model_fields.items()
             if not f.is_required() and f.default is not None}
    nullable = {"temperature", "top_p", "n", "stream", "logprobs", "presence_penalty", "frequency_penalty"}
    assert nullable <= set(nulls)
    body = ChatCompletionRequest.model_validate({"model": "m", "messages": HI, **nulls,
                                                 "stream_options": {"include_usage": None}})
    assert body == ChatCompletionRequest.model_validate({"model": "m", "messages": HI, "stream_options": {}})
    # a field whose type takes None keeps its null: completions max_tokens null is up to the context
    completion = CompletionRequest.model_validate({"model": "m", "prompt": "x", "max_tokens": None,
                                                   "echo": None, "temperature": None})
    assert (completion.max_tokens, completion.echo, completion.temperature) == (None, False, 1.0)
    resp = ResponsesRequest.model_validate({"model": "m", "input": "x", "temperature": None, "top_p": None,
                                            "stream": None})
    assert (resp.temperature, resp.top_p, resp.stream) == (1.0, 1.0, False)
    tokenize = TokenizeRequest.model_validate({"prompt": "x", "return_token_strs": None})
    assert tokenize.return_token_strs is False
    # inside the body's parts too: a tool call's type, a JSON schema, a reasoning item's summary
    history = [*HI, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": None, "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "x"}]
    nested = ChatCompletionRequest.model_validate({"model": "m", "messages": history, "response_format": {
        "type": "json_schema", "json_schema": {"name": "n", "schema": None}}})
    assert nested.messages[1].tool_calls is not None and nested.messages[1].tool_calls[0].type == "function"
    assert nested.response_format is not None and nested.response_format.json_schema is not None
    assert nested.response_format.json_schema.json_schema == {}
    item = ResponsesRequest.model_validate({"model": "m", "input": [{"type": "reasoning", "id": "r",
                                                                    "summary": None}]})
    assert not isinstance(item.input, str) and isinstance(item.input[0], ReasoningInputItem)
    assert item.input[0].summary == []
    error = _answer({"model": None, "messages": HI}, ChatCompletionRequest)
    assert error["param"] == "model", error


CHAT_PART = "messages.0.content.0.type"
# a function call and its output (a Responses input item), whose second output part is the one at fault
CALL = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}
CALL_OUTPUT = {"type": "function_call_output", "call_id": "c1"}
CALL_PART = "input.1.output.1.type"


@pytest.mark.parametrize(("model", "fields", "param", "code", "message"), [
    (ResponsesRequest, {"tools": [{"type": "web_search"}]}, "tools.0.type", "unsupported_parameter",
     "tools.0.type: 'web_search' tools are not supported: pdserve supports only function tools"),
    (ResponsesRequest, {"tools": [{"type": "function", "name": "f"}, {"type": "file_search",
                                                                    "vector_store_ids": ["v"]}]},
     "tools.1.type", "unsupported_parameter",
     "tools.1.type: 'file_search' tools are not supported: pdserve supports only function tools"),
    (ResponsesRequest, {"tool_choice": {"type": "web_search"}}, "tool_choice.type", "unsupported_parameter",
     "tool_choice.type: 'web_search' tool choices are not supported: pdserve supports only function tools"),
    (ChatCompletionRequest, {"tool_choice": {"type": "custom", "custom": {"name": "c"}}}, "tool_choice.type",
     "unsupported_parameter", "tool_choice.type: 'custom' tool choices are not supported: pdserve supports "
                              "only function tools"),
    (ChatCompletionRequest, {"tools": [{"type": "custom", "custom": {"name": "c"}}]}, "tools.0.type",
     "unsupported_parameter", "tools.0.type: 'custom' tools are not supported: pdserve supports only "
                              "function tools"),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "https://x/y.png"}}]}]}, CHAT_PART,
     "unsupported_parameter",
     f"{CHAT_PART}: 'image_url' content parts are not supported: pdserve serves text models (send the "
     "content as text)"),
    (ChatCompletionRequest, {"messages": [{"role": "assistant", "content": [
        {"type": "refusal", "refusal": "no"}]}]}, CHAT_PART, "unsupported_parameter",
     f"{CHAT_PART}: 'refusal' content parts are not supported: send the assistant's text as 'text' parts"),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": [{"type": "foo"}]}]}, CHAT_PART, None,
     f"{CHAT_PART}: type must be 'text', not 'foo'"),
    (ResponsesRequest, {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
     "input.0.content.0.type", "unsupported_parameter",
     "input.0.content.0.type: 'input_image' content parts are not supported: pdserve serves text models "
     "(send the content as text)"),
    (ResponsesRequest, {"input": [{"role": "user", "content": [{"type": "text", "text": "a"}]}]},
     "input.0.content.0.type", None, "input.0.content.0.type: type must be 'input_text' or 'output_text', "
                                    "not 'text'"),
    (ResponsesRequest, {"input": [CALL, {**CALL_OUTPUT, "output": [
        {"type": "input_text", "text": "a"}, {"type": "input_audio", "input_audio": {"data": "AA==",
                                                                                     "format": "wav"}}]}]},
     CALL_PART, "unsupported_parameter",
     f"{CALL_PART}: 'input_audio' content parts are not supported: pdserve serves text models (send the "
     "content as text)"),
    (ResponsesRequest, {"input": [CALL, {**CALL_OUTPUT, "output": [
        {"type": "input_text", "text": "a"}, {"type": "input_image", "image_url": "u", "detail": "auto"}]}]},
     CALL_PART, "unsupported_parameter",
     f"{CALL_PART}: 'input_image' content parts are not supported: pdserve serves text models (send the "
     "content as text)"),
    (ResponsesRequest, {"input": [CALL, {**CALL_OUTPUT, "output": [{"type": "input_text", "text": "a"},
                                                                   {"type": "foo"}]}]},
     CALL_PART, None, f"{CALL_PART}: type must be 'input_text', not 'foo'"),
])
def test_an_item_of_a_type_not_taken_is_one_sentence_naming_its_type(
        model: type[pydantic.BaseModel], fields: dict[str, object], param: str, code: str | None,
        message: str) -> None:
    """Named alone: not beside the errors of the item's other keys (a union dump), which follow from its
    type."""
    base = {"model": "m", "input": "x"} if model is ResponsesRequest else {"model": "m", "messages": HI}
    error = _answer({**base, **fields}, model)
    assert (error["param"], error["code"], error["message"]) == (param, code, message), error


BASES: dict[type[pydantic.BaseModel], dict[str, object]] = {
    ChatCompletionRequest: {"model": "m", "messages": HI}, CompletionRequest: {"model": "m", "prompt": "x"},
    ResponsesRequest: {"model": "m", "input": "x"}}


@pytest.mark.parametrize("model", list(BASES))
@pytest.mark.parametrize(("metadata", "why"), [
    ({str(i): "v" for i in range(17)}, "17 pairs given"),
    ({"k" * 65: "v"}, "key 'kkkkkkkkkkkkkkkkkkkk...' has 65 characters"),
    ({"k": "v" * 513}, "the value of key 'k' has 513 characters"),
])
def test_metadata_is_held_to_openais_limits(model: type[pydantic.BaseModel], metadata: dict[str, str],
                                            why: str) -> None:
    """Accepted and ignored, but only within OpenAI's limits (16 pairs, keys <= 64, values <= 512)."""
    error = _answer({**BASES[model], "metadata": metadata}, model)
    assert error["param"] == "metadata" and error["message"] == (
        "metadata: at most 16 pairs, keys of at most 64 characters and string values of at most 512: "
        f"{why}"), error
    at_limits = {"k" * 64: "v" * 512, **{str(i): "v" for i in range(15)}}
    assert model.model_validate({**BASES[model], "metadata": at_limits}).metadata == at_limits  # type: ignore[attr-defined]
