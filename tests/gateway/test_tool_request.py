"""Tool fields of a chat request: validation (each refusal a 400 naming the field), the tool plan, the
schema of a ``required`` / named ``tool_choice`` (checked with jsonschema on hand-written outputs), the
forced-call parser, and the fallback rendering for a template without tools (SmolLM2's)."""

from __future__ import annotations

import copy
import json
from typing import Any

import jsonschema
import pydantic
import pytest

from gateway.chat_output import ChatOutputSpec, parse_whole
from gateway.errors import APIError
from gateway.openai_requests import ChatCompletionRequest, NamedToolChoice
from gateway.prepare import render_messages
from gateway.text import TextProcessor
from gateway.tool_parsers import FORCED
from gateway.tool_prompt import FALLBACK_HEADER
from gateway.tool_request import forced_tool_schema, plan_tools, tool_structured_output

WEATHER_PARAMETERS = {"type": "object", "additionalProperties": False, "required": ["city"],
                      "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}}}
WEATHER = {"type": "function", "function": {"name": "weather", "description": "Weather in a city",
                                           "parameters": WEATHER_PARAMETERS}}
CLOCK = {"type": "function", "function": {"name": "clock"}}
USER = [{"role": "user", "content": "Weather in Paris?"}]


def req(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": USER, **fields})


def refused(fields: dict[str, Any], parser: str = "hermes") -> APIError:
    with pytest.raises(APIError) as info:
        plan_tools(req(**fields), parser, "none")
    assert info.value.status == 400
    return info.value


@pytest.mark.parametrize(("fields", "param"), [
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"tool_choice": "none"}, "tool_choice"),
    ({"tools": [], "tool_choice": "required"}, "tool_choice"),
    ({"parallel_tool_calls": False}, "parallel_tool_calls"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [WEATHER, WEATHER]}, "tools.1.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}]},
     "tools.0.function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
     "tools.0.function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"$schema": 5}}}]},
     "tools.0.function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"pattern": "("}}}]},
     "tools.0.function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"minimum": "one"}}}}}]}, "tools.0.function.parameters"),
])
def test_refusals_name_the_field(fields: dict[str, Any], param: str) -> None:
    assert refused(fields).param == param


def test_auto_needs_a_parser_none_does_not() -> None:
    err = refused({"tools": [WEATHER]}, parser="none")
    assert (err.param, err.code) == ("tools", "unsupported_parameter") and "--tool-call-parser" in err.message
    plan = plan_tools(req(tools=[WEATHER], tool_choice="none"), "none", "none")
    assert plan.template_tools == [WEATHER] and not plan.output.active


def test_plans() -> None:
    plan = plan_tools(req(tools=[WEATHER, CLOCK]), "hermes", "qwen3")
    assert plan.output == ChatOutputSpec("qwen3", "hermes", True) and plan.forced_schema is None
    assert plan.template_tools == [WEATHER, CLOCK]
    plan = plan_tools(req(tools=[WEATHER], parallel_tool_calls=False), "mistral", "none")
    assert plan.output == ChatOutputSpec(None, "mistral", False)
    plan = plan_tools(req(), "hermes", "none")
    assert plan.template_tools is None and not plan.output.active
    forced = plan_tools(req(tools=[WEATHER, CLOCK], tool_choice="required"), "hermes", "none")
    assert forced.output.tools == FORCED and forced.forced_schema is not None


def test_required_is_a_json_structured_output_of_the_forced_schema() -> None:
    plan = plan_tools(req(tools=[WEATHER], tool_choice="required"), "hermes", "none")
    assert plan.forced_schema is not None
    constraint = tool_structured_output(plan.forced_schema)
    assert constraint.kind == "json" and json.loads(constraint.spec) == plan.forced_schema


@pytest.mark.parametrize(("bad_message", "where"), [
    ({"role": "user", "content": None}, "messages.0"),
    ({"role": "tool", "content": "22 C"}, "messages.0"),
    ({"role": "user", "content": "x", "tool_call_id": "c"}, "messages.0"),
    ({"role": "user", "content": "x", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}, "messages.0"),
    ({"role": "assistant", "content": None, "tool_calls": [{"id": "c", "function": {"name": "f"}}]},
     "messages.0.tool_calls.0.function.arguments"),
])
def test_bad_messages(bad_message: dict[str, Any], where: str) -> None:
    with pytest.raises(pydantic.ValidationError) as info:
        ChatCompletionRequest.model_validate({"model": "m", "messages": [bad_message]})
    assert ".".join(str(x) for x in info.value.errors()[0]["loc"]).startswith(where)


CALL = {"name": "weather", "arguments": {"city": "Paris", "days": 2}}


@pytest.mark.parametrize(("choice", "parallel", "output", "valid"), [
    ("required", True, [CALL], True),
    ("required", True, [CALL, {"name": "clock", "arguments": {}}], True),
    ("required", False, [CALL, {"name": "clock", "arguments": {}}], False),
    ("required", True, [], False),
    ("required", True, CALL, False),
    ("required", True, [{"name": "weather", "arguments": {"days": 2}}], False),  # city required
    ("required", True, [{"name": "weather", "arguments": {"city": "P", "days": 0}}], False),
    ("required", True, [{"name": "weather", "arguments": {"city": "P", "wind": 1}}], False),
    ("required", True, [{"name": "clock", "arguments": {"x": 1}}], False),  # no parameters: {}
    ("required", True, [{"name": "rain", "arguments": {}}], False),
    ("required", True, [{"name": "weather"}], False),
    ("weather", True, [CALL], True),
    ("weather", True, [{"name": "clock", "arguments": {}}], False),
    ("weather", True, [CALL, CALL], False),
    ("clock", False, [{"name": "clock", "arguments": {}}], True),
])
def test_forced_schema(choice: str, parallel: bool, output: Any, valid: bool) -> None:
    tools = req(tools=[WEATHER, CLOCK]).tools
    assert tools is not None
    named: str | NamedToolChoice = choice if choice == "required" else NamedToolChoice.model_validate(
        {"type": "function", "function": {"name": choice}})
    schema = forced_tool_schema(tools, named, parallel)
    jsonschema.Draft202012Validator.check_schema(schema)
    assert jsonschema.Draft202012Validator(schema).is_valid(output) == valid
    if valid:  # what the schema admits, the forced parser reads as the same calls
        out = parse_whole(ChatOutputSpec(tools=FORCED), json.dumps(output))
        assert out.content is None
        assert [(c.name, json.loads(c.arguments)) for c in out.calls] == [(o["name"], o["arguments"])
                                                                          for o in output]


def test_forced_parser_keeps_an_unfinished_array_as_content() -> None:
    out = parse_whole(ChatOutputSpec(tools=FORCED), '[{"name": "weather", "argum')
    assert (out.content, out.calls) == ('[{"name": "weather", "argum', [])


def test_fallback_rendering_on_smollm2(proc: TextProcessor) -> None:
    """SmolLM2's template never reads ``tools``: the tools go into the system message in the Hermes
    format, a replayed call becomes a ``<tool_call>`` block, a tool result a ``<tool_response>``."""
    assert proc.chat_template is not None and "tools" not in proc.chat_template
    history = req(messages=[
        {"role": "system", "content": "Be brief."}, *USER,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "22 C, sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": "no rain"}], tools=[WEATHER])
    text = render_messages(proc, history.message_dicts(), None, tools=[WEATHER])
    assert text.startswith(f"<|im_start|>system\nBe brief.\n\n{FALLBACK_HEADER}\n<tools>\n"
                           f"{json.dumps(WEATHER['function'])}\n</tools>\n")
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n'
            "</tool_call><|im_end|>") in text
    assert ("<|im_start|>user\n<tool_response>\n22 C, sunny\n</tool_response>\n<tool_response>\nno rain\n"
            "</tool_response><|im_end|>\n<|im_start|>assistant\n") in text
    plain = render_messages(proc, req().message_dicts(), None)
    assert "<tools>" not in plain and plain == proc.render_chat(USER)


def test_template_with_tools_gets_them(proc: TextProcessor) -> None:
    """A template that reads ``tools`` renders them itself; call arguments reach it as an object."""
    template = ("{% for t in tools %}T:{{ t.function.name }};{% endfor %}{% for m in messages %}"
                "{{ m.role }}:{% if m.tool_calls %}{{ m.tool_calls[0].function.arguments.city }}{% else %}"
                "{{ m.content }}{% endif %};{% endfor %}")
    tokenizer = copy.copy(proc.tokenizer)
    tokenizer.chat_template = template
    own = TextProcessor(tokenizer)
    history = req(messages=[*USER, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c", "content": "22 C"}])
    text = render_messages(own, history.message_dicts(), None, tools=[WEATHER, CLOCK])
    assert text == "T:weather;T:clock;user:Weather in Paris?;assistant:Paris;tool:22 C;"
