"""Structured-output fields of a request → the workers' ``StructuredOutput``, validated at the edge.

Two ways to ask (OpenAI's and vLLM's), at most one per request:

- ``response_format`` (OpenAI): ``{"type": "text"}`` (nothing), ``{"type": "json_object"}`` (any JSON
  object) or ``{"type": "json_schema", "json_schema": {"name", "description", "schema", "strict"}}``;
- ``structured_outputs`` (vLLM's extension): exactly one of ``json`` (a schema, as an object or a JSON
  string), ``json_object: true``, ``regex``, ``choice`` (a list of strings) or ``grammar`` (EBNF,
  xgrammar's dialect, start rule ``root``).

The grammar engine (xgrammar) needs torch, which the gateway never imports, so the gateway checks what it
can without it: a schema must pass its JSON Schema meta-schema (``jsonschema``), every ``pattern``
keyword of its schemas (not a ``pattern`` in data such as ``examples`` or ``const``) and every ``regex``
must compile with Python's ``re`` and use no lookaround, backreference or inline flag such as ``(?i)``
(xgrammar refuses those or does not enforce them), every ``$ref`` must point into the schema itself
(xgrammar reads anchors and other documents as any value), a choice list must hold non-empty strings, and a
grammar must parse as EBNF (``check_ebnf``: balanced brackets, closed strings and classes, every rule it
uses defined, a ``root`` rule). A spec that passes all this and still does not compile fails on the
worker (the request then fails like any request a worker refuses).
"""

from __future__ import annotations

import copy
import json
import re
import urllib.parse
from collections.abc import Iterator
from typing import Any

import jsonschema

from engine.sampling_params import StructuredOutput
from gateway.errors import bad_request
from gateway.openai_requests import ResponseFormat, StructuredOutputsParams

_LOOKAROUND = re.compile(r"\(\?(?:=|!|<=|<!)")
_BACKREF = re.compile(r"\\[1-9]|\(\?P=")
_INLINE_FLAGS = re.compile(r"\(\?[aiLmsux-]+[:)]")


def structured_output_of(response_format: ResponseFormat | None,
                         structured_outputs: StructuredOutputsParams | None) -> StructuredOutput | None:
    """The request's ``StructuredOutput`` (None when it asks for none).

    Raises:
        APIError: 400 naming the field (e.g. ``response_format.json_schema.schema``,
            ``structured_outputs.regex``) for a bad or missing spec, or when both fields ask for one.
    """
    if response_format is not None and response_format.type != "text" and structured_outputs is not None:
        raise bad_request("response_format and structured_outputs cannot both be set", "structured_outputs")
    if structured_outputs is not None:
        return _from_structured_outputs(structured_outputs)
    if response_format is None or response_format.type == "text":
        if response_format is not None and response_format.json_schema is not None:
            raise bad_request("response_format.json_schema needs type json_schema", "response_format.type")
        return None
    if response_format.type == "json_object":
        if response_format.json_schema is not None:
            raise bad_request("response_format.json_schema needs type json_schema", "response_format.type")
        return StructuredOutput(kind="json_object")
    if response_format.json_schema is None:
        raise bad_request("response_format of type json_schema needs json_schema",
                          "response_format.json_schema")
    schema = response_format.json_schema.json_schema
    return StructuredOutput(kind="json", spec=check_json_schema(schema, "response_format.json_schema.schema"))


def _from_structured_outputs(so: StructuredOutputsParams) -> StructuredOutput:
    values = (("json", so.json_), ("json_object", so.json_object), ("regex", so.regex),
              ("choice", so.choice), ("grammar", so.grammar))
    given = [name for name, value in values if value is not None]
    if len(given) != 1:
        raise bad_request(f"structured_outputs needs exactly one of json, json_object, regex, choice, "
                          f"grammar; got {given or 'none'}", "structured_outputs")
    field = f"structured_outputs.{given[0]}"
    if so.json_ is not None:
        schema: Any = so.json_
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as exc:
                raise bad_request(f"{field} is not valid JSON: {exc}", field) from exc
        return StructuredOutput(kind="json", spec=check_json_schema(schema, field))
    if so.json_object is not None:
        if not so.json_object:
            raise bad_request(f"{field} must be true when given", field)
        return StructuredOutput(kind="json_object")
    if so.regex is not None:
        check_regex(so.regex, field)
        return StructuredOutput(kind="regex", spec=so.regex)
    if so.choice is not None:
        if not so.choice or not all(so.choice):
            raise bad_request(f"{field} must be a non-empty list of non-empty strings", field)
        return StructuredOutput(kind="choice", spec=json.dumps(so.choice, ensure_ascii=False))
    assert so.grammar is not None
    check_ebnf(so.grammar, field)
    return StructuredOutput(kind="grammar", spec=so.grammar)


