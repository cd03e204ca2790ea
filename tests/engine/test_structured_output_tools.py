"""The ``structural_tag`` structured output on SmolLM2's tokenizer: the kind compiles, a bad tag is refused,
the token bitmask of the gateway's tag for strict tools under ``tool_choice`` ``auto`` leaves free text
free and holds a call's arguments to the tool's schema, and random walks through each parser's tag
(random tokens among those the bitmask allows) decode to text whose parsed calls all name a tool with
arguments that satisfy its schema, each walk that writes a call having it read back as one. The JSON
schema of a forced choice (``required`` or a named function) and the strict tag keep what a tool's
``$ref`` pointers (``$defs``, ``definitions``, ``#``, recursion) mean, through the grammar engine."""

from __future__ import annotations

import json
import random
from pathlib import Path

import jsonschema
import pytest
import torch

from engine.sampling_params import StructuredOutput
from engine.structured_output import GrammarRejected, GrammarState, StructuredOutputs
from gateway.chat_output import ChatOutputSpec, parse_whole
from gateway.tool_grammar import ANY_OBJECT, ToolSchema, auto_tool_structural_tag

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB, EOS = 49152, 2
WEATHER = {"type": "object", "additionalProperties": False, "required": ["city"],
           "properties": {"city": {"type": "string", "maxLength": 12},
                          "days": {"type": "integer", "minimum": 1, "maximum": 9}}}
TOOLS = [ToolSchema("weather", WEATHER), ToolSchema("clock", ANY_OBJECT)]
SCHEMAS = {t.name: t.arguments for t in TOOLS}


@pytest.fixture(scope="module")
def outputs(smollm2_tokenizer_dir: Path) -> StructuredOutputs:
    return StructuredOutputs(smollm2_tokenizer_dir, VOCAB, (EOS,))


@pytest.fixture(scope="module")
def tokenizer(smollm2_tokenizer_dir: Path) -> object:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_tokenizer_dir))


def _tag(parser: str, parallel: bool = True) -> StructuredOutput:
    return StructuredOutput(kind="structural_tag",
                            spec=json.dumps(auto_tool_structural_tag(parser, TOOLS, parallel)))


def _allowed(state: GrammarState) -> torch.Tensor:
    bitmask = torch.zeros(1, (VOCAB + 31) // 32, dtype=torch.int32)
    state.matcher.fill_next_token_bitmask(bitmask, 0)
    bits = torch.arange(32, dtype=torch.int32)
    return ((bitmask[0].unsqueeze(1) >> bits) & 1).flatten()[:VOCAB].bool()


def _ids(tokenizer: object, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))  # type: ignore[attr-defined]


def test_structural_tag_kind_compiles_and_a_bad_one_is_refused(outputs: StructuredOutputs) -> None:
    for parser in ("hermes", "llama3_json", "mistral"):
        outputs.compile(_tag(parser))
    with pytest.raises(GrammarRejected, match="structural_tag does not compile"):
        outputs.compile(StructuredOutput(kind="structural_tag", spec='{"type": "structural_tag", "format": '
                                                                     '{"type": "no_such_format"}}'))


def test_hermes_tag_masks_only_inside_a_call(outputs: StructuredOutputs, tokenizer: object) -> None:
    """Free text allows any token (eos too); after ``<tool_call>`` only the forced start of a call; in
    the arguments only what the schema allows (a string for ``city``: no digit, no eos)."""
    state = outputs.state(_tag("hermes"))
    digit, quote = _ids(tokenizer, "7"), _ids(tokenizer, '"')
    assert len(digit) == 1 and len(quote) == 1
    state.sync(_ids(tokenizer, "Let me check."))
    free = _allowed(state)
    assert free[digit[0]] and free[quote[0]] and free[EOS]
    prefix = _ids(tokenizer, 'Let me check. <tool_call>')
    state = outputs.state(_tag("hermes"))
    state.sync(prefix)
    start = _allowed(state)
    assert not start[digit[0]] and not start[EOS] and not start[quote[0]]  # "\n{" comes next
    state.sync(prefix + _ids(tokenizer, '\n{"name": "weather", "arguments": {"city": '))
    value = _allowed(state)
    assert value[quote[0]] and not value[digit[0]] and not value[EOS]
    with pytest.raises(Exception, match="not allowed"):
        state.sync(prefix + _ids(tokenizer, '\n{"name": "weather", "arguments": {"city": 7'))


