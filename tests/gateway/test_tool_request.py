"""Tool fields of a chat request: validation (each refusal a 400 naming the field), the tool plan, the
schema of a ``required`` / named ``tool_choice`` (checked with jsonschema on hand-written outputs), the
forced-call parser, the structural tag of strict tools under ``auto`` (what it forces is what each parser
reads; it reaches the workers' sampling params; its refusals), and the fallback rendering for a template
without tools (SmolLM2's)."""

from __future__ import annotations

import copy
import json
from typing import Any

import jsonschema
import msgspec
import pydantic
import pytest

from engine.sampling_params import SamplingParams
from gateway.chat_output import ChatOutputSpec, parse_whole
from gateway.errors import APIError
from gateway.metrics import GatewayMetrics
from gateway.openai_requests import ChatCompletionRequest, NamedToolChoice
from gateway.prepare import prepare, render_messages
from gateway.service import GatewayService
from gateway.text import TextProcessor
from gateway.tool_parsers import FORCED
from gateway.tool_prompt import FALLBACK_HEADER
from gateway.tool_request import check_tool_history, forced_tool_schema, plan_tools, tool_structured_output
from protocol.settings import GatewaySettings

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


def test_forced_parser_never_gives_an_unfinished_array_as_content() -> None:
    """A cut array is not the assistant's text: a call whose name is whole stands with the arguments
    written (none here), one cut inside its name is dropped (tests/gateway/test_tool_parsers.py: every
    cut)."""
    out = parse_whole(ChatOutputSpec(tools=FORCED), '[{"name": "weather", "argum')
    assert (out.content, [(c.name, c.arguments) for c in out.calls]) == (None, [("weather", "")])
    out = parse_whole(ChatOutputSpec(tools=FORCED), '[{"name": "weat')
    assert (out.content, out.calls) == (None, [])


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


STRICT_WEATHER = {"type": "function", "function": {**WEATHER["function"], "strict": True}}
STRICT_CALL_TEXT = {"hermes": "{}", "llama3_json": "{}", "mistral": "[TOOL_CALLS][{}]"}


def _call_tags(node: Any) -> list[dict[str, Any]]:
    """The tags of a structural tag whose content is a call's arguments (any depth, in order, each once)."""
    if isinstance(node, dict):
        own = [node] if node.get("type") == "tag" and node["content"].get("type") == "json_schema" else []
        return own + [t for v in node.values() for t in _call_tags(v)]
    if isinstance(node, list):
        return [t for v in node for t in _call_tags(v)]
    return []


@pytest.mark.parametrize("parser", ["hermes", "llama3_json", "mistral"])
@pytest.mark.parametrize("parallel", [True, False])
def test_strict_auto_tag_forces_what_the_parser_reads(parser: str, parallel: bool) -> None:
    """Under ``auto`` a strict tool gets a structural tag; each call it forces (the tag's begin, the
    arguments, its end, inside the format's wrapper) is read by the parser as that call; a strict tool's
    arguments are its ``parameters``, a non-strict one's any object."""
    plan = plan_tools(req(tools=[STRICT_WEATHER, CLOCK], parallel_tool_calls=parallel), parser, "none")
    assert plan.strict_tag is not None and plan.strict_param == "tools.0.function.strict"
    assert plan.output == ChatOutputSpec(None, parser, parallel) and plan.forced_schema is None
    tags = list({t["begin"]: t for t in _call_tags(plan.strict_tag)}.values())
    assert [t["content"]["json_schema"] for t in tags] == [WEATHER_PARAMETERS, {"type": "object"}]
    for tag, (name, arguments) in zip(tags, [("weather", {"city": "Paris", "days": 2}), ("clock", {})],
                                      strict=True):
        call = tag["begin"] + json.dumps(arguments) + tag["end"]
        text = STRICT_CALL_TEXT[parser].format(call) if parser == "mistral" else call
        out = parse_whole(ChatOutputSpec(None, parser, parallel), text)
        assert out.content is None and [(c.name, json.loads(c.arguments)) for c in out.calls] == [
            (name, arguments)]


