"""The structural tag that holds ``strict`` function tools to their schemas under ``tool_choice`` ``auto``:
the output stays free text, but wherever the tool-call parser would read a call, the grammar forces a
well-formed call to one of the request's tools, in the parser's format.

The tag is an xgrammar structural tag (JSON; compiled on the workers, ``engine/structured_output.py``,
kind ``structural_tag``), built here as plain JSON because the gateway imports no xgrammar (it needs
torch). A call's arguments are a ``json_schema`` section: a strict tool's ``parameters`` (its schema
as given; none: an empty object), a non-strict tool's any JSON object; at most one whitespace character
in a row between JSON tokens (``max_whitespace_cnt``), so a small model cannot loop on whitespace.

What each parser reads as a call, and what the tag forces (``<name>`` one of the tools, ``<args>`` its
arguments):

* ``hermes``: a ``<tool_call>`` anywhere in the text starts a block: after it the grammar forces
  ``\\n{"name": "<name>", "arguments": <args>}\\n</tool_call>``; any text around the blocks; with
  ``parallel_tool_calls`` false the output ends after the first block.
* ``llama3_json``: the answer is calls when it starts (after whitespace) with ``{`` or
  ``<|python_tag|>``, else all content. The tag is one of: calls
  ``{"name": "<name>", "parameters": <args>}`` (optionally after ``<|python_tag|>``, joined by ``;``
  when parallel calls are allowed, only whitespace after the last); or content whose first
  non-whitespace character is not ``{`` and that does not start with ``<|python_tag|>``; or whitespace.
* ``mistral``: ``[TOOL_CALLS]`` anywhere starts calls, and an answer that starts (after whitespace) with
  ``[{`` is calls too. The tag forces, after ``[TOOL_CALLS]`` (and for an answer that starts with
  ``[``), the array form ``[{"name": "<name>", "arguments": <args>}, ...]`` (one element when parallel
  calls are off); the output ends after it. Content may not start with ``[{``, nor with ``[`` followed by
  a ``[`` or a partial ``[TOOL_CALLS]``; the v11 form ``[TOOL_CALLS]<name>[ARGS]{...}`` is not produced.

"Whitespace" at the start of an answer is Python's (``str.isspace``), as the parsers strip it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

HERMES_TRIGGER = "<tool_call>"
PYTHON_TAG = "<|python_tag|>"
MISTRAL_MARKER = "[TOOL_CALLS]"
MAX_WHITESPACE = 1  # whitespace characters in a row between the JSON tokens of a call's arguments
ANY_OBJECT: dict[str, Any] = {"type": "object"}
# parsers whose format the tag can express (the others' strict tools are refused under auto)
CONSTRAINABLE = ("hermes", "llama3_json", "mistral")

_JSON_WS = r"[ \t\r\n]*"
# every character str.isspace() accepts (the parsers strip these)
_PY_WHITESPACE = ("\t\n\x0b\x0c\r\x1c\x1d\x1e\x1f \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005"
                  "\u2006\u2007\u2008\u2009\u200a\u2028\u2029\u202f\u205f\u3000")
_REGEX_SPECIAL = frozenset("\\.[]{}()*+?|^$-")


@dataclass(frozen=True)
class ToolSchema:
    """One tool as the grammar sees it: its ``name`` and the JSON schema its arguments must satisfy."""

    name: str
    arguments: dict[str, Any]


def _char(c: str) -> str:
    """``c`` for a regular expression (also inside a character class): escaped, or as ``\\uXXXX``."""
    if c in _REGEX_SPECIAL:
        return "\\" + c
    if c == " " or (c.isprintable() and c.isascii()):
        return c
    return f"\\u{ord(c):04x}" if ord(c) <= 0xFFFF else f"\\U{ord(c):08x}"


def _class(chars: str, negate: bool = False) -> str:
    return "[" + ("^" if negate else "") + "".join(_char(c) for c in chars) + "]"


def _literal(text: str) -> str:
    return "".join(_char(c) for c in text)


def _not_completing(literal: str, start: int, also_not: str = "") -> str:
    """A regex of the strings that start like ``literal`` (at least its first ``start`` characters) and
    then differ from it before its end, the differing character not one of ``also_not``."""
    return "(?:" + "|".join(_literal(literal[:k]) + _class(literal[k] + also_not, negate=True)
                            for k in range(start, len(literal))) + ")"


def _regex(pattern: str) -> dict[str, Any]:
    return {"type": "regex", "pattern": pattern}


def _const(value: str) -> dict[str, Any]:
    return {"type": "const_string", "value": value}


def _sequence(*elements: dict[str, Any]) -> dict[str, Any]:
    return {"type": "sequence", "elements": list(elements)}


def _or(*elements: dict[str, Any]) -> dict[str, Any]:
    return {"type": "or", "elements": list(elements)}


def _call(begin: str, tool: ToolSchema, argument_key: str, end: str) -> dict[str, Any]:
    """``begin{"name": "<name>", "<argument_key>": <args>}end`` as a tag (name and key JSON-encoded)."""
    return {"type": "tag",
            "begin": f'{begin}{{"name": {json.dumps(tool.name)}, {json.dumps(argument_key)}: ',
            "content": {"type": "json_schema", "json_schema": tool.arguments,
                        "max_whitespace_cnt": MAX_WHITESPACE},
            "end": "}" + end}


def _one_call(tools: list[ToolSchema], argument_key: str) -> dict[str, Any]:
    calls = [_call("", t, argument_key, "") for t in tools]
    return calls[0] if len(calls) == 1 else _or(*calls)


def _calls(tools: list[ToolSchema], argument_key: str, separator: dict[str, Any],
           parallel: bool) -> dict[str, Any]:
    """One call, or (``parallel``) one or more joined by ``separator``."""
    call = _one_call(tools, argument_key)
    if not parallel:
        return call
    return _sequence(call, {"type": "star", "content": _sequence(separator, call)})


def hermes_format(tools: list[ToolSchema], parallel: bool) -> dict[str, Any]:
    """Free text with ``<tool_call>`` blocks (module docstring)."""
    return {"type": "triggered_tags", "triggers": [HERMES_TRIGGER],
            "tags": [_call(HERMES_TRIGGER + "\n", t, "arguments", "\n</tool_call>") for t in tools],
            "at_least_one": False, "stop_after_first": not parallel}


def llama3_json_format(tools: list[ToolSchema], parallel: bool) -> dict[str, Any]:
    """The whole answer calls, or content that does not start like them (module docstring)."""
    calls = _sequence(_regex(_JSON_WS), {"type": "optional", "content": _const(PYTHON_TAG)}, _regex(_JSON_WS),
                      _calls(tools, "parameters", _regex(_JSON_WS + ";" + _JSON_WS), parallel),
                      _regex(_JSON_WS))
    head = _class(_PY_WHITESPACE) + "*(?:" + _class(_PY_WHITESPACE + "{<", negate=True) + "|" + \
        _not_completing(PYTHON_TAG, 1) + ")"
    return _or(calls, _sequence(_regex(head), {"type": "any_text"}), _regex(_class(_PY_WHITESPACE) + "*"))


def mistral_format(tools: list[ToolSchema], parallel: bool) -> dict[str, Any]:
    """Calls after ``[TOOL_CALLS]`` or at the start, free text otherwise (module docstring)."""
    calls = _calls(tools, "arguments", _const(", "), parallel)
    array = _sequence(_const("["), calls, _const("]"))
    marker_calls = _sequence(_const(MISTRAL_MARKER), _regex(_JSON_WS), array)
    after_content = {"type": "triggered_tags", "triggers": [MISTRAL_MARKER],
                     "tags": [{"type": "tag", "begin": MISTRAL_MARKER,
                               "content": _sequence(_regex(_JSON_WS), _const("["), calls), "end": "]"}],
                     "at_least_one": False, "stop_after_first": True}
    # the answer's first characters: "[{" would be a bare array of calls, "[" + a marker's start could
    # hide a marker, so content starting with "[" continues with neither "{", "[" nor the marker's "T"
    # (or with a "T" that does not complete the marker)
    head = _class(_PY_WHITESPACE) + "*(?:" + "|".join([
        _class(_PY_WHITESPACE + "[", negate=True),
        r"\[" + _class("{[T", negate=True),
        _not_completing(MISTRAL_MARKER, 2, also_not="[")]) + ")"
    ws = _regex(_class(_PY_WHITESPACE) + "*")
    return _or(_sequence(_regex(_JSON_WS), array),
               _sequence(ws, marker_calls),
               _sequence(_regex(head), after_content),
               ws)


FORMATS = {"hermes": hermes_format, "llama3_json": llama3_json_format, "mistral": mistral_format}


def auto_tool_structural_tag(parser: str, tools: list[ToolSchema], parallel: bool) -> dict[str, Any]:
    """The structural tag (``{"type": "structural_tag", "format": ...}``) of a ``tool_choice`` ``auto``
    request with strict tools, for tool-call parser ``parser`` (one of ``CONSTRAINABLE``)."""
    return {"type": "structural_tag", "format": FORMATS[parser](tools, parallel)}


__all__ = ["ANY_OBJECT", "CONSTRAINABLE", "ToolSchema", "auto_tool_structural_tag", "hermes_format",
           "llama3_json_format", "mistral_format"]