# what a walk is given before its random part: a start that leads into a call, or plain text
STARTS = {"hermes": ["Let me check. <tool_call>", "Sure"], "llama3_json": ["{", "<|python_tag|>", "The"],
          "mistral": ["[TOOL_CALLS]", "[", "I will [TOOL_CALLS]", "Hi"]}
CLOSERS = ('"', "}", "]", ",", ";", "1", " ", "\n")  # tokens a walk prefers, so that it ends


_CLOSER_IDS: dict[int, frozenset[int]] = {}


def _closer_ids(tokenizer: object) -> frozenset[int]:
    """The ids of the vocabulary whose token is one of ``CLOSERS`` (its byte-level spelling read back),
    looked up once per tokenizer rather than per allowed token of every step of a walk."""
    if id(tokenizer) not in _CLOSER_IDS:
        tokens = tokenizer.convert_ids_to_tokens(list(range(VOCAB)))  # type: ignore[attr-defined]
        _CLOSER_IDS[id(tokenizer)] = frozenset(
            t for t, tok in enumerate(tokens) if tok is not None
            and tok.replace("Ġ", " ").replace("Ċ", "\n") in CLOSERS)
    return _CLOSER_IDS[id(tokenizer)]


def _walk(state: GrammarState, tokenizer: object, start: list[int], rng: random.Random,
          steps: int = 160) -> list[int] | None:
    """``start`` then random allowed tokens (short ones that close values preferred, eos at times) until
    the grammar terminates: the output ids, or None when it did not end within ``steps``."""
    out = list(start)
    state.sync(out)
    closers = _closer_ids(tokenizer)
    for _ in range(steps):
        allowed = _allowed(state).nonzero().flatten().tolist()
        assert allowed, "the grammar allows no token"
        if EOS in allowed and rng.random() < 0.5:
            token = EOS
        else:
            short = [t for t in allowed if t != EOS and t in closers]
            pool = short if short and rng.random() < 0.7 else [t for t in allowed if t != EOS] or allowed
            token = rng.choice(pool)
        out.append(token)
        state.sync(out)
        if state.is_terminated():
            return out[:-1]
    return None


@pytest.mark.parametrize("parser", ["hermes", "llama3_json", "mistral"])
@pytest.mark.parametrize("parallel", [True, False])
def test_random_walks_parse_back_to_calls_that_satisfy_the_schemas(
        outputs: StructuredOutputs, tokenizer: object, parser: str, parallel: bool) -> None:
    rng = random.Random(f"{parser}-{parallel}")
    spec = _tag(parser, parallel)
    ended = calls = 0
    for k in range(24):
        start_text = STARTS[parser][k % len(STARTS[parser])]
        ids = _walk(outputs.state(spec), tokenizer, _ids(tokenizer, start_text), rng)
        if ids is None:
            continue
        ended += 1
        text = tokenizer.decode(ids, skip_special_tokens=True)  # type: ignore[attr-defined]
        out = parse_whole(ChatOutputSpec(None, parser, parallel), text)
        for call in out.calls:
            arguments = json.loads(call.arguments)
            assert isinstance(arguments, dict), text
            jsonschema.validate(arguments, SCHEMAS[call.name])  # KeyError: a name no tool has
        if start_text.endswith(("<tool_call>", "[TOOL_CALLS]", "{", "<|python_tag|>")):
            assert out.calls, f"the forced call was not read back as one: {text!r}"
        calls += len(out.calls)
    assert ended >= 12 and calls >= 3


