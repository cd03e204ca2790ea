"""A chat request's tools: ``tools``, ``tool_choice`` and ``parallel_tool_calls`` checked against each
other and the served model, the tool definitions for the chat template, the parsers of the output, and,
for ``tool_choice`` ``required`` or a named function, the JSON schema decoding must satisfy.

Rules (OpenAI's, plus what pdserve cannot honour):

* A chat history pairs calls and results as OpenAI's chat API requires (``check_tool_history``, called
  by the chat route: a ``/v1/responses`` input has its own rule, gateway/responses_api.py): a ``tool``
  message answers, by ``tool_call_id``, a call of the assistant message before its run of tool
  messages, and every call of an assistant message is answered before the next message of another role
  (or the end) → else 400 naming ``messages`` and the id.
* ``tool_choice`` or ``parallel_tool_calls`` without ``tools`` (absent or ``[]``) → 400 naming it.
* Tool names are unique; each ``parameters`` is a valid JSON Schema (checked with ``jsonschema``, the
  metaschema it declares, else Draft 2020-12) of an object → else 400 naming ``tools.<i>...``.
* A named ``tool_choice`` must name one of ``tools`` → else 400 naming ``tool_choice``.
* ``tool_choice`` ``auto`` (the default with tools) parses the model's calls with the model's parser;
  a model without a known tool-call format (``--tool-call-parser none``) → 400 naming ``tools``.
* ``tool_choice`` ``none`` renders the tools but parses no calls.
* ``required`` / named: the output is constrained to ``forced_tool_schema`` (``tool_structured_output``:
  a structured output of kind json, which ``gateway/prepare.py`` attaches) and read by the
  ``forced_json`` parser; combined with ``response_format`` or ``structured_outputs`` → 400.
* ``auto`` with at least one ``strict: true`` tool: the output is constrained by a structural tag
  (``gateway/tool_grammar.py``; ``auto_tool_structured_output``): free text, but a call in the parser's
  format must call one of the tools, a strict tool's arguments satisfying its ``parameters`` (each
  checked like a ``response_format`` schema, ``gateway/structured_output.check_json_schema``), a
  non-strict tool's being any JSON object. Refused (400 naming ``tools.<i>.function.strict``, the first
  strict tool): with ``response_format`` or ``structured_outputs`` (``gateway/prepare.py``), and for the
  ``llama3_json`` and ``mistral`` parsers with a reasoning parser (their calls are recognised at the
  start of the answer, which the grammar cannot place after a reasoning block). ``strict`` false or
  absent alone adds no constraint.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import jsonschema
import jsonschema.exceptions
import jsonschema.validators

from engine.sampling_params import StructuredOutput
from gateway.chat_output import ChatOutputSpec
from gateway.errors import bad_request
from gateway.openai_requests import ChatCompletionRequest, ChatMessage, FunctionTool, NamedToolChoice
from gateway.structured_output import check_json_schema, relocated_schema
from gateway.tool_grammar import ANY_OBJECT, CONSTRAINABLE, ToolSchema, auto_tool_structural_tag
from gateway.tool_parsers import FORCED

NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass(frozen=True)
class ToolPlan:
    """What a chat request's tools amount to: ``template_tools`` (OpenAI tool objects for the chat
    template, None without tools), the output parsers, ``forced_schema`` (the JSON schema of a
    ``required`` or named choice's output; None otherwise), and ``strict_tag`` (the structural tag of
    ``auto`` with strict tools; None otherwise) with ``strict_param`` (``tools.<i>.function.strict`` of
    the first strict tool, the field a refusal names)."""

    template_tools: list[dict[str, Any]] | None
    output: ChatOutputSpec
    forced_schema: dict[str, Any] | None = None
    strict_tag: dict[str, Any] | None = None
    strict_param: str | None = None


def check_parameters(schema: dict[str, Any], param: str) -> None:
    """Raises ``APIError`` (400 naming ``param``) when ``schema`` is not a valid JSON Schema of an object
    (validated against the metaschema it names in ``$schema``; one pdserve does not know, or none: Draft
    2020-12)."""
    if not isinstance(schema.get("$schema", ""), str):
        raise bad_request(f"{param}: $schema must be a string (a metaschema URI)", param)
    validator = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        validator.check_schema(schema)
    except jsonschema.exceptions.SchemaError as exc:
        where = "/".join(str(p) for p in exc.path)
        raise bad_request(f"{param} is not a valid JSON Schema: {exc.message}" +
                          (f" (at {where})" if where else ""), param) from exc
    if schema.get("type", "object") != "object":
        raise bad_request(f"{param} must describe an object (type: object), got type {schema['type']!r}",
                          param)


def _parameters(tool: FunctionTool) -> dict[str, Any]:
    return tool.function.parameters if tool.function.parameters is not None else NO_PARAMETERS


ROOT_COMBINATORS = ("anyOf", "oneOf", "allOf", "not", "if", "$ref", "$dynamicRef")


def constrained_parameters(tool: FunctionTool, param: str) -> dict[str, Any]:
    """The schema a constrained call's arguments are held to (a ``required`` or named choice, a strict
    tool under ``auto``): the tool's ``parameters`` with ``"type": "object"`` made explicit (the grammar
    engine reads a schema without ``type`` as any JSON value, where OpenAI and ``check_parameters``
    read an object).

    Raises:
        APIError: 400 naming ``param`` when the grammar engine would refuse the schema
            (``check_json_schema``: e.g. a ``pattern`` with a lookahead), or when its root combines
            schemas (``ROOT_COMBINATORS``): the engine then lets non-object arguments through, which the
            tool-call parsers do not read as a call (OpenAI's strict mode also wants an object root).
    """
    schema = _parameters(tool)
    check_json_schema(schema, param)
    combined = [k for k in ROOT_COMBINATORS if k in schema]
    if combined:
        raise bad_request(f"{param}: a constrained tool call's parameters must be an object schema at the "
                          f"root, without {', '.join(combined)} there (move it into a property)", param)
    return schema if "type" in schema else {"type": "object", **schema}


def forced_tool_schema(tools: list[FunctionTool], choice: str | NamedToolChoice,
                       parallel_tool_calls: bool) -> dict[str, Any]:
    """The JSON schema of a ``required`` or named ``tool_choice``'s output: an array of calls
    ``{"name": <const>, "arguments": <that tool's constrained_parameters>}`` (one of the tools for
    ``required``, at least one call, at most one when ``parallel_tool_calls`` is false; exactly one call of
    the named tool for a named choice). Source of the approach: vLLM constrains ``required`` to such an array.

    A tool's parameters are nested at ``#/items/properties/arguments`` (one chosen tool) or
    ``#/items/anyOf/<k>/properties/arguments``, and the local refs in them (``#``, ``#/$defs/...``,
    any ``#/...`` pointer), which the grammar engine resolves from the root of the whole schema, are
    moved there with them (``relocated_schema``): each tool's ``$defs`` stay its own, recursion through
    ``#`` stays within the tool's arguments.

    Raises:
        APIError: 400 naming ``tools.<i>.function.parameters`` for a chosen tool's schema that cannot
            be constrained (``constrained_parameters``).
    """
    chosen: list[tuple[FunctionTool, dict[str, Any]]] = []
    for i, t in enumerate(tools):
        if choice == "required" or (isinstance(choice, NamedToolChoice)
                                    and t.function.name == choice.function.name):
            chosen.append((t, constrained_parameters(t, f"tools.{i}.function.parameters")))
    items = []
    for k, (t, arguments) in enumerate(chosen):
        at = "#/items/properties/arguments" if len(chosen) == 1 else f"#/items/anyOf/{k}/properties/arguments"
        items.append({"type": "object",
                      "properties": {"name": {"type": "string", "const": t.function.name},
                                     "arguments": relocated_schema(arguments, at)},
                      "required": ["name", "arguments"], "additionalProperties": False})
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": items[0] if len(items) == 1 else {"anyOf": items}}
    if choice != "required" or not parallel_tool_calls:
        schema["maxItems"] = 1
    return schema


def tool_structured_output(schema: dict[str, Any]) -> StructuredOutput:
    """The structured-output constraint that makes the workers' decoding satisfy ``schema`` (a
    ``required`` or named ``tool_choice``'s calls): kind ``json``, spec the schema's JSON text."""
    return StructuredOutput(kind="json", spec=json.dumps(schema))


def auto_tool_structured_output(tag: dict[str, Any]) -> StructuredOutput:
    """The structured-output constraint of ``auto`` with strict tools: kind ``structural_tag``, spec the
    tag's JSON text."""
    return StructuredOutput(kind="structural_tag", spec=json.dumps(tag, ensure_ascii=False))


def strict_tool_tag(tools: list[FunctionTool], tool_parser: str, reasoning: str | None,
                    parallel: bool) -> tuple[dict[str, Any], str] | None:
    """The structural tag of ``auto`` when a tool is ``strict`` (None when none is), and the
    ``tools.<i>.function.strict`` field of the first strict tool.

    Raises:
        APIError: 400 naming ``tools.<i>.function.strict`` where the parser's format cannot be
            constrained (module docstring), or ``tools.<i>.function.parameters`` for a strict tool's
            schema the grammar engine would refuse.
    """
    strict = [i for i, t in enumerate(tools) if t.function.strict]
    if not strict:
        return None
    param = f"tools.{strict[0]}.function.strict"
    if tool_parser not in CONSTRAINABLE:
        raise bad_request(f"{param}: strict tools are not supported with the tool-call parser "
                          f"{tool_parser!r}", param, "unsupported_parameter")
    if tool_parser != "hermes" and reasoning is not None:
        raise bad_request(f"{param}: strict is not supported under tool_choice 'auto' with the "
                          f"{tool_parser} tool-call format and the {reasoning} reasoning parser: its calls "
                          f"are recognised at the start of the answer, which the grammar cannot place "
                          f"after the reasoning block (use tool_choice 'required' or a named function, "
                          f"which are constrained, or strict: false)", param, "unsupported_parameter")
    schemas = []
    for i, tool in enumerate(tools):
        arguments = ANY_OBJECT
        if tool.function.strict:
            arguments = constrained_parameters(tool, f"tools.{i}.function.parameters")
        schemas.append(ToolSchema(tool.function.name, arguments))
    # with a reasoning parser (hermes only, above) the grammar cannot tell a call drafted in the
    # reasoning block from one in the answer, so it never ends the output after one call: the output
    # parser keeps the answer's first call when parallel calls are off
    return auto_tool_structural_tag(tool_parser, schemas, parallel or reasoning is not None), param


def template_tools(tools: list[FunctionTool]) -> list[dict[str, Any]]:
    """``tools`` checked (no name twice, each ``parameters`` a valid JSON Schema of an object) and given
    as the OpenAI tool objects the chat template takes.

    Raises:
        APIError: 400 naming ``tools.{i}.function.name`` or ``tools.{i}.function.parameters``.
    """
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        if tool.function.name in seen:
            raise bad_request(f"tools: the function name {tool.function.name!r} appears twice",
                              f"tools.{i}.function.name")
        seen.add(tool.function.name)
        if tool.function.parameters is not None:
            check_parameters(tool.function.parameters, f"tools.{i}.function.parameters")
    return [t.model_dump(exclude_none=True) for t in tools]


def check_tool_history(messages: list[ChatMessage]) -> None:
    """Check that the history pairs tool calls with results as OpenAI does (module docstring): each tool
    message's ``tool_call_id`` is a call of the assistant message before its run of tool messages, and
    each such call has a tool message before the next message of another role or the end.

    Raises:
        APIError: 400 naming ``messages`` and the ``tool_call_id`` at fault.
    """
    calls: set[str] = set()  # call ids of the assistant message the current run of tool messages follows
    unanswered: list[str] = []
    for msg in messages:
        if msg.role == "tool":
            if msg.tool_call_id not in calls:
                raise bad_request(f"a tool message answers tool_call_id {msg.tool_call_id!r}, which is not a "
                                  "tool call of the assistant message before it", "messages")
            if msg.tool_call_id in unanswered:
                unanswered.remove(msg.tool_call_id)
            continue
        if unanswered:
            break
        calls = {c.id for c in msg.tool_calls or ()}
        unanswered = [c.id for c in msg.tool_calls or ()]
    if unanswered:
        raise bad_request("an assistant message with tool_calls must be followed by a tool message answering "
                          f"each call; none answers {', '.join(map(repr, unanswered))}", "messages")


def plan_tools(body: ChatCompletionRequest, tool_parser: str, reasoning_parser: str) -> ToolPlan:
    """Check the request's tool fields and decide how its output is parsed. ``tool_parser``: the model's
    (``gateway.tool_parsers.select_tool_parser``, possibly ``none``); ``reasoning_parser`` likewise.

    Raises:
        APIError: 400 naming the field (see the module docstring).
    """
    reasoning = None if reasoning_parser == "none" else reasoning_parser
    tools = body.tools or []
    if not tools:
        for name in ("tool_choice", "parallel_tool_calls"):
            if getattr(body, name) is not None:
                raise bad_request(f"{name} is only allowed when tools are given", name)
        return ToolPlan(None, ChatOutputSpec(reasoning))
    listed = template_tools(tools)
    seen = {t.function.name for t in tools}
    choice = body.tool_choice or "auto"
    parallel = body.parallel_tool_calls is not False
    if isinstance(choice, NamedToolChoice) and choice.function.name not in seen:
        raise bad_request(f"tool_choice names the function {choice.function.name!r}, which is not in tools",
                          "tool_choice")
    if choice == "none":
        return ToolPlan(listed, ChatOutputSpec(reasoning))
    if choice == "auto":
        if tool_parser == "none":
            raise bad_request("the served model's chat template has no tool-call format pdserve knows, so "
                              "its calls cannot be parsed: start the gateway with --tool-call-parser "
                              "(hermes, llama3_json or mistral)", "tools", "unsupported_parameter")
        strict = strict_tool_tag(tools, tool_parser, reasoning, parallel)
        return ToolPlan(listed, ChatOutputSpec(reasoning, tool_parser, parallel),
                        strict_tag=strict[0] if strict else None, strict_param=strict[1] if strict else None)
    return ToolPlan(listed, ChatOutputSpec(reasoning, FORCED, parallel),
                    forced_tool_schema(tools, choice, parallel))
