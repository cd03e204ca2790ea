"""The Responses API pieces without workers: a body's chat request (input items, instructions, tools,
text.format), the field a chat-side 400 names, and the output items and event order a parsed output
makes."""

from __future__ import annotations

import json

import msgspec

from gateway.openai_requests import ChatCompletionRequest
from gateway.responses_api import (
    InputTokensDetails,
    OutputTokensDetails,
    ResponseBuilder,
    ResponsesRequest,
    ResponseUsage,
    chat_body,
    responses_param,
)
from gateway.tool_parsers.events import ContentText, ReasoningText, ToolCallArguments, ToolCallStart


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