def _accepts(tag: dict[str, object], text: str) -> bool:
    """Whether the structural tag's grammar accepts the whole of ``text`` (string level, no tokenizer)."""
    import xgrammar
    from xgrammar.testing import _is_grammar_accept_string

    return bool(_is_grammar_accept_string(xgrammar.Grammar.from_structural_tag(json.dumps(tag)), text))


def test_whitespace_class_is_every_character_python_strips() -> None:
    from gateway import tool_grammar

    assert "".join(c for c in map(chr, range(0x110000)) if c.isspace()) == tool_grammar._PY_WHITESPACE


@pytest.mark.parametrize(("parser", "parallel", "text", "accepted"), [
    # hermes: one block when parallel calls are off, several when on; prose around blocks is free
    ("hermes", False, 'A <tool_call>\n{"name": "clock", "arguments": {}}\n</tool_call>', True),
    ("hermes", False, '<tool_call>\n{"name": "clock", "arguments": {}}\n</tool_call>'
                      '<tool_call>\n{"name": "clock", "arguments": {}}\n</tool_call>', False),
    ("hermes", True, '<tool_call>\n{"name": "clock", "arguments": {}}\n</tool_call> and '
                     '<tool_call>\n{"name": "clock", "arguments": {}}\n</tool_call>', True),
    ("hermes", True, '<tool_call>\n{"name": "weather", "arguments": {"city": 7}}\n</tool_call>', False),
    ("hermes", True, "Use <tool_callX> tags, or <b>bold</b>.", True),
    # llama3_json: prose (also starting with "<" or containing braces) is free; calls are held to schemas
    ("llama3_json", True, "<b>bold</b> text", True),
    ("llama3_json", True, "Hello {x} and {y}", True),
    ("llama3_json", True, '{"name": "weather", "parameters": {"city": "Oslo"}}', True),
    ("llama3_json", True, '{"name": "weather", "parameters": {"city": 7}}', False),
    ("llama3_json", True, '{"name": "nope", "parameters": {}}', False),
    ("llama3_json", True, '{"name": "clock", "parameters": {}} trailing text', False),
    # mistral: a bare array at the start is a held call; prose with brackets later is free
    ("mistral", True, '[{"name": "weather", "arguments": {"city": 7}}]', False),
    ("mistral", True, '[{"name": "nope", "arguments": {}}]', False),
    ("mistral", True, '[{"name": "weather", "arguments": {"city": "Oslo"}}]', True),
    ("mistral", True, 'Sure. [TOOL_CALLS][{"name": "clock", "arguments": {}}]', True),
    ("mistral", True, 'Sure. [TOOL_CALLS][{"name": "clock", "arguments": {}}] more [TOOL_CALLS]'
                      '[{"name": "clock", "arguments": {}}]', False),
    ("mistral", True, "The list [1, 2] is short.", True),
    ("mistral", True, "[TOP secret] notes", True),
    ("mistral", True, "[1, 2] starts this answer", True),
])
def test_tag_accepts_prose_and_held_calls_only(parser: str, parallel: bool, text: str,
                                               accepted: bool) -> None:
    """Fixed strings through each format's grammar: the guards that keep an unconstrained or second call
    out, and ordinary prose let through (the random walks above cannot see a call-looking text that a
    guard wrongly lets into content)."""
    assert _accepts(auto_tool_structural_tag(parser, TOOLS, parallel), text) is accepted


