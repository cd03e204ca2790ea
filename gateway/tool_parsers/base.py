"""The shape of a tool-call parser, the content rules every format shares, and the decoding of one call's
JSON object.

Content rules (the same streamed and not): text outside the calls is content, except whitespace that
touches a call (between two calls, before the first call, after the last), which is dropped; a choice
without calls keeps its text exactly. A call whose text does not decode (not JSON, no ``name``,
arguments not an object) stays in the content as the model wrote it, never a silent drop.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from typing import Any

from gateway.tool_parsers.events import ContentText, Event, ToolCallArguments, ToolCallStart, new_call_id


class ContentWriter:
    """Content text with the whitespace rule: trailing whitespace is held until non-whitespace follows
    (then written) or a call starts (then dropped); after a call, leading whitespace is dropped."""

    def __init__(self) -> None:
        self._held = ""
        self._after_call = False

    def write(self, text: str) -> list[Event]:
        """Events for ``text`` (content that is not part of a call)."""
        if self._after_call:
            text = text.lstrip()
            if not text:
                return []
            self._after_call = False
        joined = self._held + text
        body = joined.rstrip()
        self._held = joined[len(body):]
        return [ContentText(body)] if body else []

    def call_starts(self) -> None:
        """A call starts: whitespace held before it is dropped."""
        self._held = ""

    def call_ends(self) -> None:
        """A call ended: whitespace right after it is dropped."""
        self._after_call = True

    def finish(self) -> list[Event]:
        """The whitespace still held (the text ended with it, after content)."""
        held, self._held = self._held, ""
        return [ContentText(held)] if held else []


def call_from_json(obj: Any, argument_keys: tuple[str, ...] = ("arguments", "parameters")) -> \
        tuple[str, str] | None:
    """(name, arguments as a JSON text) of a decoded call object ``{"name": ..., "arguments": {...}}``
    (the arguments under the first of ``argument_keys`` present; none: ``{}``), or None when ``obj`` is not
    a call (not an object, no string ``name``, arguments neither an object nor a JSON text of one)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args: Any = next((obj[k] for k in argument_keys if k in obj), {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return obj["name"], json.dumps(args, ensure_ascii=False)


class ToolCallParser(ABC):
    """Reads one choice's text (after any reasoning) and emits content and tool-call events. One instance
    per choice; ``feed`` any number of times, then ``finish`` once."""

    def __init__(self) -> None:
        self.content = ContentWriter()
        self.num_calls = 0

    @abstractmethod
    def feed(self, text: str) -> list[Event]:
        """Events for the next piece of text (possibly none: text held until it can be told apart)."""

    @abstractmethod
    def finish(self) -> list[Event]:
        """Events for the text still held when the choice ends."""

    def emit_call(self, name: str, arguments: str) -> list[Event]:
        """The events of one whole call: its start (a new id) and its arguments as one fragment."""
        index = self.num_calls
        self.num_calls += 1
        return [ToolCallStart(index, new_call_id(), name), ToolCallArguments(index, arguments)]
