"""The Responses API pieces without workers: a body's chat request (input items, instructions, tools,
text.format, include logprobs), the field a chat-side 400 names, what ``include`` / ``reasoning`` /
``truncation`` refuse, and the output items and event order a parsed output makes (logprobs placed with
the message text, a reasoning summary)."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pydantic
import pytest

from gateway.errors import APIError
from gateway.openai_requests import ChatCompletionRequest
from gateway.openai_responses import ChatTokenLogprob
from gateway.responses_api import ResponsesRequest, chat_body, check_supported, responses_param
from gateway.responses_output import InputTokensDetails, OutputTokensDetails, ResponseBuilder, ResponseUsage
from gateway.tool_parsers.events import ContentText, ReasoningText, ToolCallArguments, ToolCallStart
from gateway.validation_message import validation_error


def test_chat_body_of_items_instructions_tools_and_format() -> None:
    body = ResponsesRequest.model_validate({
        "model": "m", "instructions": "Be brief.", "max_output_tokens": 9, "tool_choice": {"type": "function",
                                                                                            "name": "f"},
        "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
        "text": {"format": {"type": "json_schema", "name": "p", "schema": {"type": "object"},
                            "strict": True}},
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_text",
                                                                                      "text": "b"}]},
                  {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                  {"type": "function_call", "call_id": "c2", "name": "f", "arguments": "{\"x\": 1}"},
                  {"type": "function_call_output", "call_id": "c1", "output": "one"},
                  {"type": "function_call_output", "call_id": "c2", "output": "two"}]})
    chat = chat_body(body)
    ChatCompletionRequest.model_validate(chat)  # a valid chat request
    assert chat["messages"] == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "ab"},
        {"role": "assistant", "content": None, "tool_calls": [  # parallel calls: one assistant turn
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
            {"id": "c2", "type": "function", "function": {"name": "f", "arguments": "{\"x\": 1}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "one"},
        {"role": "tool", "tool_call_id": "c2", "content": "two"}]
    assert chat["max_completion_tokens"] == 9
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    function = {"name": "f", "parameters": {"type": "object"}}
    assert chat["tools"] == [{"type": "function", "function": function}]
    assert chat["response_format"] == {"type": "json_schema", "json_schema": {
        "name": "p", "schema": {"type": "object"}, "strict": True}}


def test_responses_param_names_the_responses_field() -> None:
    assert responses_param("messages.2.content") == "input"
    assert responses_param("max_tokens") == "max_output_tokens"
    assert responses_param("response_format.json_schema.schema") == "text.format.schema"
    assert responses_param("tool_choice") == "tool_choice" and responses_param(None) is None
    assert responses_param("tools.1.function.strict") == "tools.1.strict"  # Responses tools are flat
    assert responses_param("tools.0.function.parameters") == "tools.0.parameters"


def test_strict_reaches_the_chat_request_as_given() -> None:
    """``strict`` true or false passes to the chat request (the same constraint under ``auto``); absent
    stays absent: not strict, as in chat completions (OpenAI's Responses API would default it to true)."""
    tool: dict[str, object] = {"type": "function", "name": "f", "parameters": {"type": "object"}}
    for strict in (True, False, None):
        given = tool if strict is None else {**tool, "strict": strict}
        chat = chat_body(ResponsesRequest.model_validate({"model": "m", "input": "hi", "tools": [given]}))
        function = chat["tools"][0]["function"]
        assert function.get("strict") == strict and ("strict" in function) == (strict is not None)


def _events(chunks: list[bytes]) -> list[dict[str, object]]:
    out = []
    for chunk in chunks:
        head, data = chunk.decode().strip().split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert head == f"event: {event['type']}"
        out.append(event)
    return out


def test_builder_items_and_event_order() -> None:
    body = ResponsesRequest.model_validate({"model": "m", "input": "hi"})
    b = ResponseBuilder(body, "resp_1", 5)
    chunks = b.start() + b.feed([ReasoningText("hm"), ContentText("He"), ContentText("llo"),
                                 ToolCallStart(0, "call_1", "f"), ToolCallArguments(0, "{\"a\""),
                                 ToolCallArguments(0, ": 1}")])
    usage = ResponseUsage(3, InputTokensDetails(0), 4, OutputTokensDetails(0), 7)
    chunks += b.finish("completed", usage)
    events = _events(chunks)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.reasoning_text.delta", "response.reasoning_text.done",
        "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    whole = msgspec.to_builtins(b.response("completed", usage))
    assert [i["type"] for i in whole["output"]] == ["reasoning", "message", "function_call"]
    assert whole["output"][1]["content"][0]["text"] == "Hello"
    assert whole["output"][2]["arguments"] == "{\"a\": 1}" and whole["output"][2]["call_id"] == "call_1"
    assert all(i["status"] == "completed" for i in whole["output"]) and whole["store"] is False
    assert events[-1]["response"] == whole


def test_incomplete_response_marks_only_the_cut_item_incomplete() -> None:
    body = ResponsesRequest.model_validate({"model": "m", "input": "hi", "max_output_tokens": 3})
    b = ResponseBuilder(body, "resp_2", 5)
    chunks = b.start() + b.feed([ReasoningText("hm"), ContentText("Hel")])
    chunks += b.finish("incomplete", ResponseUsage(3, InputTokensDetails(0), 3, OutputTokensDetails(0), 6))
    events = _events(chunks)
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert [(i["type"], i["status"]) for i in done] == [("reasoning", "completed"), ("message", "incomplete")]
    final = events[-1]
    assert final["type"] == "response.incomplete" and final["response"]["status"] == "incomplete"
    assert final["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert [i["status"] for i in final["response"]["output"]] == ["completed", "incomplete"]


def _lp(token: str) -> ChatTokenLogprob:
    return ChatTokenLogprob(token, -0.5, list(token.encode()), [])


def test_logprobs_go_with_the_message_text_only() -> None:
    """Each token's logprob goes with the message text it made; held text's ride with the text that
    releases it; reasoning, marker and tool-call tokens are not listed. The stream's deltas carry the
    same."""
    body = ResponsesRequest.model_validate({"model": "m", "input": "hi", "include": [
        "message.output_text.logprobs"], "top_logprobs": 2})
    assert chat_body(body)["logprobs"] is True and chat_body(body)["top_logprobs"] == 2
    b = ResponseBuilder(body, "resp_1", 5)
    chunks = b.start()
    chunks += b.feed([ReasoningText("think")], [_lp("think")])
    chunks += b.feed([], [_lp("</")])  # the end of the reasoning block: held, then consumed
    chunks += b.feed([], [_lp("think>")])
    chunks += b.feed([ContentText("He")], [_lp("\n\n"), _lp("He")])  # the blank line is dropped
    chunks += b.feed([], [_lp("l")])  # held (e.g. a possible marker)
    chunks += b.feed([ContentText("llo")], [_lp("lo")])
    chunks += b.feed([ToolCallStart(0, "call_1", "f"), ToolCallArguments(0, "{}")], [_lp("<tool_call>")])
    chunks += b.finish("completed", ResponseUsage(3, InputTokensDetails(0), 5, OutputTokensDetails(0), 8))
    whole = msgspec.to_builtins(b.response("completed", b.usage))
    (message,) = [i for i in whole["output"] if i["type"] == "message"]
    part = message["content"][0]
    assert part["text"] == "Hello" and [e["token"] for e in part["logprobs"]] == ["He", "l", "lo"]
    events = _events(chunks)
    deltas: list[Any] = [e for e in events if e["type"] == "response.output_text.delta"]
    assert [[x["token"] for x in e["logprobs"]] for e in deltas] == [["He"], ["l", "lo"]]
    (done,) = [e for e in events if e["type"] == "response.output_text.done"]
    assert done["logprobs"] == part["logprobs"] and whole["top_logprobs"] == 2


def test_reasoning_summary_is_the_reasoning_text() -> None:
    body = ResponsesRequest.model_validate({"model": "m", "input": "hi", "reasoning": {"summary": "auto"}})
    b = ResponseBuilder(body, "resp_1", 5)
    chunks = b.start() + b.feed([ReasoningText("a"), ReasoningText("b"), ContentText("x")])
    chunks += b.finish("completed", ResponseUsage(3, InputTokensDetails(0), 3, OutputTokensDetails(0), 6))
    types = [e["type"] for e in _events(chunks)]
    assert types[2:10] == [
        "response.output_item.added", "response.reasoning_summary_part.added",
        "response.reasoning_text.delta", "response.reasoning_summary_text.delta",
        "response.reasoning_text.delta", "response.reasoning_summary_text.delta",
        "response.reasoning_text.done", "response.reasoning_summary_text.done"]
    whole = msgspec.to_builtins(b.response("completed", b.usage))
    assert whole["output"][0]["summary"] == [{"type": "summary_text", "text": "ab"}]
    assert whole["output"][0]["content"] == [{"type": "reasoning_text", "text": "ab"}]
    assert whole["reasoning"] == {"effort": None, "summary": "auto"} and whole["truncation"] == "disabled"
    plain = ResponseBuilder(ResponsesRequest.model_validate({"model": "m", "input": "hi"}), "resp_2", 5)
    plain.feed([ReasoningText("a")])
    assert msgspec.to_builtins(plain.response("completed", None))["output"][0]["summary"] == []


@pytest.mark.parametrize(("fields", "param"), [
    ({"include": ["reasoning.encrypted_content"]}, "include.0"),
    ({"include": ["message.output_text.logprobs", "file_search_call.results"]}, "include.1"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"reasoning": {"effort": "low"}}, "reasoning.effort"),
    ({"reasoning": {"summary": "concise"}}, "reasoning.summary"),
    ({"reasoning": {"generate_summary": "concise"}}, "reasoning.generate_summary"),
    ({"truncation": "auto"}, "truncation"),
    ({"background": True}, "background"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"conversation": {"id": "conv_1"}}, "conversation"),
    ({"prompt_cache_key": "k"}, "prompt_cache_key"),
    ({"prompt_cache_retention": "24h"}, "prompt_cache_retention"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"context_management": [{"type": "compaction"}]}, "context_management"),
    ({"service_tier": "flex"}, "service_tier"),
    ({"stream": True, "stream_options": {"include_obfuscation": True}}, "stream_options.include_obfuscation"),
    ({"stream_options": {"include_obfuscation": False}}, "stream_options"),
    ({"text": {"verbosity": "low"}}, "text.verbosity"),  # an OpenAI field: not an unknown one
])
def test_what_cannot_be_honoured_is_refused_by_name(fields: dict[str, object], param: str) -> None:
    body = ResponsesRequest.model_validate({"model": "m", "input": "hi", **fields})
    with pytest.raises(APIError) as err:
        check_supported(body)
    assert err.value.status == 400 and err.value.param == param
    assert err.value.code in ("unsupported_parameter", None) and "neither" not in err.value.message