def test_arguments_of_a_schema_without_type_or_with_a_root_combinator_stay_objects() -> None:
    """A strict tool whose ``parameters`` is ``{}``: the grammar engine reads a schema without ``type`` as
    any JSON value, so a string for the arguments got through, which no parser reads as a call; the
    gateway now makes the object type explicit, and refuses root combinators (``anyOf`` let a string
    through even beside ``type: object``)."""
    from gateway.errors import APIError
    from gateway.openai_requests import FunctionTool
    from gateway.tool_request import strict_tool_tag

    def tool(parameters: dict[str, object]) -> FunctionTool:
        return FunctionTool.model_validate({"type": "function", "function": {
            "name": "f", "strict": True, "parameters": parameters}})

    made = strict_tool_tag([tool({})], "hermes", None, True)
    assert made is not None
    tag = made[0]
    assert not _accepts(tag, 'Sure. <tool_call>\n{"name": "f", "arguments": "oops"}\n</tool_call>')
    assert not _accepts(tag, '<tool_call>\n{"name": "f", "arguments": 5}\n</tool_call>')
    assert _accepts(tag, 'Sure. <tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>')
    mixed = {"type": "object", "anyOf": [{"type": "string"}, {"type": "object"}]}
    with pytest.raises(APIError) as info:
        strict_tool_tag([tool(mixed)], "hermes", None, True)
    assert info.value.param == "tools.0.function.parameters" and "anyOf" in info.value.message


def _forced_accepts(schema: dict[str, object], text: str) -> bool:
    """Whether the grammar of a forced choice's schema, compiled from the spec the workers get with the
    engine's options, accepts the whole of ``text``."""
    import xgrammar
    from xgrammar.testing import _is_grammar_accept_string

    from gateway.tool_request import tool_structured_output

    spec = tool_structured_output(schema).spec
    grammar = xgrammar.Grammar.from_json_schema(spec, any_whitespace=False, strict_mode=True)
    return bool(_is_grammar_accept_string(grammar, text))


def _function_tool(name: str, parameters: dict[str, object], strict: bool = False) -> object:
    from gateway.openai_requests import FunctionTool

    return FunctionTool.model_validate({"type": "function", "function": {
        "name": name, "strict": strict, "parameters": parameters}})


def _person_parameters() -> dict[str, object]:
    """What pydantic writes for a model with nested models: ``$defs`` at the root, ``#/$defs/..`` refs."""
    import pydantic

    class Address(pydantic.BaseModel):
        city: str
        zip: int

    class Person(pydantic.BaseModel):
        name: str
        home: Address
        previous: list[Address] = []

    schema = Person.model_json_schema()
    assert schema["properties"]["home"] == {"$ref": "#/$defs/Address"} and "Address" in schema["$defs"]
    return schema


def _draft7_person() -> dict[str, object]:
    """The same with draft-07's ``definitions``."""
    address = {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "integer"}},
               "required": ["city", "zip"]}
    return {"$schema": "http://json-schema.org/draft-07/schema#", "type": "object",
            "properties": {"name": {"type": "string"}, "home": {"$ref": "#/definitions/Address"},
                           "previous": {"type": "array", "items": {"$ref": "#/definitions/Address"}}},
            "required": ["name", "home"], "definitions": {"Address": address}}


def _call(name: str, arguments: str) -> str:
    return f'[{{"name": "{name}", "arguments": {arguments}}}]'


PERSON_OK = '{"name": "Ann", "home": {"city": "Oslo", "zip": 150}, "previous": [{"city": "Rome", "zip": 1}]}'
PERSON_BAD = ['{"name": "Ann", "home": {"city": "Oslo", "zip": "150"}}',  # zip: an integer
              '{"name": "Ann", "home": {"zip": 150}}',  # city required
              '{"name": "Ann", "home": {"city": "Oslo", "zip": 1}, "previous": [7]}']


