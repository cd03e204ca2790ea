"""The gateway's torch-free checks of structured-output specs (gateway/structured_output.py): valid
grammars, regexes and schemas pass untouched, bad ones are 400s naming the field."""

from __future__ import annotations

import json

import pytest

from gateway.errors import APIError
from gateway.openai_requests import ResponseFormat, StructuredOutputsParams
from gateway.structured_output import check_ebnf, check_regex, structured_output_of

GOOD_GRAMMARS = [
    'root ::= "yes" | "no"',
    '# a comment line\nroot ::= item ("," item)*\nitem ::= [a-z]+ | "\\"q\\""  # trailing comment',
    'root ::= "{" ws pair ws "}"\npair ::= string ":" ws [0-9]{1,3}\nstring ::= "\\"" [^"\\\\]* "\\""\n'
    'ws ::= [ \\t\\n]*',
    'root ::= (("a" | "b")+ "c"?){2,}',
    'root ::= rule-with-dash\nrule-with-dash ::= "x"',
]
BAD_GRAMMARS = [
    ("", "no rule"),
    ("root ::= ", "empty"),
    ('root ::= "a" other', "'other' is used but not defined"),
    ('root ::= ("a"', "unbalanced '('"),
    ('root ::= "a")', "unbalanced ')'"),
    ('root ::= [a-z', "unclosed character class"),
    ('root ::= "a"\nroot ::= "b"', "defined twice"),
    ('start ::= "a"', "no root rule"),
    ('root ::= "a"{x}', "bad repetition"),
    ('root ::= "a" ; "b"', "unexpected ';'"),
]


@pytest.mark.parametrize("grammar", GOOD_GRAMMARS)
def test_valid_grammars_pass(grammar: str) -> None:
    check_ebnf(grammar, "structured_outputs.grammar")


@pytest.mark.parametrize(("grammar", "why"), BAD_GRAMMARS)
def test_bad_grammars_are_400s(grammar: str, why: str) -> None:
    with pytest.raises(APIError) as info:
        check_ebnf(grammar, "structured_outputs.grammar")
    assert info.value.status == 400 and info.value.param == "structured_outputs.grammar"
    assert why in info.value.message


@pytest.mark.parametrize("pattern", ["[a-z]+@[a-z]+\\.com", "(?:ab)+c?", "\\d{3}-\\d{4}", "^a|b$"])
def test_valid_regexes_pass(pattern: str) -> None:
    check_regex(pattern, "structured_outputs.regex")


@pytest.mark.parametrize("pattern", ["(a", "a{3,1}", "(?=a)b", "(?<!a)b", "(a)\\1", "(?P<x>a)(?P=x)",
                                     "(?i)abc"])
def test_bad_regexes_are_400s(pattern: str) -> None:
    with pytest.raises(APIError) as info:
        check_regex(pattern, "structured_outputs.regex")
    assert info.value.status == 400 and info.value.param == "structured_outputs.regex"


def test_mapping_of_each_form() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "string", "pattern": "^[a-z]+$"}}}
    rf = ResponseFormat.model_validate({"type": "json_schema",
                                        "json_schema": {"name": "n", "schema": schema}})
    so = structured_output_of(rf, None)
    assert so is not None and so.kind == "json" and json.loads(so.spec) == schema
    assert structured_output_of(ResponseFormat.model_validate({"type": "text"}), None) is None
    assert structured_output_of(None, None) is None
    choice = structured_output_of(None, StructuredOutputsParams.model_validate({"choice": ["é", 'a"b']}))
    assert choice is not None and json.loads(choice.spec) == ["é", 'a"b']
    params = StructuredOutputsParams.model_validate({"json": json.dumps(schema)})
    as_string = structured_output_of(None, params)
    assert as_string is not None and json.loads(as_string.spec) == schema


LOOKAHEAD = "(?=x)x"