def check_json_schema(schema: Any, field: str) -> str:
    """``schema`` as a JSON string once it passes its meta-schema (``$schema``, else draft 2020-12), each
    ``$ref`` is a local one (``is_local_ref``: the grammar engine reads an anchor or another document's
    URI as any value, and has no ``$dynamicRef`` / ``$recursiveRef``) that points to something in it,
    and every ``pattern`` keyword of its schema objects
    (``schema_objects``, local ref targets included) passes ``check_regex``.

    Raises:
        APIError: 400 naming ``field``.
    """
    if not isinstance(schema, dict):
        raise bad_request(f"{field} must be a JSON object (a JSON Schema)", field)
    validator = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        validator.check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.path)
        at = f" (at {where})" if where else ""
        if exc.validator == "format" and exc.validator_value == "regex" and isinstance(exc.instance, str):
            # the metaschema's regex format is checked with Python's re: a pattern it cannot compile may
            # still be valid ECMA-262 (e.g. \p{L}), so say what is refused rather than blame the schema
            check_regex(exc.instance, field, at)
        raise bad_request(f"{field} is not a valid JSON Schema: {exc.message}{at}", field) from exc
    for node in schema_objects(schema):
        ref = node.get("$ref")
        if isinstance(ref, str) and not is_local_ref(ref):
            raise bad_request(f"{field} has a $ref that is not a JSON pointer into the schema itself "
                              f"(only '#' and '#/...' refs are supported): {ref!r}", field)
        if isinstance(ref, str) and _resolve_local_ref(schema, ref) is _MISSING:
            raise bad_request(f"{field} has a $ref that points to nothing in the schema: {ref!r}", field)
        if dynamic := [key for key in ("$dynamicRef", "$recursiveRef") if key in node]:
            raise bad_request(f"{field} uses {dynamic[0]}, which is not supported (use $ref with '#/...')",
                              field)
        if isinstance(node.get("pattern"), str):
            check_regex(node["pattern"], field)
    return json.dumps(schema, ensure_ascii=False)


# keywords whose value is a schema or a list of schemas (drafts 4 to 2020-12; items took a list before
# 2020-12)
_SUBSCHEMA_KEYWORDS = frozenset((
    "additionalProperties", "additionalItems", "items", "prefixItems", "contains", "not", "if", "then",
    "else", "propertyNames", "unevaluatedItems", "unevaluatedProperties", "contentSchema", "allOf",
    "anyOf", "oneOf"))
# keywords whose value maps names to schemas (draft 7's dependencies: to a schema or a list of names)
_SUBSCHEMA_MAP_KEYWORDS = frozenset((
    "properties", "patternProperties", "$defs", "definitions", "dependentSchemas", "dependencies"))


def schema_objects(schema: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """``schema`` and every schema object under it, each once, reached only through the keywords whose
    values are subschemas (``properties``, ``items``, ``$defs``, ``anyOf``, ...) and through local
    refs (``is_local_ref``, resolved from ``schema`` by ``_resolve_local_ref``: a ref may point
    anywhere in the document, e.g. ``#/components/A``, and its target is a schema wherever it lies).
    Values such as ``examples``, ``default``, ``const`` and ``enum`` are data, and the keys of
    ``properties`` are names, so a ``pattern`` or ``$ref`` there is no keyword. Boolean schemas and refs
    that resolve to nothing are skipped."""
    seen: set[int] = set()
    stack = [schema]
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        yield node
        ref = node.get("$ref")
        if isinstance(ref, str) and is_local_ref(ref):
            target = _resolve_local_ref(schema, ref)
            if isinstance(target, dict):
                stack.append(target)
        for key, value in node.items():
            if key in _SUBSCHEMA_MAP_KEYWORDS:
                children = list(value.values()) if isinstance(value, dict) else []
            elif key in _SUBSCHEMA_KEYWORDS:
                children = value if isinstance(value, list) else [value]
            else:
                continue
            stack.extend(child for child in reversed(children) if isinstance(child, dict))


def is_local_ref(ref: str) -> bool:
    """True for a ``$ref`` that is a JSON pointer into the same document (``#`` or ``#/...``), the only
    refs the grammar engine resolves (an anchor such as ``#name`` or another document's URI it reads as
    any value)."""
    return ref == "#" or ref.startswith("#/")


_MISSING = object()


def _resolve_local_ref(schema: dict[str, Any], ref: str) -> Any:
    """The value local ``ref`` (``#`` or ``#/a/b~1c/0``: a URI fragment holding a JSON pointer, RFC 6901,
    percent-decoded) points to in ``schema``, or ``_MISSING`` where it points to nothing."""
    node: Any = schema
    for token in urllib.parse.unquote(ref[2:]).split("/") if ref != "#" else []:
        token = token.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and token in node:
            node = node[token]
        elif isinstance(node, list) and token.isdigit() and int(token) < len(node):
            node = node[int(token)]
        else:
            return _MISSING
    return node


def relocated_schema(schema: dict[str, Any], pointer: str) -> dict[str, Any]:
    """A copy of ``schema`` that means what ``schema`` means on its own once placed at ``pointer`` (a
    local ref such as ``#/items/properties/arguments``) inside another document: each local ``$ref``
    of its schema objects is resolved from the document's root, so ``pointer`` is put in front of it
    (``#`` becomes ``pointer``, ``#/$defs/A`` becomes ``pointer + "/$defs/A"``), which keeps recursion
    and keeps the ``$defs`` of two schemas placed side by side apart; the schema objects reached
    through a ref (``#/components/A``) are relocated too. Other refs are kept as they are. ``schema``
    itself is not changed."""
    copied = copy.deepcopy(schema)
    for node in list(schema_objects(copied)):
        ref = node.get("$ref")
        if isinstance(ref, str) and is_local_ref(ref):
            node["$ref"] = pointer + ref[1:]
    return copied


def check_regex(pattern: str, field: str, at: str = "") -> None:
    """Raises ``APIError`` (400 naming ``field``; ``at``: where in it, for the message) when ``pattern``
    does not compile with Python's ``re`` or uses lookaround, a backreference or an inline flag group
    (the grammar engine has none of them)."""
    try:
        re.compile(pattern)
    except re.error as exc:
        raise bad_request(f"{field}{at}: the regular expression {pattern!r} is not one pdserve takes ({exc}; "
                          "it takes Python's re syntax, without lookaround, backreferences or inline flags)",
                          field) from exc
    if _LOOKAROUND.search(pattern) or _BACKREF.search(pattern) or _INLINE_FLAGS.search(pattern):
        raise bad_request(f"{field}: lookaround, backreferences and inline flags are not supported in "
                          f"regular expressions", field)


_RULE_START = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_\-.]*)\s*::=", re.MULTILINE)
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_\-.]*")