@pytest.mark.parametrize("parameters", [_person_parameters(), _draft7_person()], ids=["$defs", "definitions"])
@pytest.mark.parametrize("choice", ["required", "person"])
def test_forced_choice_keeps_a_tool_s_defs_refs(outputs: StructuredOutputs, parameters: dict[str, object],
                                                choice: str) -> None:
    """A forced choice nests each chosen tool's parameters in an array of calls: a ``#/$defs/..`` (or
    ``#/definitions/..``) ref of the tool's schema pointed at the outer schema's root, where there is no
    such entry, and the workers' grammar did not compile. Now the nested schema means what the tool's
    did: its calls are held to the referenced definitions."""
    from gateway.openai_requests import NamedToolChoice
    from gateway.tool_request import forced_tool_schema, tool_structured_output

    tools = [_function_tool("clock", {"type": "object"}), _function_tool("person", parameters)]
    named = choice if choice == "required" else NamedToolChoice.model_validate(
        {"type": "function", "function": {"name": choice}})
    schema = forced_tool_schema(tools, named, True)  # type: ignore[arg-type]
    outputs.compile(tool_structured_output(schema))  # the engine's own compile, with the tokenizer
    assert _forced_accepts(schema, _call("person", PERSON_OK))
    for bad in PERSON_BAD:
        assert not _forced_accepts(schema, _call("person", bad)), bad
    assert _forced_accepts(schema, _call("clock", "{}")) is (choice == "required")


def test_forced_choice_keeps_same_named_defs_of_two_tools_apart() -> None:
    """Two tools that both define ``$defs/Item``, differently: each tool's arguments are held to its own
    ``Item``."""
    from gateway.tool_request import forced_tool_schema

    def parameters(item: dict[str, object]) -> dict[str, object]:
        return {"type": "object", "properties": {"item": {"$ref": "#/$defs/Item"}}, "required": ["item"],
                "additionalProperties": False, "$defs": {"Item": item}}

    count = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
             "additionalProperties": False}
    label = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"],
             "additionalProperties": False}
    tools = [_function_tool("count", parameters(count)), _function_tool("label", parameters(label))]
    schema = forced_tool_schema(tools, "required", True)  # type: ignore[arg-type]
    assert _forced_accepts(schema, _call("count", '{"item": {"n": 3}}'))
    assert _forced_accepts(schema, _call("label", '{"item": {"text": "x"}}'))
    assert not _forced_accepts(schema, _call("count", '{"item": {"text": "x"}}'))
    assert not _forced_accepts(schema, _call("label", '{"item": {"n": 3}}'))


TREE_ROOT_REF = {"type": "object", "properties": {"value": {"type": "integer"},
                                                  "children": {"type": "array", "items": {"$ref": "#"}}},
                 "required": ["value"], "additionalProperties": False}
TREE_DEFS_REF = {"type": "object", "properties": {"root": {"$ref": "#/$defs/Node"}}, "required": ["root"],
                 "additionalProperties": False,
                 "$defs": {"Node": {"type": "object", "required": ["value"], "additionalProperties": False,
                                    "properties": {"value": {"type": "integer"},
                                                   "children": {"type": "array",
                                                                "items": {"$ref": "#/$defs/Node"}}}}}}
# another JSON pointer into the tool's own schema (not under $defs)
SAME_AS_PROPERTY = {"type": "object", "additionalProperties": False,
                    "properties": {"a": {"type": "integer", "minimum": 0},
                                   "b": {"$ref": "#/properties/a"}, "c": {"$ref": "#/$defs/on~1off"}},
                    "$defs": {"on/off": {"type": "boolean"}}}
# refs into a place no keyword names (OpenAPI's components): the target's own refs move with it too
COMPONENTS = {"type": "object", "additionalProperties": False,
              "properties": {"a": {"$ref": "#/components/A"}},
              "components": {"A": {"type": "object", "additionalProperties": False, "required": ["b"],
                                   "properties": {"b": {"$ref": "#/components/B"},
                                                  "next": {"$ref": "#/components/A"}}},
                             "B": {"type": "integer", "minimum": 0}}}