@pytest.mark.parametrize("schema", [
    {"type": "object", "examples": [{"pattern": LOOKAHEAD}]},
    {"type": "object", "default": {"pattern": LOOKAHEAD}},
    {"type": "object", "properties": {"a": {"const": {"pattern": LOOKAHEAD}}}},
    {"type": "object", "properties": {"a": {"enum": [{"pattern": LOOKAHEAD}, 1]}}},
    {"type": "object", "properties": {"pattern": {"type": "string", "examples": [LOOKAHEAD]}}},
    {"type": "object", "$defs": {"D": {"type": "object", "examples": [{"items": {"pattern": LOOKAHEAD}}]}}},
    {"type": "object", "x-vendor": {"pattern": LOOKAHEAD}},
], ids=["examples", "default", "const", "enum", "property-named-pattern", "examples-under-defs", "vendor"])
def test_a_pattern_in_data_is_not_checked(schema: dict[str, object]) -> None:
    """``pattern`` is read only as a keyword of a schema: a lookahead in an ``examples``, ``default``,
    ``const`` or ``enum`` value (data, which the grammar engine does not compile) was a false 400."""
    rf = ResponseFormat.model_validate({"type": "json_schema",
                                        "json_schema": {"name": "n", "schema": schema}})
    so = structured_output_of(rf, None)
    assert so is not None and json.loads(so.spec) == schema


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"a": {"type": "string", "pattern": LOOKAHEAD}}},
    {"type": "object", "properties": {"pattern": {"type": "string", "pattern": LOOKAHEAD}}},
    {"type": "array", "items": {"type": "string", "pattern": LOOKAHEAD}},
    {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string", "pattern": LOOKAHEAD}]},
    {"type": "object", "properties": {"a": {"$ref": "#/$defs/S"}},
     "$defs": {"S": {"type": "string", "pattern": LOOKAHEAD}}},
    {"$schema": "http://json-schema.org/draft-07/schema#", "type": "object",
     "definitions": {"S": {"type": "string", "pattern": LOOKAHEAD}}},
    {"type": "object", "properties": {"a": {"anyOf": [{"type": "integer"},
                                                      {"type": "string", "pattern": LOOKAHEAD}]}}},
    {"type": "object", "patternProperties": {"^a": {"type": "string", "pattern": LOOKAHEAD}}},
    {"type": "object", "additionalProperties": {"type": "string", "pattern": LOOKAHEAD}},
    {"type": "object", "propertyNames": {"pattern": LOOKAHEAD}},
    {"type": "string", "pattern": LOOKAHEAD},
    {"type": "object", "properties": {"a": {"$ref": "#/components/S"}},
     "components": {"S": {"type": "object", "properties": {"b": {"$ref": "#/components/T"}}},
                    "T": {"type": "string", "pattern": LOOKAHEAD}}},
], ids=["properties", "property-named-pattern", "items", "prefixItems", "$defs", "definitions", "anyOf",
        "patternProperties", "additionalProperties", "propertyNames", "root", "ref-target-anywhere"])
def test_a_lookahead_pattern_of_a_schema_is_a_400(schema: dict[str, object]) -> None:
    with pytest.raises(APIError) as info:
        structured_output_of(None, StructuredOutputsParams.model_validate({"json": schema}))
    assert info.value.status == 400 and info.value.param == "structured_outputs.json"
    assert "lookaround" in info.value.message



@pytest.mark.parametrize("ref", ["#/$defs/Missing", "#/components/A/properties/x", "#/properties/a/0"])
def test_a_local_ref_to_nothing_is_a_400_naming_it(ref: str) -> None:
    """A ``$ref`` pointing nowhere in the schema (a typo'd definition name) was passed on and failed on
    the worker; the gateway now refuses it naming the ref. Refs that resolve (escaped, percent-encoded,
    into an array, to a place no keyword names) pass."""
    schema = {"type": "object", "properties": {"a": {"$ref": ref}}, "components": {"A": {"type": "object"}}}
    with pytest.raises(APIError) as info:
        structured_output_of(None, StructuredOutputsParams.model_validate({"json": schema}))
    assert (info.value.status, info.value.param) == (400, "structured_outputs.json")
    assert "points to nothing" in info.value.message and repr(ref) in info.value.message
    good = {"type": "object", "properties": {"a": {"$ref": "#/$defs/a~1b"}, "b": {"$ref": "#/$defs/c%20d"},
                                             "c": {"$ref": "#/x/0"}, "d": {"$ref": "#/components/A"}},
            "$defs": {"a/b": {"type": "integer"}, "c d": {"type": "string"}}, "x": [{"type": "null"}],
            "components": {"A": {"type": "object"}}}
    assert structured_output_of(None, StructuredOutputsParams.model_validate({"json": good})) is not None


@pytest.mark.parametrize(("node", "named"), [
    ({"$ref": "#node"}, "'#node'"), ({"$ref": "https://example.com/s.json"}, "'https://example.com/s.json'"),
    ({"$ref": "other.json#/$defs/A"}, "'other.json#/$defs/A'"), ({"$dynamicRef": "#node"}, "$dynamicRef"),
])
def test_a_ref_the_grammar_engine_would_read_as_any_value_is_a_400(node: dict[str, str], named: str) -> None:
    """An anchor, another document's URI or a ``$dynamicRef`` was passed on and the grammar engine held
    the value to nothing (any JSON); the gateway now refuses it naming it. A property *named* ``$ref``
    and a ``$ref`` in ``examples`` are not refs."""
    schema = {"type": "object", "properties": {"a": node},
              "$defs": {"A": {"$anchor": "node", "$dynamicAnchor": "node", "type": "string"}}}
    with pytest.raises(APIError) as info:
        structured_output_of(None, StructuredOutputsParams.model_validate({"json": schema}))
    assert (info.value.status, info.value.param) == (400, "structured_outputs.json")
    assert named in info.value.message
    names = {"type": "object", "properties": {"$ref": {"type": "string", "examples": [{"$ref": "#x"}]}}}
    assert structured_output_of(None, StructuredOutputsParams.model_validate({"json": names})) is not None