def check_ebnf(grammar: str, field: str) -> None:
    """A syntax check of an EBNF grammar in xgrammar's dialect (rules ``name ::= body``; strings in
    double quotes, character classes in brackets, groups in parentheses, ``| * + ?`` and ``{m,n}``,
    ``#`` comments): brackets balanced, strings and classes closed, no empty rule, each rule defined once,
    every rule referenced defined, a ``root`` rule.

    Raises:
        APIError: 400 naming ``field`` and the first problem found.
    """
    try:
        _parse_ebnf(grammar)
    except ValueError as exc:
        raise bad_request(f"{field} is not a valid EBNF grammar: {exc}", field) from exc


def _parse_ebnf(grammar: str) -> None:
    starts = list(_RULE_START.finditer(grammar))
    if not starts:
        raise ValueError("no rule (name ::= ...) found")
    if grammar[: starts[0].start()].strip() and not _only_comments(grammar[: starts[0].start()]):
        raise ValueError("text before the first rule")
    defined: set[str] = set()
    used: set[str] = set()
    for k, m in enumerate(starts):
        name = m.group(1)
        if name in defined:
            raise ValueError(f"rule {name!r} is defined twice")
        defined.add(name)
        end = starts[k + 1].start() if k + 1 < len(starts) else len(grammar)
        body = grammar[m.end():end]
        refs = _scan_body(body, name)
        used.update(refs)
    if "root" not in defined:
        raise ValueError("no root rule (root ::= ...)")
    missing = sorted(used - defined)
    if missing:
        raise ValueError(f"rule {missing[0]!r} is used but not defined")


def _only_comments(text: str) -> bool:
    return all(not line.strip() or line.strip().startswith("#") for line in text.splitlines())


def _scan_body(body: str, rule: str) -> set[str]:
    """Rule names a body references; raises ``ValueError`` for unclosed strings/classes/groups or an
    empty body."""
    refs: set[str] = set()
    depth, i, items = 0, 0, 0
    while i < len(body):
        c = body[i]
        if c == "#":
            nl = body.find("\n", i)
            i = len(body) if nl < 0 else nl + 1
            continue
        if c in "\"[":
            close = '"' if c == '"' else "]"
            j = i + 1
            while j < len(body) and body[j] != close:
                if body[j] == "\n":
                    break
                j += 2 if body[j] == "\\" else 1
            if j >= len(body) or body[j] != close:
                what = "string" if c == '"' else "character class"
                raise ValueError(f"unclosed {what} in rule {rule!r}")
            i, items = j + 1, items + 1
            continue
        if c == "(":
            depth += 1
        elif c == ")":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced ')' in rule {rule!r}")
        elif c == "{":
            j = body.find("}", i)
            if j < 0 or not re.fullmatch(r"\{\s*\d*\s*(,\s*\d*\s*)?\}", body[i:j + 1]):
                raise ValueError(f"bad repetition {{m,n}} in rule {rule!r}")
            i = j + 1
            continue
        elif (m := _IDENT.match(body, i)) is not None:
            refs.add(m.group(0))
            i, items = m.end(), items + 1
            continue
        elif not (c.isspace() or c in "|*+?="):
            raise ValueError(f"unexpected {c!r} in rule {rule!r}")
        i += 1
    if depth != 0:
        raise ValueError(f"unbalanced '(' in rule {rule!r}")
    if items == 0:
        raise ValueError(f"rule {rule!r} is empty")
    return refs


__all__ = ["check_ebnf", "check_json_schema", "check_regex", "is_local_ref", "relocated_schema",
           "schema_objects", "structured_output_of"]