@pytest.mark.parametrize(("parameters", "good", "bad"), [
    (TREE_ROOT_REF, ['{"value": 1, "children": [{"value": 2, "children": [{"value": 3}]}]}'],
     ['{"value": 1, "children": [{"value": "2"}]}', '{"value": 1, "children": [{"name": "leaf", '
      '"arguments": {}}]}', '{"value": 1, "children": [[{"name": "leaf", "arguments": {}}]]}']),
    (TREE_DEFS_REF, ['{"root": {"value": 1, "children": [{"value": 2, "children": []}]}}'],
     ['{"root": {"value": 1, "children": [{"value": 2, "extra": 1}]}}', '{"root": {"value": "1"}}']),
    (SAME_AS_PROPERTY, ['{"a": 1, "b": 2, "c": true}'],
     ['{"a": 1, "b": "2"}', '{"a": 1, "b": -1}', '{"a": 1, "c": 1}']),
    (COMPONENTS, ['{"a": {"b": 1, "next": {"b": 2}}}'],
     ['{"a": {"b": -1}}', '{"a": {"b": 1, "next": {"b": "x"}}}', '{"a": {"next": {"b": 1}}}']),
], ids=["root-ref", "defs-recursion", "pointer", "components"])
@pytest.mark.parametrize("position", [0, 1])
def test_forced_choice_keeps_recursive_and_pointer_refs(parameters: dict[str, object], good: list[str],
                                                        bad: list[str], position: int) -> None:
    """``#`` (the tool's own parameters, recursively), a recursive ``$defs`` entry, and another pointer
    into the tool's schema mean the same nested in the forced schema (``#`` read as the outer array of
    calls before, so a tree's children had to be call arrays); the tool's place among the tools is part
    of the nested location."""
    from gateway.tool_request import forced_tool_schema

    tools = [_function_tool("leaf", {"type": "object", "additionalProperties": False})]
    tools.insert(position, _function_tool("tree", parameters))
    for choice in ("required", "tree"):
        from gateway.openai_requests import NamedToolChoice

        named = choice if choice == "required" else NamedToolChoice.model_validate(
            {"type": "function", "function": {"name": choice}})
        schema = forced_tool_schema(tools, named, True)  # type: ignore[arg-type]
        for text in good:
            assert _forced_accepts(schema, _call("tree", text)), (choice, text)
        for text in bad:
            assert not _forced_accepts(schema, _call("tree", text)), (choice, text)


@pytest.mark.parametrize("parser", ["hermes", "llama3_json", "mistral"])
def test_strict_auto_tag_resolves_refs_in_each_tool_s_own_schema(parser: str) -> None:
    """Under ``auto`` each strict tool's parameters are a json_schema section of their own, so ``$defs``
    refs, ``#`` and same-named definitions of two tools resolve within the tool's schema as given."""
    from gateway.tool_request import strict_tool_tag

    tools = [_function_tool("person", _person_parameters(), strict=True),
             _function_tool("tree", TREE_ROOT_REF, strict=True),
             _function_tool("nodes", TREE_DEFS_REF, strict=True)]
    made = strict_tool_tag(tools, parser, None, True)  # type: ignore[arg-type]
    assert made is not None
    formats = {"hermes": '<tool_call>\n{{"name": "{}", "arguments": {}}}\n</tool_call>',
               "llama3_json": '{{"name": "{}", "parameters": {}}}',
               "mistral": '[TOOL_CALLS][{{"name": "{}", "arguments": {}}}]'}

    def call(name: str, arguments: str) -> str:
        return formats[parser].format(name, arguments)

    assert _accepts(made[0], call("person", PERSON_OK))
    for bad in PERSON_BAD:
        assert not _accepts(made[0], call("person", bad)), bad
    assert _accepts(made[0], call("tree", '{"value": 1, "children": [{"value": 2}]}'))
    assert not _accepts(made[0], call("tree", '{"value": 1, "children": [{"value": "2"}]}'))
    assert _accepts(made[0], call("nodes", '{"root": {"value": 1, "children": [{"value": 2}]}}'))
    assert not _accepts(made[0], call("nodes", '{"root": {"value": 1, "children": [{"v": 2}]}}'))