def test_strict_adds_no_constraint_outside_auto_or_when_false() -> None:
    assert plan_tools(req(tools=[WEATHER, CLOCK]), "hermes", "none").strict_tag is None
    unstrict = {"type": "function", "function": {**WEATHER["function"], "strict": False}}
    assert plan_tools(req(tools=[unstrict]), "hermes", "none").strict_tag is None
    none = plan_tools(req(tools=[STRICT_WEATHER], tool_choice="none"), "hermes", "none")
    assert none.strict_tag is None and not none.output.active
    forced = plan_tools(req(tools=[STRICT_WEATHER], tool_choice="required"), "hermes", "none")
    assert forced.strict_tag is None and forced.forced_schema is not None


@pytest.mark.parametrize(("tools", "parser", "reasoning", "param"), [
    ([CLOCK, STRICT_WEATHER], "llama3_json", "qwen3", "tools.1.function.strict"),
    ([STRICT_WEATHER], "mistral", "deepseek_r1", "tools.0.function.strict"),
    ([{"type": "function", "function": {"name": "f", "strict": True, "parameters": {
        "type": "object", "properties": {"a": {"type": "string", "pattern": "(?=a)"}}}}}], "hermes", "none",
     "tools.0.function.parameters"),
])
def test_strict_refusals_name_the_field(tools: list[Any], parser: str, reasoning: str, param: str) -> None:
    with pytest.raises(APIError) as info:
        plan_tools(req(tools=tools), parser, reasoning)
    assert (info.value.status, info.value.param) == (400, param)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "f"}}])
def test_forced_choice_refuses_a_pattern_the_grammar_engine_cannot_compile(choice: Any) -> None:
    """A forced call's schema with a lookahead ``pattern`` reached the workers, which failed the request;
    now a 400 naming the tool's parameters, as for ``response_format`` and strict tools."""
    bad = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "string", "pattern": "(?=a)"}}}}}
    with pytest.raises(APIError) as info:
        plan_tools(req(tools=[CLOCK, bad], tool_choice=choice), "hermes", "none")
    assert (info.value.status, info.value.param) == (400, "tools.1.function.parameters")
    named_other = {"type": "function", "function": {"name": CLOCK["function"]["name"]}}
    assert plan_tools(req(tools=[CLOCK, bad], tool_choice=named_other), "hermes", "none").forced_schema


def test_strict_with_hermes_and_reasoning_is_constrained() -> None:
    plan = plan_tools(req(tools=[STRICT_WEATHER]), "hermes", "qwen3")
    assert plan.strict_tag is not None and plan.output == ChatOutputSpec("qwen3", "hermes", True)


def _service(proc: TextProcessor) -> GatewayService:
    settings = GatewaySettings(model_name="m", insecure_control_plane=True)
    return GatewayService(settings, GatewayMetrics(), text=proc)


def test_strict_auto_reaches_the_workers_as_a_structural_tag(proc: TextProcessor) -> None:
    """``prepare`` puts the tag on every choice's sampling params (as they travel to the workers), names
    the strict field for a worker's refusal, and keeps the stop strings."""
    body = req(tools=[CLOCK, STRICT_WEATHER], n=2, stop=["END"])
    prepared = prepare(_service(proc), body, "r1")
    plan = plan_tools(body, "hermes", "none")  # SmolLM2's template renders no tools: hermes
    for choice in prepared.choices:
        params = msgspec.msgpack.decode(msgspec.msgpack.encode(choice.inp.sampling), type=SamplingParams)
        assert params.structured_output is not None and params.structured_output.kind == "structural_tag"
        assert json.loads(params.structured_output.spec) == plan.strict_tag
        assert choice.inp.structured_param == "tools.1.function.strict" and choice.inp.stop == ("END",)
    plain = prepare(_service(proc), req(tools=[CLOCK]), "r2")
    assert plain.choices[0].inp.sampling.structured_output is None


