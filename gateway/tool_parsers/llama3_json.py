"""Llama 3.x JSON tool calls: the whole answer is one call ``{"name": ..., "parameters": {...}}`` (or
``"arguments"``), or several separated by ``;``, optionally after ``<|python_tag|>`` (Meta's Llama 3.1
model card, "JSON based tool calling"). An answer that starts otherwise is plain content, streamed as it
comes. One that starts like a call is read call by call (``call_reader.CallReader``: arguments stream as
written); when its first object is not a call, the whole answer is content, unchanged; text after the
last call that does not start another one is content.
"""

from __future__ import annotations

from gateway.tool_parsers.base import ToolCallParser
from gateway.tool_parsers.call_reader import CallReader
from gateway.tool_parsers.events import Event

PYTHON_TAG = "<|python_tag|>"
ARGUMENT_KEYS = ("parameters", "arguments")


class Llama3JsonParser(ToolCallParser):
    """Streaming parser of Llama-3 JSON calls (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self._buf = ""  # undecided: the answer so far; calls: everything not yet part of a call
        self._mode: str = "undecided"  # then "content" or "calls"
        self._reader: CallReader | None = None

    def feed(self, text: str) -> list[Event]:
        if self._mode == "content":
            return self.content.write(text)
        if self._mode == "calls":
            return self._calls(text)
        self._buf += text
        head = self._buf.lstrip()
        if not head or (PYTHON_TAG.startswith(head) and head != PYTHON_TAG):
            return []
        if head.startswith(("{", PYTHON_TAG)):
            self._mode, pending, self._buf = "calls", self._buf, ""
            body = pending.lstrip().removeprefix(PYTHON_TAG)
            self._buf = pending[:len(pending) - len(body)]  # given back with the rest if no call follows
            return self._calls(body)
        self._mode = "content"
        out, self._buf = self._buf, ""
        return self.content.write(out)

    def _calls(self, text: str) -> list[Event]:
        """Read calls and their separators; at text that is neither, the rest is content."""
        out: list[Event] = []
        pos = 0
        while pos < len(text):
            if self._reader is not None:
                events, used = self._reader.feed(text[pos:])
                out += events
                if used is None:
                    return out
                reader, self._reader = self._reader, None
                pos += used
                if reader.outcome == "not_call":
                    return out + self._to_content(reader.raw + text[pos:])
                self._buf = ""
                self.content.call_ends()
                continue
            ch = text[pos]
            if ch.isspace() or (ch == ";" and self.num_calls):
                self._buf += ch
                pos += 1
            elif ch == "{":
                self._reader = CallReader(self, ARGUMENT_KEYS)
            else:
                return out + self._to_content(text[pos:])
        return out

    def _to_content(self, text: str) -> list[Event]:
        """The answer goes on as content: the text not yet part of a call (all of it when no call came)
        and ``text``."""
        self._mode, held, self._buf = "content", self._buf, ""
        return self.content.write(held + text)

    def finish(self) -> list[Event]:
        out: list[Event] = []
        if self._reader is not None:
            reader, self._reader = self._reader, None
            out += reader.finish()
            if reader.outcome == "not_call":
                out += self._to_content(reader.raw)
            else:
                self.content.call_ends()
        elif self._buf and (self._mode != "calls" or not self.num_calls):
            out += self.content.write(self._buf)
        self._buf = ""
        return out + self.content.finish()
