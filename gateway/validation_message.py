"""A pydantic validation failure → the 400 a client reads: ``param`` is the path of the field in the body
the client sent (``messages.0.content.0.type``), never one of the segments pydantic adds to a location
for the member of a union it tried (``str``, ``list[ContentPart]``, ``literal['none','auto']``, a model's
class name, a tagged union's tag, ``[key]`` of a dict key), and the message lists the errors under that
field (each bad ``logit_bias`` key, at most ``MAX_LISTED``) with their paths the same way. A type error
(strict types: nothing is coerced) says the type expected and the JSON type sent. An item whose
``type`` pdserve does not take (an image part, a built-in tool: ``openai_requests.check_type``) is named
alone, at its ``type``, in one sentence: its other keys' errors only follow from that type.

Of the union members pydantic tried, the error named is the deepest one under the first error's field
(e.g. an image part in ``content``: ``messages.0.content.0.type``, not ``messages.0.content``, the
string member's error).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

from gateway.errors import APIError, bad_request
from gateway.openai_requests import UNKNOWN_TYPE, UNSUPPORTED_TYPE

MAX_LISTED = 8  # validation errors of one field listed in a 400's message
_NO_BODY = object()
# what pydantic-core names a union member by: a type (str, list[...], literal[...], function-after[...])
# or a model's class name
_MEMBER = re.compile(r"^(str|int|float|bool|bytes|none|dict|list|any)$|\[|^[A-Z][A-Za-z0-9_]*$")

Path = list[str | int]


def client_path(loc: Sequence[Any], body: Any = _NO_BODY, missing: bool = False) -> Path:
    """``loc`` (a pydantic error's location, without FastAPI's leading ``body``) with the segments that
    are not keys or indices of the body dropped. With ``body`` (the JSON the client sent) a segment is
    kept when the body has it there (a dict key, a list index), or when it is the last and the error
    says it is ``missing``; without it, the segments that look like union members (``_MEMBER``) go."""
    out: Path = []
    value = body
    for i, seg in enumerate(loc):
        if body is _NO_BODY:
            if not (isinstance(seg, str) and _MEMBER.search(seg)):
                out.append(seg)
            continue
        in_dict = isinstance(value, dict) and isinstance(seg, str) and seg in value
        if in_dict or (isinstance(value, list) and isinstance(seg, int) and 0 <= seg < len(value)):
            value = value[seg]
        elif not (missing and i == len(loc) - 1):
            continue
        out.append(seg)
    return out


_TYPE_TAG_ERRORS = (UNSUPPORTED_TYPE, UNKNOWN_TYPE)  # an item's ``type`` it does not take (check_type)
# pydantic's type errors (strict types: no coercion) → the JSON type the field takes
_EXPECTED = {"int_type": "an integer", "float_type": "a number", "bool_type": "a boolean",
             "string_type": "a string", "list_type": "an array", "dict_type": "an object",
             "model_type": "an object", "model_attributes_type": "an object"}


def json_kind(value: Any) -> str:
    """``value``'s JSON type as a 400 names it, with the value when it is a scalar (a string cut at 40
    characters): ``a string ('3')``, ``a boolean (true)``, ``an array``."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"a boolean ({'true' if value else 'false'})"
    if isinstance(value, int):
        return f"an integer ({value})"
    if isinstance(value, float):
        return f"a number ({value!r})"
    if isinstance(value, str):
        return f"a string ({value[:40]!r}{'...' if len(value) > 40 else ''})"
    return "an array" if isinstance(value, list) else "an object" if isinstance(value, dict) else "a value"


def _wording(error: Any) -> str:
    """One error's text: a type error says the type expected and the JSON type sent (``must be an
    integer, got a string ('3')``); any other is pydantic's message."""
    expected = _EXPECTED.get(error.get("type", ""))
    if expected is not None and "input" in error:
        return f"must be {expected}, got {json_kind(error['input'])}"
    return str(error.get("msg", "invalid value"))


def _paths(errors: Sequence[Any], body: Any) -> list[Path]:
    return [client_path([x for x in e.get("loc", ())], body, e.get("type") == "missing") for e in errors]


def validation_error(errors: Sequence[Any], body: Any = _NO_BODY,
                     rename: Callable[[str], str] = lambda p: p) -> APIError:
    """The 400 of pydantic ``errors`` (locations relative to ``body``, the JSON sent, when given);
    ``rename`` maps a client path to the name the client knows it by (the Responses field of a chat
    field)."""
    if not errors:
        return bad_request("invalid request")
    paths = _paths(errors, body)
    tagged = next((i for i, e in enumerate(errors) if e.get("type") in _TYPE_TAG_ERRORS), None)
    if tagged is not None:  # an item of a type pdserve does not take: its other keys' errors follow from it
        where = paths[tagged]
        param = rename(".".join(str(x) for x in where)) if where else None
        code = UNSUPPORTED_TYPE if errors[tagged]["type"] == UNSUPPORTED_TYPE else None
        return bad_request(f"{param}: {errors[tagged].get('msg')}", param, code)
    root = paths[0]
    under = [i for i, p in enumerate(paths) if p[:len(root)] == root]
    chosen = max(under, key=lambda i: (len(paths[i]), -i))
    first, where = errors[chosen], paths[chosen]
    param = rename(".".join(str(x) for x in where)) if where else None
    if first.get("type") == "json_invalid":
        return bad_request("request body is not valid JSON")
    if first.get("type") == "extra_forbidden":
        return bad_request(f"unknown field '{param}': neither an OpenAI field nor one of pdserve's "
                           "extensions (README.md, 'Request fields')", param, "unknown_field")
    listed: list[str] = []
    for i in [chosen, *range(len(errors))]:
        p = paths[i]
        if (where and p[:1] != where[:1]) or (len(p) < len(where) and where[:len(p)] == p):
            continue  # another field, or a shallower union member's error than the one named
        name = rename(".".join(str(x) for x in p)) if p else "body"
        line = f"{name}: {_wording(errors[i])}"
        if line not in listed:
            listed.append(line)
    return bad_request("; ".join(listed[:MAX_LISTED]), param)