@pytest.mark.parametrize("fields", [
    {"safety_identifier": "u1", "user": "u2"}, {"service_tier": "auto"}, {"service_tier": "default"},
    {"max_tool_calls": 1}, {"background": False},
    {"stream": True, "stream_options": {"include_obfuscation": False}},
])
def test_openai_fields_with_nothing_to_do_are_accepted(fields: dict[str, object]) -> None:
    body = ResponsesRequest.model_validate({"model": "m", "input": "hi", **fields})
    check_supported(body)
    ChatCompletionRequest.model_validate(chat_body(body))


def test_what_maps_onto_the_engine_is_accepted() -> None:
    accepted: list[dict[str, Any]] = [
        {"include": ["message.output_text.logprobs"], "top_logprobs": 0},
        {"reasoning": {"summary": "detailed", "effort": None}}, {"truncation": "disabled"}, {"include": []}]
    for fields in accepted:
        check_supported(ResponsesRequest.model_validate({"model": "m", "input": "hi", **fields}))


def _previous_output(summary: bool) -> list[Any]:
    """A whole response's ``output`` as the builder returns it: reasoning, a message whose text part
    carries logprobs and annotations, and two function calls."""
    body = ResponsesRequest.model_validate({"model": "m", "input": "hi", "include": [
        "message.output_text.logprobs"], **({"reasoning": {"summary": "auto"}} if summary else {})})
    b = ResponseBuilder(body, "resp_1", 5)
    b.start()
    b.feed([ReasoningText("think")], [_lp("think")])
    b.feed([ContentText("Let me look.")], [_lp("Let me look.")])
    b.feed([ToolCallStart(0, "call_1", "f"), ToolCallArguments(0, "{}"), ToolCallStart(1, "call_2", "f"),
            ToolCallArguments(1, "{\"x\": 1}")])
    b.finish("completed", ResponseUsage(3, InputTokensDetails(0), 5, OutputTokensDetails(0), 8))
    output: list[Any] = json.loads(msgspec.json.encode(b.response("completed", b.usage)))["output"]
    return output