BAD_SCHEMA_NAMES = ["bad name!", "", "x" * 65, "a.b", "naïve"]


@pytest.mark.parametrize("name", BAD_SCHEMA_NAMES)
def test_json_schema_name_follows_openais_rule(name: str) -> None:
    """``response_format.json_schema.name`` (chat, completions) and ``text.format.name`` (Responses): 1-64
    letters, digits, ``_`` or ``-`` (OpenAI's rule, the one tool names follow), else a 400 with the
    OpenAI error body naming the field the client sent; a good name passes to the next check (503: no
    worker)."""
    import httpx

    from tests.gateway.inprocess import inprocess_gateway

    fmt = {"type": "json_schema", "json_schema": {"name": name, "schema": {"type": "object"}}}
    text_fmt = {"type": "json_schema", "name": name, "schema": {"type": "object"}}
    chat_param = "response_format.json_schema.name"
    with inprocess_gateway("m") as base, httpx.Client(base_url=base, timeout=5) as c:
        for path, body, param in (
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                          "response_format": fmt}, chat_param),
                ("/v1/completions", {"prompt": "hi", "response_format": fmt}, chat_param),
                ("/v1/responses", {"input": "hi", "text": {"format": text_fmt}}, "text.format.name")):
            r = c.post(path, json={"model": "m", **body})
            assert r.status_code == 400, (path, r.text)
            error = r.json()["error"]
            assert (error["param"], error["type"]) == (param, "invalid_request_error"), (path, error)
            assert param in error["message"], error
            good = json.loads(json.dumps(body).replace(json.dumps(name), '"ok_Name-1"'))
            assert c.post(path, json={"model": "m", **good}).status_code == 503, path


@pytest.mark.parametrize(("fmt", "message"), [
    ({"type": "json_schema", "schema": {"type": "object"}}, "type json_schema needs name"),
    ({"type": "json_schema", "name": "n"}, "type json_schema needs schema"),
    ({"type": "json_schema"}, "type json_schema needs name and schema"),
    ({"type": "json_object", "schema": {"type": "object"}}, "schema only go with type json_schema"),
    ({"type": "text", "name": "n", "strict": True}, "name, strict only go with type json_schema"),
])
def test_responses_text_format_keys_are_the_ones_its_type_takes(fmt: dict[str, object], message: str) -> None:
    """``text.format`` of type ``json_schema`` without ``name`` was named "response" and without
    ``schema`` held the output to any JSON; a ``schema`` beside ``json_object`` or ``text`` was
    ignored. Each is now a 400 naming ``text.format`` (OpenAI's Responses API requires ``name`` and
    ``schema``); a complete format passes to the next check (503: no worker)."""
    import httpx

    from tests.gateway.inprocess import inprocess_gateway

    with inprocess_gateway("m") as base, httpx.Client(base_url=base, timeout=5) as c:
        r = c.post("/v1/responses", json={"model": "m", "input": "hi", "text": {"format": fmt}})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert (error["param"], error["type"]) == ("text.format", "invalid_request_error"), error
        assert message in error["message"], error
        good = {"type": "json_schema", "name": "n", "schema": {"type": "object"}}
        r = c.post("/v1/responses", json={"model": "m", "input": "hi", "text": {"format": good}})
        assert r.status_code == 503, r.text


def test_a_pattern_python_cannot_compile_is_refused_as_such_not_as_a_bad_schema() -> None:
    """``\\p{L}`` is valid ECMA-262 (JSON Schema's regex dialect) that Python's ``re`` does not take: the
    400 says the pattern is not one pdserve takes, and where it is, rather than calling the schema
    invalid (the metaschema's regex format is checked with ``re``)."""
    schema = {"type": "object", "properties": {"name": {"type": "string", "pattern": "^\\p{L}+$"}}}
    rf = ResponseFormat.model_validate({"type": "json_schema",
                                        "json_schema": {"name": "n", "schema": schema}})
    with pytest.raises(APIError) as info:
        structured_output_of(rf, None)
    assert info.value.status == 400 and info.value.param == "response_format.json_schema.schema"
    assert "not a valid JSON Schema" not in info.value.message
    assert "(at properties/name/pattern): the regular expression '^\\\\p{L}+$' is not one pdserve takes" in (
        info.value.message), info.value.message