@pytest.mark.parametrize("fields", [{"response_format": {"type": "json_object"}},
                                    {"structured_outputs": {"regex": "a"}}])
def test_strict_auto_with_another_constraint_is_refused(proc: TextProcessor, fields: dict[str, Any]) -> None:
    with pytest.raises(APIError) as info:
        prepare(_service(proc), req(tools=[STRICT_WEATHER], **fields), "r1")
    assert (info.value.status, info.value.param) == (400, "tools.0.function.strict")
    text = prepare(_service(proc), req(tools=[STRICT_WEATHER], response_format={"type": "text"}), "r2")
    assert text.choices[0].inp.sampling.structured_output is not None


def test_strict_hermes_with_reasoning_never_ends_the_output_after_one_call() -> None:
    """With a reasoning parser the grammar cannot tell a call drafted in the reasoning block from the
    answer's: ending the output after the first block (parallel calls off) ended it inside the reasoning,
    with no answer and no call. The output parser keeps the answer's first call instead."""
    reasoning = plan_tools(req(tools=[STRICT_WEATHER], parallel_tool_calls=False), "hermes", "qwen3")
    plain = plan_tools(req(tools=[STRICT_WEATHER], parallel_tool_calls=False), "hermes", "none")
    assert reasoning.strict_tag is not None and plain.strict_tag is not None
    assert reasoning.strict_tag["format"]["stop_after_first"] is False
    assert plain.strict_tag["format"]["stop_after_first"] is True
    assert reasoning.output == ChatOutputSpec("qwen3", "hermes", False)  # the parser keeps one call


@pytest.mark.parametrize("choice", ["auto", "required"])
def test_constrained_parameters_are_object_schemas(choice: str) -> None:
    """The schema a constrained call is held to says ``type: object`` (the grammar engine reads a schema
    without it as any value); a root ``anyOf`` / ``oneOf`` / ``$ref`` is refused naming the parameters."""
    untyped = {"type": "function", "function": {"name": "f", "strict": True,
                                                "parameters": {"properties": {"a": {"type": "integer"}}}}}
    plan = plan_tools(req(tools=[untyped], tool_choice=choice), "hermes", "none")
    if choice == "auto":
        assert plan.strict_tag is not None
        assert plan.strict_tag["format"]["tags"][0]["content"]["json_schema"]["type"] == "object"
    else:
        assert plan.forced_schema is not None
        assert plan.forced_schema["items"]["properties"]["arguments"]["type"] == "object"
    for key, value in [("anyOf", [{"type": "object"}]), ("oneOf", [{"type": "object"}]),
                       ("$ref", "#/$defs/x")]:
        combined = {"type": "function", "function": {"name": "f", "strict": True, "parameters": {
            "type": "object", key: value, "$defs": {"x": {"type": "object"}}}}}
        with pytest.raises(APIError) as info:
            plan_tools(req(tools=[combined], tool_choice=choice), "hermes", "none")
        assert (info.value.status, info.value.param) == (400, "tools.0.function.parameters"), key
        assert key in info.value.message