@pytest.mark.parametrize("summary", [False, True])
def test_a_response_output_sent_back_as_input(summary: bool) -> None:
    """OpenAI's multi-turn pattern ``input += response.output``: every item pdserve returned (with its
    ids, statuses, the text part's logprobs and annotations, the reasoning item) is valid input and
    maps to one assistant turn holding the reasoning, the text and the calls."""
    output = _previous_output(summary)
    assert output[1]["content"][0]["logprobs"] and "annotations" in output[1]["content"][0]
    items = [{"role": "user", "content": "hi"}, *output,
             {"type": "function_call_output", "call_id": "call_1", "output": "one"},
             {"type": "function_call_output", "call_id": "call_2", "output": "two"},
             {"role": "user", "content": "and then?"}]
    chat = chat_body(ResponsesRequest.model_validate({"model": "m", "input": items}))
    ChatCompletionRequest.model_validate(chat)  # a valid chat request
    assert chat["messages"] == [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Let me look.", "reasoning_content": "think", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
            {"id": "call_2", "type": "function", "function": {"name": "f", "arguments": "{\"x\": 1}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "one"},
        {"role": "tool", "tool_call_id": "call_2", "content": "two"},
        {"role": "user", "content": "and then?"}]


def test_reasoning_input_alone_and_encrypted() -> None:
    """A reasoning item with no assistant turn after it is an assistant turn of its own; a summary
    stands for the text when there is no content; ``encrypted_content`` is refused by name."""
    items = [{"role": "user", "content": "hi"},
             {"type": "reasoning", "summary": [{"type": "summary_text", "text": "sum"}]}]
    chat = chat_body(ResponsesRequest.model_validate({"model": "m", "input": items}))
    assert chat["messages"][-1] == {"role": "assistant", "content": "", "reasoning_content": "sum"}
    # followed by another role's message, it does not wander to a later assistant turn
    items += [{"role": "user", "content": "q2"}, {"role": "assistant", "content": "a2"}]
    chat = chat_body(ResponsesRequest.model_validate({"model": "m", "input": items}))
    assert chat["messages"] == [{"role": "user", "content": "hi"},
                                {"role": "assistant", "content": "", "reasoning_content": "sum"},
                                {"role": "user", "content": "q2"}, {"role": "assistant", "content": "a2"}]
    body = ResponsesRequest.model_validate({"model": "m", "input": [
        {"type": "reasoning", "summary": [], "encrypted_content": "xyz"}]})
    with pytest.raises(APIError) as info:
        check_supported(body)
    assert info.value.param == "input.0.encrypted_content"


def test_chat_reasoning_content_reaches_the_template_on_assistant_messages_only() -> None:
    m = {"role": "assistant", "content": "a", "reasoning_content": "r"}
    req = ChatCompletionRequest.model_validate({"model": "m", "messages": [m]})
    assert req.message_dicts() == [m]
    with pytest.raises(ValueError, match="reasoning_content is only allowed"):
        ChatCompletionRequest.model_validate({"model": "m", "messages": [{**m, "role": "user"}]})


@pytest.mark.parametrize("part", [
    {"type": "input_image", "image_url": "https://example.com/a.png", "detail": "auto"},
    {"type": "input_file", "file_id": "file_1"},
    {"type": "input_audio", "input_audio": {"data": "AA==", "format": "wav"}},
])
def test_function_call_output_as_content_parts(part: dict[str, Any]) -> None:
    """``output`` as ``input_text`` parts is the tool message's text (joined); an image, file or audio part
    is refused at its ``type`` (``unsupported_parameter``, one sentence naming the type)."""
    parts = [{"type": "input_text", "text": "4"}, {"type": "input_text", "text": "2"}]
    items = [{"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
             {"type": "function_call_output", "call_id": "c1", "output": parts}]
    body = ResponsesRequest.model_validate({"model": "m", "input": items})
    check_supported(body)
    assert chat_body(body)["messages"][-1] == {"role": "tool", "tool_call_id": "c1", "content": "42"}
    items[1] = {**items[1], "output": [parts[0], part]}
    with pytest.raises(pydantic.ValidationError) as info:
        ResponsesRequest.model_validate({"model": "m", "input": items})
    err = validation_error(info.value.errors(), {"model": "m", "input": items})
    assert (err.status, err.param, err.code) == (400, "input.1.output.1.type", "unsupported_parameter")
    assert err.message == (f"input.1.output.1.type: '{part['type']}' content parts are not supported: "
                           "pdserve serves text models (send the content as text)")


def _fc(call_id: str) -> dict[str, Any]:
    return {"type": "function_call", "call_id": call_id, "name": "f", "arguments": "{}"}


def _fco(call_id: str) -> dict[str, Any]:
    return {"type": "function_call_output", "call_id": call_id, "output": "1"}


_MSG = {"role": "assistant", "content": [{"type": "output_text", "text": "done"}]}
_RS = {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "think"}]}
_HI = {"role": "user", "content": "hi"}


@pytest.mark.parametrize("items", [
    [_HI, _fc("c1"), _MSG, _fco("c1")],
    [_HI, _fc("c1"), _MSG, _fc("c2"), _fco("c1"), _fco("c2")],  # a response's own output, sent back
    [_HI, _RS, _fc("c1"), _RS, _fc("c2"), _fco("c2"), _fco("c1")],
], ids=["message-between", "call-message-call", "reasoning-between"])
def test_calls_and_outputs_pair_anywhere_later_in_the_input(items: list[dict[str, Any]]) -> None:
    """A function_call's output may come anywhere after it: what a response returned (a call, a message,
    another call) is valid input as it was, whatever chat turns it becomes."""
    body = ResponsesRequest.model_validate({"model": "m", "input": items})
    check_supported(body)
    ChatCompletionRequest.model_validate(chat_body(body))


@pytest.mark.parametrize(("items", "param", "says"), [
    ([_HI, _fco("c1"), _fc("c1")], "input.1", "a function_call_output for call_id 'c1', which no"),
    ([_HI, _fc("c1"), _fc("c2"), _fco("c2")], "input.1",
     "the function_call 'c1' has no function_call_output"),
])
def test_a_call_and_output_that_do_not_pair_are_refused(items: list[dict[str, Any]], param: str,
                                                       says: str) -> None:
    body = ResponsesRequest.model_validate({"model": "m", "input": items})
    with pytest.raises(APIError) as info:
        check_supported(body)
    assert (info.value.status, info.value.param) == (400, param) and says in info.value.message


def test_a_character_split_over_tokens_keeps_every_tokens_logprob() -> None:
    """An emoji made of two tokens (the first with no text of its own: held back, then released with the
    second): both tokens' logprobs go with the text, though each shows as ``\\xHH`` escapes longer than
    the one character they make."""
    body = ResponsesRequest.model_validate({"model": "m", "input": "hi", "include": [
        "message.output_text.logprobs"]})
    b = ResponseBuilder(body, "resp_3", 5)
    first = ChatTokenLogprob(" \\xf0\\x9f\\x98", -0.5, list(b" \xf0\x9f\x98"), [])
    second = ChatTokenLogprob("\\x80", -0.25, [0x80], [])
    b.start()
    b.feed([], [first])
    b.feed([ContentText(" \U0001F600")], [second])
    whole = msgspec.to_builtins(b.response("completed", ResponseUsage(
        1, InputTokensDetails(0), 2, OutputTokensDetails(0), 3)))
    placed = whole["output"][0]["content"][0]["logprobs"]
    assert [e["token"] for e in placed] == [first.token, second.token]
    assert b"".join(bytes(e["bytes"]) for e in placed).decode() == " \U0001F600"
