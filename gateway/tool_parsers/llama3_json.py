"""Llama 3.x JSON tool calls: the whole answer is one call ``{"name": ..., "parameters": {...}}`` (or
``"arguments"``), or several separated by ``;``, optionally after ``<|python_tag|>`` (Meta's Llama 3.1
model card, "JSON based tool calling"). An answer that starts otherwise is plain content, streamed as it
comes; one that starts like a call is held to its end and, when it does not decode as calls, given back
as content unchanged.
"""

from __future__ import annotations

import json

from gateway.tool_parsers.base import ToolCallParser, call_from_json
from gateway.tool_parsers.events import ContentText, Event

PYTHON_TAG = "<|python_tag|>"


def _split_calls(body: str) -> list[tuple[str, str]] | None:
    """The calls of ``body`` (objects separated by ``;`` and whitespace), or None when it is not that."""
    decoder, pos = json.JSONDecoder(), 0
    calls: list[tuple[str, str]] = []
    while True:
        while pos < len(body) and (body[pos].isspace() or (calls and body[pos] == ";")):
            pos += 1
        if pos == len(body):
            return calls or None
        try:
            obj, pos = decoder.raw_decode(body, pos)
        except ValueError:
            return None
        call = call_from_json(obj, ("parameters", "arguments"))
        if call is None:
            return None
        calls.append(call)


class Llama3JsonParser(ToolCallParser):
    """Streaming parser of Llama-3 JSON calls (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self._buf = ""
        self._mode: str = "undecided"  # then "content" or "candidate"

    def feed(self, text: str) -> list[Event]:
        if self._mode == "content":
            return [ContentText(text)] if text else []
        self._buf += text
        if self._mode == "candidate":
            return []
        head = self._buf.lstrip()
        if not head or (PYTHON_TAG.startswith(head) and head != PYTHON_TAG):
            return []
        if head.startswith(("{", PYTHON_TAG)):
            self._mode = "candidate"
            return []
        self._mode = "content"
        out, self._buf = self._buf, ""
        return [ContentText(out)]

    def finish(self) -> list[Event]:
        buf, self._buf = self._buf, ""
        if self._mode != "candidate":
            return [ContentText(buf)] if buf else []
        body = buf.lstrip()
        calls = _split_calls(body.removeprefix(PYTHON_TAG))
        if calls is None:
            return [ContentText(buf)]
        out: list[Event] = []
        for name, arguments in calls:
            out += self.emit_call(name, arguments)
        return out