NODE_PARAMETERS = {"type": "object", "additionalProperties": False, "required": ["value"],
                   "properties": {"value": {"$ref": "#/$defs/a~1b"},
                                  "children": {"type": "array", "items": {"$ref": "#"}},
                                  "$ref": {"type": "string", "examples": [{"$ref": "#/x"}]},
                                  "label": {"const": {"$ref": "#"}}},
                   "$defs": {"a/b": {"type": "integer"}}}


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "node"}}])
def test_forced_schema_nests_each_tool_s_refs_with_its_parameters(choice: Any) -> None:
    """The forced schema's calls hold each tool's arguments to what its parameters mean on their own
    (checked with jsonschema here; through the grammar engine in
    tests/engine/test_structured_output_tools.py): local refs are moved with the parameters, a ``$ref``
    in data (``examples``, ``const``) or a property named ``$ref`` is left alone, and the request's own
    parameters, which the chat template renders, are not changed."""
    node = {"type": "function", "function": {"name": "node", "parameters": copy.deepcopy(NODE_PARAMETERS)}}
    body = req(tools=[CLOCK, node], tool_choice=choice)
    plan = plan_tools(body, "hermes", "none")
    assert plan.forced_schema is not None and plan.template_tools is not None
    assert plan.template_tools[1]["function"]["parameters"] == NODE_PARAMETERS
    assert body.tools is not None and body.tools[1].function.parameters == NODE_PARAMETERS
    items = plan.forced_schema["items"]
    at = "#/items/anyOf/1/properties/arguments" if choice == "required" else "#/items/properties/arguments"
    arguments = (items["anyOf"][1] if choice == "required" else items)["properties"]["arguments"]
    assert arguments["properties"]["value"] == {"$ref": at + "/$defs/a~1b"}
    assert arguments["properties"]["children"]["items"] == {"$ref": at}
    assert arguments["properties"]["$ref"] == NODE_PARAMETERS["properties"]["$ref"]  # type: ignore[index]
    assert arguments["properties"]["label"] == {"const": {"$ref": "#"}}
    standalone = jsonschema.Draft202012Validator(NODE_PARAMETERS)
    forced = jsonschema.Draft202012Validator(plan.forced_schema)
    for value in [{"value": 1}, {"value": 1, "children": [{"value": 2, "children": [{"value": 3}]}]},
                  {"value": "1"}, {"value": 1, "children": [{"value": 2, "children": [{}]}]},
                  {"value": 1, "children": [[{"name": "node", "arguments": {"value": 1}}]]},
                  {"value": 1, "$ref": "x", "label": {"$ref": "#"}}, {"value": 1, "label": {"value": 1}}]:
        assert forced.is_valid([{"name": "node", "arguments": value}]) == standalone.is_valid(value), value


def _call(call_id: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function",
            "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}


CALLS = {"role": "assistant", "content": None, "tool_calls": [_call("c1"), _call("c2")]}


def _tool(call_id: str) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call_id, "content": "sunny"}


@pytest.mark.parametrize(("messages", "says"), [
    ([*USER, CALLS, _tool("c1"), _tool("nope")], "answers tool_call_id 'nope', which is not a tool call"),
    ([*USER, _tool("c1")], "answers tool_call_id 'c1', which is not a tool call"),
    ([*USER, CALLS, _tool("c1"), _tool("c2"), {"role": "assistant", "content": "ok"}, _tool("c1")],
     "answers tool_call_id 'c1', which is not a tool call"),
    ([*USER, CALLS], "none answers 'c1', 'c2'"),
    ([*USER, CALLS, _tool("c2")], "none answers 'c1'"),
    ([*USER, CALLS, _tool("c1"), *USER], "none answers 'c2'"),
])
def test_a_history_whose_tool_calls_and_results_do_not_pair_is_refused(messages: list[dict[str, Any]],
                                                                       says: str) -> None:
    """As on OpenAI's chat API: a tool result for no call of the assistant message before it, or a call
    left without a result, is a 400 naming ``messages``."""
    with pytest.raises(APIError) as info:
        check_tool_history(req(messages=messages, tools=[WEATHER]).messages)
    assert (info.value.status, info.value.param) == (400, "messages")
    assert says in info.value.message


def test_a_history_whose_tool_calls_are_all_answered_passes() -> None:
    """Results in any order, several rounds, and a history with calls but no tools in this request."""
    messages = [*USER, CALLS, _tool("c2"), _tool("c1"), {"role": "assistant", "content": "Sunny."}, *USER,
                {"role": "assistant", "content": "Let me look.", "tool_calls": [_call("c3")]}, _tool("c3")]
    check_tool_history(req(messages=messages, tools=[WEATHER]).messages)
    check_tool_history(req(messages=messages).messages)
